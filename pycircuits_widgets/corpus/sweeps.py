"""``sweep(model, corpus, store)``: one pass over a corpus's windows recording, per head and per neuron,
what a researcher reads to decide what it does; ``Sweep`` reads the result back.

What is recorded is described in ``record.py`` (per batch), how it merges in ``accumulators.py`` and
how it is kept in ``store.py``. The windows are cut by the rule of ``windows.py``. Windows are
grouped into shards of ``shard_windows`` windows (a multiple of ``batch_size``); a shard is the unit of
work an engine runs, of resumption and of merging. Engines: ``"serial"`` (this process, ``device=``)
and ``"ray"`` (``ray_engine.py``: actors on a Ray cluster); both write the same store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..analysis.cache import MODEL, cached
from ..analysis.circuits import model_name
from ..analysis.head_scores import SCORE_NAMES
from ..analysis.head_scores import head_scores as analysis_head_scores
from ..models.circuit_model import CircuitModel, weight_shapes
from ..progress import progress as progress_bar
from .arguments import check_positive
from .documents import Corpus, CorpusError
from .memory import release_free_memory
from .store import FinishedStore, Store, check_identity, read_manifest
from .windows import RULE, separator_id, tokenizer_identity, window_blocks

ENGINES = ("serial", "ray")
BATCH_TOKENS = 2048
"""Default tokens per batch: ``batch_size = max(1, BATCH_TOKENS // seq_len)``."""
SHARD_TOKENS = 1 << 15
"""Default tokens per shard (rounded to whole batches)."""
MAX_K = 1000
"""The most examples a sweep keeps per head and per neuron (``k``)."""


@dataclass(frozen=True)
class SweepProgress:
    """What a ``progress`` callback receives after each recorded shard."""

    shard: int
    shards_done: int
    windows_done: int
    tokens_done: int
    tokens_per_s: float


def model_fingerprint(model) -> str:
    """sha256 (hex) of what the model computes: its config but its name, and every weight's name, dtype,
    shape and bytes. Not the name: the same weights may be named otherwise on another machine sharing a
    store (a folder's own name, a user's ``name=``)."""
    config = {key: value for key, value in dataclasses.asdict(model.cfg).items() if key != "name"}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name in weight_shapes(model.cfg):
        w = getattr(model, name)
        if w is None:
            continue
        h.update(f"{name}:{w.dtype}:{tuple(w.shape)}".encode())
        h.update(w.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def checked_sweep(sweep, model, who: str) -> Sweep | None:
    """``sweep`` if it is None or a ``Sweep`` of ``model`` (``Sweep.check_model``); a ``TypeError`` naming
    ``who`` for anything else."""
    if sweep is not None and not isinstance(sweep, Sweep):
        raise TypeError(f"{who}: sweep must be a pcw.Sweep (pcw.sweep(model, corpus, store) or pcw.Sweep.open(store)) "
                        f"or None, got {type(sweep).__name__}")
    if sweep is not None:
        sweep.check_model(model, who)
    return sweep


def _check_model(model) -> None:
    from ..models import weight_view_hint

    if not isinstance(model, CircuitModel):
        raise TypeError(f"sweep takes a CircuitModel (pcw.load_pretrained, pcw.from_hf, ...), got "
                        f"{type(model).__name__}{weight_view_hint(model)}")
    model.run_with_cache(torch.zeros(1, 1, dtype=torch.long), logits=False)  # a view without a forward refuses here
    if model.tokenizer is None:
        raise ValueError(f"model {model.cfg.name!r} has no tokenizer: a corpus of text cannot be cut into its tokens")


def store_path(store) -> Path:
    """``store`` as a ``Path``, or a ``TypeError`` naming the argument and what it takes."""
    if not isinstance(store, (str, os.PathLike)):
        raise TypeError(f"store must be a folder's path (str or os.PathLike), got {type(store).__name__}")
    return Path(store)


def _settings(model, seq_len, k, max_windows, batch_size, shard_windows, scores_only) -> dict:
    """The sweep's settings, checked (``batch_size`` and ``shard_windows`` given or defaulted by the caller)."""
    for name, value in (("k", k), ("batch_size", batch_size), ("shard_windows", shard_windows),
                        ("max_windows", 1 if max_windows is None else max_windows)):
        check_positive(name, value)
    if k > MAX_K:
        raise ValueError(f"k must be at most {MAX_K} examples per head and neuron, got {k} (each example costs "
                         "memory and merge time in every shard)")
    if not isinstance(scores_only, bool):
        raise TypeError(f"scores_only must be True or False, got {scores_only!r}")
    if seq_len > model.cfg.n_ctx:
        raise ValueError(f"seq_len {seq_len} is longer than the model's context (n_ctx={model.cfg.n_ctx})")
    if shard_windows % batch_size:
        raise ValueError(f"shard_windows ({shard_windows}) must be a multiple of batch_size ({batch_size})")
    return {"seq_len": seq_len, "k": k, "max_windows": max_windows, "batch_size": batch_size,
            "shard_windows": shard_windows, "scores_only": scores_only}


def sweep(model, corpus: Corpus, store, *, seq_len: int = 128, k: int = 20, max_windows: int | None = None,
          engine: str = "serial", batch_size: int | None = None, shard_windows: int | None = None, device=None,
          progress: bool | Callable[[SweepProgress], None] = True, scores_only: bool = False,
          **engine_options) -> Sweep:
    """Sweep ``model`` over ``corpus``'s windows of ``seq_len`` tokens (the first ``max_windows``), keeping
    the result in the folder ``store``; returns the ``Sweep`` that reads it.

    Records (``record.py``): every head's top ``k`` ``(window, position)`` by ``||head_out||`` with the
    source it attends to most; every MLP neuron's top ``k`` by post-activation; every head's
    previous-token, duplicate-token and induction score pooled over the corpus and its mean output;
    every neuron's mean and fraction of positions > 0. ``scores_only``: the head scores alone.

    ``engine``: ``"serial"`` (this process; ``device=`` moves the model there) or ``"ray"`` (options:
    ``address``, ``workers``, ``cpus_per_worker``, ``num_gpus``; see ``ray_engine.run``). Both write the
    same store. Run again with the same arguments, an interrupted sweep resumes where its store ends; a
    store made with another model, corpus or settings is refused (``StoreMismatch``) naming what differs.
    ``progress``: a bar in the cell (tokens/s) if True; a callable also receives a ``SweepProgress``
    after every recorded shard.

    Both sizes count windows: ``batch_size``, the windows of one forward pass (memory: one batch's
    activations; default ``2048 // seq_len``, 2,048 tokens); ``shard_windows``, the windows of one shard,
    the unit of work, of resuming and of progress, a multiple of ``batch_size`` (default: whole batches
    making about 32,768 tokens, 256 windows of 128)."""
    if "shard_size" in engine_options:
        raise TypeError("sweep: shard_size is now shard_windows: it counts windows of seq_len tokens, not tokens "
                        "(the default, about 32,768 tokens, is 256 windows of 128)")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "serial" and engine_options:
        raise TypeError(f"sweep: unexpected arguments {sorted(engine_options)} (engine options are for engine='ray')")
    if not isinstance(corpus, Corpus):
        raise TypeError(f"sweep takes a pcw.Corpus (Corpus.from_texts, .from_files, ...), got {type(corpus).__name__}")
    if not isinstance(progress, bool) and not callable(progress):
        raise TypeError(f"progress must be True, False or a callable taking a SweepProgress, got {progress!r}")
    store = store_path(store)
    _check_model(model)
    check_positive("seq_len", seq_len)
    # None: the default; anything else is checked as given (a 0 is refused, not taken for the default)
    batch_size = max(1, BATCH_TOKENS // seq_len) if batch_size is None else batch_size
    if shard_windows is None:
        check_positive("batch_size", batch_size)
        shard_windows = batch_size * max(1, SHARD_TOKENS // (batch_size * seq_len))
    settings = _settings(model, seq_len, k, max_windows, batch_size, shard_windows, scores_only)
    tokenizer = model.tokenizer
    identity = {
        "model": {"fingerprint": model_fingerprint(model)},
        "corpus": {"fingerprint": corpus.fingerprint},
        "tokenization": {"tokenizer": tokenizer_identity(tokenizer), "separator": separator_id(tokenizer), "rule": RULE},
        "settings": settings,
    }
    info = {"corpus": {"description": corpus.description, "documents": corpus.documents,
                       "skipped": dict(corpus.skipped)},
            # the name as its user calls it (no folder of the author's machine: a store is shared)
            "model": {"name": model_name(model),
                      **{k: getattr(model.cfg, k) for k in ("n_layers", "n_heads", "d_model", "d_head", "d_mlp", "d_vocab")}}}
    finished = _finished(store, identity)
    if finished is not None:
        return finished
    store = Store(store, identity, info)
    try:
        if not store.complete:
            _run(model, corpus, store, settings, engine, device, progress, engine_options)
            store.finish(model)
    finally:
        store.close()
    return Sweep(store.path)


def _finished(path: Path, identity: dict) -> Sweep | None:
    """The finished sweep of ``identity`` kept at ``path``, read without the writer's lock or any write (a
    store on read-only media reads back; one of another sweep is refused here, naming what differs); None
    where there is none (``Store`` then makes one or says why it cannot)."""
    try:
        manifest = read_manifest(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not manifest["complete"]:
        return None
    check_identity(path, manifest, identity)
    return Sweep(path)


def _run(model, corpus, store: Store, settings: dict, engine: str, device, progress, options) -> None:
    seq_len, shard_windows, stop = settings["seq_len"], settings["shard_windows"], settings["max_windows"]
    checked = [0]  # windows made only of documents checked against the corpus's scan (windows.window_blocks)
    recorded = store.recorded()
    first = min(set(range(len(recorded) + 1)) - recorded)
    known = store.manifest["windows"]
    todo_windows = (known if known is not None else stop) or None
    remaining = None if todo_windows is None else max(0, todo_windows - len(recorded) * shard_windows) * seq_len
    last = [None]  # (shard, windows in it) of the last shard the stream produced

    def todo():
        blocks = window_blocks(corpus, model.tokenizer, seq_len, shard_windows, start=first * shard_windows, stop=stop,
                               on_checked=lambda n: checked.__setitem__(0, n))
        for shard, block in enumerate(blocks, start=first):
            last[0] = (shard, len(block))
            if shard not in recorded:
                yield shard, block
        checked[0] = math.inf  # read to its end: every document checked

    if known is not None and len(recorded) == store.manifest["shards"]:
        return
    if engine == "serial":
        from .engines import serial as run_engine
    else:
        from .ray_engine import run as run_engine
    bar = progress_bar("sweep", total=remaining, unit="tok") if progress else None
    ticked = [0]  # tokens of the shard in flight the bar has counted (the serial engine ticks per batch)

    def on_batch(windows: int) -> None:
        ticked[0] += windows * seq_len
        bar.update(windows * seq_len)

    if bar is not None and engine == "serial":
        options = {**options, "on_batch": on_batch}
    start, tokens = time.monotonic(), 0
    windows_done = len(recorded) * shard_windows if known is None else min(len(recorded) * shard_windows, known)
    try:
        for shard, windows, acc in run_engine(model, settings, prefetched(todo()), device=device, **options):
            # a shard is kept for good only once its documents are checked: a file changed mid-sweep
            # must leave no shard of its changed text behind to resume from
            store.record(shard, windows, acc, model.cfg.d_vocab, checked=shard * shard_windows + len(windows) <= checked[0])
            store.confirm(checked[0])
            release_free_memory()  # memory.py: else the heap's freed memory grows with the shards run
            n = len(windows) * seq_len
            tokens += n
            windows_done += len(windows)
            if bar is not None:
                bar.update(n - ticked[0])
                ticked[0] = 0
            if callable(progress):
                progress(SweepProgress(shard, len(store.recorded()), windows_done, windows_done * seq_len,
                                       tokens / max(time.monotonic() - start, 1e-9)))
    finally:
        if bar is not None:
            bar.close()
    store.confirm(math.inf)  # the engine took every shard: the stream, and its checks, ended without error
    if last[0] is None:
        if first == 0:
            raise CorpusError(f"the corpus has no window: fewer than seq_len={seq_len} tokens in all")
        shards = first  # the stream ended where the recorded shards do
        windows = (shards - 1) * shard_windows + len(store.windows_of(shards - 1))
    else:
        shards = last[0][0] + 1
        windows = last[0][0] * shard_windows + last[0][1]
    store.end(shards, windows)


def prefetched(items: Iterator, depth: int = 1) -> Iterator:
    """``items``, produced by a background thread up to ``depth`` ahead: the corpus is tokenised while the
    model runs (torch releases the GIL inside its kernels). The producer's exception is raised here; when
    the consumer stops, the producer stops after at most one more item."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for item in items:
                if stop.is_set():
                    return
                slots.put((True, item))
            slots.put((False, None))
        except BaseException as err:  # noqa: BLE001 (handed to the consumer, which raises it)
            slots.put((False, err))

    thread = threading.Thread(target=produce, name="pcw-sweep-windows", daemon=True)
    thread.start()
    try:
        while True:
            more, value = slots.get()
            if not more:
                if value is not None:
                    raise value
                return
            yield value
    finally:
        stop.set()
        while thread.is_alive():  # free the slot a blocked producer waits on, until it sees the stop
            try:
                slots.get(timeout=1)
            except queue.Empty:
                pass
        thread.join()


class Sweep:
    """A finished sweep read from its store (``Sweep.open(path)``). Tables are pandas DataFrames, best
    first; tensors are CPU float32 (statistics) or int64 (``windows``)."""

    def __init__(self, path):
        self.path = store_path(path)
        self._store = FinishedStore(self.path)  # the store's layout is its own (``store.py``)
        self.manifest, self._stats = self._store.manifest, self._store.stats
        self._tables: dict = {}
        self._windows: torch.Tensor | None = None
        self._documents: np.ndarray | None = None
        info = self.manifest["info"]["model"]
        self.n_layers, self.n_heads, self.d_mlp = info["n_layers"], info["n_heads"], info["d_mlp"]

    @classmethod
    def open(cls, store) -> Sweep:
        """The finished sweep kept in the folder ``store``."""
        return cls(store)

    # --- what was swept ---------------------------------------------------------------------------
    @property
    def settings(self) -> dict:
        return dict(self.manifest["settings"])

    @property
    def seq_len(self) -> int:
        return self.manifest["settings"]["seq_len"]

    @property
    def k(self) -> int:
        return self.manifest["settings"]["k"]

    @property
    def n_windows(self) -> int:
        return self.manifest["windows"]

    @property
    def n_tokens(self) -> int:
        return self.n_windows * self.seq_len

    @property
    def model_name(self) -> str:
        """The swept model's name (``cfg.name``'s last part: ``analysis.circuits.model_name``)."""
        return self.manifest["info"]["model"]["name"]

    def check_model(self, model, who: str) -> None:
        """Refuse (``ValueError``, naming both models) a ``model`` other than the one swept: its
        ``model_fingerprint`` (config and every weight's bytes; computed once per model and weight edit:
        ``analysis.cache``) differs from the store's."""
        mine = cached(model, ("model_fingerprint",), lambda: model_fingerprint(model), tier=MODEL)
        if mine != self.manifest["model"]["fingerprint"]:
            raise ValueError(f"{who}: the sweep in {self.path} was made with model {self.model_name!r}, not with "
                             f"this model {model_name(model)!r} (their configs or weights differ); sweep this model "
                             "(pcw.sweep(model, corpus, store))")

    @property
    def skipped(self) -> dict:
        """Documents the corpus skipped, ``{reason: count}`` (``documents.py``)."""
        return dict(self.manifest["info"]["corpus"]["skipped"])

    @property
    def windows(self) -> torch.Tensor:
        """``[n_windows, seq_len]`` int64: the token ids swept (window ``w`` is row ``w``)."""
        if self._windows is None:
            self._windows = torch.from_numpy(self._store.windows())
        return self._windows

    def window_documents(self) -> np.ndarray | None:
        """``[n_windows]`` int64: the document (numbered from 0 in the order the corpus kept them) each
        window's first token belongs to, or None when the tokenizer writes no separator between
        documents. Not recorded by the sweep: derived from the windows by their rule (``windows.py``:
        the kept documents' tokens, each followed by the separator, cut into consecutive windows), so
        it counts the separators before the window. A document whose own text holds the separator's
        text (``<|endoftext|>``) is counted as more than one."""
        sep = self.manifest["tokenization"]["separator"]
        if sep is None:
            return None
        if self._documents is None:
            ends = (self.windows == sep).sum(1).numpy()
            self._documents = np.concatenate([[0], np.cumsum(ends)[:-1]]).astype(np.int64)
        return self._documents

    def document_at(self, window: int, position: int) -> int | None:
        """The document token ``position`` of window ``window`` belongs to (``window_documents``; a
        separator belongs to the document it ends); None without a separator."""
        docs = self.window_documents()
        if docs is None:
            return None
        sep = self.manifest["tokenization"]["separator"]
        return int(docs[window]) + int((self.windows[window, :position] == sep).sum())

    # --- examples ---------------------------------------------------------------------------------
    def head_examples(self, layer: int, head: int, by: str = "norm"):
        """Head ``(layer, head)``'s top ``k`` examples, best first: a DataFrame with ``window, position,
        score, source, attention, token, source_token`` (``token``/``source_token``: display strings).

        ``by="norm"``: ranked by ``||head_out||`` (``score``), ``source`` the position the head attends to
        most there. ``by`` a head score (``"induction"``, ``"previous_token"``, ``"duplicate_token"``):
        the positions where the head puts most attention on that score's targets (the token after an
        earlier copy of the current one, the previous token, an earlier copy), the column named ``by``
        holding that attention in place of ``score``, ``source`` the target it attends to most (fewer
        than ``k`` rows when the corpus has fewer positions with a target)."""
        if by != "norm" and by not in SCORE_NAMES:
            raise ValueError(f"head_examples: by must be 'norm' or one of {', '.join(map(repr, SCORE_NAMES))}, got {by!r}")
        layer, head = self._unit(layer, head, self.n_heads, "head")
        if by == "norm":
            return self._examples("heads", "head", layer, head)
        return self._examples(f"heads_by_{by}", "head", layer, head).rename(columns={"score": by})

    def neuron_examples(self, layer: int, neuron: int):
        """Neuron ``(layer, neuron)``'s top ``k`` examples by post-activation, best first: a DataFrame with
        ``window, position, score, token``."""
        if not self.d_mlp:
            raise ValueError("this sweep's model is attention-only: it has no MLP neurons")
        layer, neuron = self._unit(layer, neuron, self.d_mlp, "neuron")
        return self._examples("neurons", "neuron", layer, neuron)

    def _unit(self, layer, unit, n_units: int, what: str) -> tuple[int, int]:
        for name, value, n in (("layer", layer, self.n_layers), (what, unit, n_units)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < n:
                raise ValueError(f"{name} must be an int in 0..{n - 1}, got {value!r}")
        return int(layer), int(unit)

    def _examples(self, table: str, unit: str, layer: int, index: int):
        if self.manifest["settings"]["scores_only"]:
            raise ValueError("this sweep recorded head scores only (scores_only=True): no examples")
        if table not in self._tables:

            self._tables[table] = self._store.table(table)
        df = self._tables[table]
        rows = df[(df["layer"] == layer) & (df[unit] == index)].sort_values("rank")
        return rows.drop(columns=["layer", unit, "rank"]).reset_index(drop=True)

    # --- statistics -------------------------------------------------------------------------------
    def head_scores(self) -> dict[str, torch.Tensor]:
        """``{"previous_token", "duplicate_token", "induction"}``, each ``[n_layers, n_heads]``: the
        definitions of ``pcw.head_scores`` pooled over every window's positions (NaN: no target)."""
        return {name: self._stats[name].to(torch.float32) for name in SCORE_NAMES}

    def head_means(self) -> torch.Tensor:
        """``[n_layers, n_heads, d_model]`` float32: each head's mean output ``head_out`` over every position
        swept (without ``b_O``), for mean ablation."""
        self._require("head_out_mean")
        return self._stats["head_out_mean"].to(torch.float32)

    def neuron_means(self) -> torch.Tensor | None:
        """``[n_layers, d_mlp]`` float32: each neuron's mean post-activation over every position swept;
        None for an attention-only model."""
        if not self.d_mlp:
            return None
        self._require("neuron_mean")
        return self._stats["neuron_mean"].to(torch.float32)

    def neuron_fraction_positive(self) -> torch.Tensor | None:
        """``[n_layers, d_mlp]`` float32: the fraction of positions where each neuron is > 0; None for an
        attention-only model."""
        if not self.d_mlp:
            return None
        self._require("neuron_fraction_positive")
        return self._stats["neuron_fraction_positive"].to(torch.float32)

    def _require(self, name: str) -> None:
        if name not in self._stats:
            raise ValueError("this sweep recorded head scores only (scores_only=True): no means")

    def __repr__(self) -> str:
        m = self.manifest
        return (f"Sweep({str(self.path)!r}: model {self.model_name!r}, {self.n_windows} windows of "
                f"{self.seq_len} tokens, k={self.k}{', scores only' if m['settings']['scores_only'] else ''})")


def head_scores(model, tokens=None, *, seq_len: int | None = None, max_windows: int | None = None, store=None,
                **options) -> dict[str, torch.Tensor]:
    """``pcw.head_scores``: previous-token, duplicate-token and induction score of every head, each
    ``[n_layers, n_heads]`` (definitions: ``analysis.head_scores``).

    ``tokens`` a ``Corpus``: pooled over its windows of ``seq_len`` tokens (default ``min(128, n_ctx)``;
    the first ``max_windows``) by a scores-only ``sweep`` kept in ``store`` (default: a temporary folder,
    removed after), which takes the sweep's other options (``engine``, ``batch_size``, ...). Anything else
    (None, text, token ids): ``analysis.head_scores(model, tokens, **options)``."""
    if not isinstance(tokens, Corpus):
        if max_windows is not None or store is not None:
            raise TypeError("head_scores: max_windows and store are for a Corpus (pcw.Corpus...), got "
                            f"{type(tokens).__name__} tokens")
        return analysis_head_scores(model, tokens, seq_len=seq_len, **options)
    seq_len = min(128, model.cfg.n_ctx) if seq_len is None else seq_len
    if store is not None:
        return sweep(model, tokens, store, seq_len=seq_len, max_windows=max_windows, scores_only=True,
                     **options).head_scores()
    with tempfile.TemporaryDirectory(prefix="pcw-head-scores-") as tmp:
        return sweep(model, tokens, tmp, seq_len=seq_len, max_windows=max_windows, scores_only=True,
                     **options).head_scores()
