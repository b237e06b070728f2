"""DatasetExamples: where in a corpus a head (or an MLP neuron) fires most, each example in its context."""

from __future__ import annotations

import collections
import json
import math
import time

import numpy as np
import torch
import traitlets

from ...analysis.head_scores import SCORE_NAMES
from ...corpus.sweeps import checked_sweep
from ..core import offline
from ..core.base import CircuitWidget
from ..core.payload import JSON_BUFFER
from ..core.save_plan import EXAMPLES, PAGE_BYTES_PER_ANSWER_BYTE, PlanItem, forward_flops
from ..core.selection import HeadSelection, Index

BEFORE = 24
"""Tokens of context shown before an example's destination (fewer at the window's start)."""
AFTER = 4
"""Tokens shown after the destination (fewer at the window's end)."""
SAVED = 20
"""Most examples of each head a saved page keeps (``save_html``, notebook export); the page says when
the live view has more."""
SAVED_BUDGET = 160_000
"""Most bytes of the examples a page keeps where no save's plan sizes them (``page_items``; a notebook's
export): ``SAVED`` examples of each of 16 heads at 128-token windows; past it a head says it needs a kernel."""
GROUP = 16
"""Heads whose examples' windows a save reads again together, where no plan chose the heads (the view's
own budget decides how many fit: a group at a time, so little is read past it)."""
UNSHADED = ("This page saved this head's examples without the attention on each token (its save's time ran out "
            "first): a running kernel reads their windows again.")
"""What a saved page says over a head's examples saved without their attention (``page_items``)."""
SIZED = 8
"""Heads, spread over the model, whose saved rows a save's plan measures (the largest sizes every head's)."""
VALUE_CHARS = 6
"""Characters of one attention value in the saved JSON ("0.123,"): a plan's estimate of a head's bytes."""
KEPT_UNITS = 64
"""Heads (or neurons) whose rows with values the view keeps, the latest shown: a revisit re-runs no window."""
RERUN_BYTES = 64 << 20
"""Most bytes of attention patterns one re-run holds: the examples' windows run in batches under it."""

ATTENTION_DECIMALS = 3
"""The attention on a row's tokens is shown to this many decimals (``_attention``)."""

RANKINGS = ("norm", *SCORE_NAMES)
"""How a head's examples are ranked (``Sweep.head_examples(by=)``): ``||head_out||``, or its attention
on a head score's targets at the position (a neuron's, always by its post-activation)."""

CONTEXT_RULE = (f"Each row: up to {BEFORE} tokens before the destination (boxed) and {AFTER} after it, within "
                "its window; a head's strongest source further back is shown before a gap (…).")


def _short(x: float) -> float | None:
    """A value for the page: 4 significant digits (None for a non-finite one)."""
    return float(f"{x:.4g}") if math.isfinite(x) else None


def _attention(x: float) -> float:
    """An attention weight for the page, to ``ATTENTION_DECIMALS`` decimals (finer is no shade a reader
    sees; most of a row is then 0, which a saved page packs small)."""
    return round(x, ATTENTION_DECIMALS)


class DatasetExamples(HeadSelection, CircuitWidget):
    """A head's top ``k`` examples in a corpus sweep (``pcw.sweep``): the ``(window, position)`` where
    ``||head_out||`` is largest, each a row of the window's tokens around that destination position
    (``CONTEXT_RULE``: ``BEFORE`` tokens before, ``AFTER`` after), the destination marked and the
    head's attention from it shaded on every source in the row, with the score, the document and the
    window (attention shown to ``ATTENTION_DECIMALS`` decimals, activations and scores to 4 significant digits).
    ``rank_by`` a head score (``RANKINGS``): the positions where the head attends most to that role's
    targets instead (the token after an earlier copy, the previous token, an earlier copy), the examples
    that show a role a head's largest outputs (often on an attention sink) hide. With
    ``neuron`` (>= 0), neuron ``neuron`` of layer ``layer``'s MLP: its top examples by
    post-activation, its activation shaded on every token of the row.

    The rows come from the sweep at once; the attention (or activations) on the rows' tokens are the
    sweep's windows read again by ``model`` (``run_with_cache`` over the ``k`` windows, in batches of at
    most ``RERUN_BYTES`` of patterns), the same forward the sweep ran, and arrive right after. A
    window's document is counted from the separators in the sweep's windows
    (``Sweep.window_documents``). A saved page keeps ``SAVED`` examples of every head it can select,
    within ``SAVED_BUDGET`` bytes (current head first; a head past it says it needs a kernel).

    Args:
        sweep: a finished ``pcw.Sweep`` of ``model`` (a sweep of another model is refused, naming both).
        model: the swept model (its token strings and the re-run).
        layer, head: the head. neuron: an MLP neuron of ``layer`` instead (-1: the head).
        k: examples shown (default: all the sweep kept, ``sweep.k``).
        rank_by: ``"norm"`` (default) or a head score's name (``RANKINGS``).
        openable: rows are buttons that set ``opened`` (the explorer reads the example there).
    """

    _view = traitlets.Unicode("DatasetExamples").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "neuron", "opened", "rank_by"})
    _answers_offline = "runner"
    _offline_budget = SAVED_BUDGET

    neuron = Index(-1).tag(sync=True)
    """int, default -1: a neuron of layer ``layer``'s MLP whose examples are shown; -1: the head's."""
    rank_by = traitlets.Enum(RANKINGS, "norm").tag(sync=True)
    """str, default "norm": how a head's examples are ranked (``RANKINGS``; a neuron's by its activation)."""
    rows = traitlets.List().tag(sync=True, **JSON_BUFFER)
    """[{"window", "position", "score", "document" (None: not derivable), "segments": [{"start", "ids",
    "values"}], "source", "attention"}], best first: each example's tokens (ids into ``strings``) in one
    or two runs of window positions from ``start``; ``values`` (None until the re-run arrives) is the
    attention from the destination on each token (a neuron: its activation there); ``source`` and
    ``attention`` (heads): the position attended most and that attention, as the sweep recorded."""
    shown = traitlets.List().tag(sync=True)
    """[layer, head, neuron, rank_by] that ``rows`` answer (a page never shows one unit's rows under
    another, nor one ranking's under another)."""
    strings = traitlets.Dict().tag(sync=True, **JSON_BUFFER)
    """{str(token id): display string} of the tokens in ``rows``."""
    corpus = traitlets.Dict().tag(sync=True)
    """{"model", "windows", "seq_len", "k", "description", "documents"} (read-only): the sweep, for the caption."""
    cut = traitlets.Unicode("").tag(sync=True)
    """str (read-only): what a page without a kernel leaves out ("" when it keeps every example)."""
    openable = traitlets.Bool(False).tag(sync=True)
    """bool: clicking a row sets ``opened`` (the explorer then reads that example)."""
    opened = traitlets.List(traitlets.Int()).tag(sync=True)
    """[window, position] of the example last clicked ([] none)."""
    rule = traitlets.Unicode(CONTEXT_RULE).tag(sync=True)
    """str (read-only): how each row's context is cut."""

    def __init__(self, sweep, model, *, layer: int = 0, head: int = 0, neuron: int = -1, k: int | None = None,
                 rank_by: str = "norm", **kwargs):
        if checked_sweep(sweep, model, "DatasetExamples") is None:
            raise TypeError("DatasetExamples: sweep must be a pcw.Sweep (pcw.sweep(model, corpus, store) or "
                            "pcw.Sweep.open(store)), got None")
        if sweep.settings["scores_only"]:
            raise ValueError("DatasetExamples: this sweep recorded head scores only (scores_only=True): no examples")
        if neuron is None or neuron == -1:
            sweep.head_examples(layer, head)  # a clear ValueError for a layer or head out of range
        else:
            sweep.neuron_examples(layer, neuron)  # ... and for an attention-only model's neurons
        if rank_by not in RANKINGS:
            raise ValueError(f"DatasetExamples: rank_by must be one of {', '.join(map(repr, RANKINGS))}, got {rank_by!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= sweep.k):
            raise ValueError(f"DatasetExamples: k must be an int in 1..{sweep.k} (the examples the sweep kept), got {k!r}")
        self._sweep, self._k = sweep, k or sweep.k
        self._kept: collections.OrderedDict = collections.OrderedDict()  # unit -> rows with values (``_steps``)
        self._page_heads: list[tuple[int, int]] = []  # the heads a save's plan keeps (``page_items``); [] every head
        self._page_shaded: list[tuple[int, int]] = []  # ... and those of them it keeps the attention of
        info = sweep.manifest["info"]["corpus"]
        corpus = {"model": sweep.model_name, "windows": sweep.n_windows, "seq_len": sweep.seq_len, "k": self._k,
                  "description": info["description"], "documents": info["documents"]}
        cut = "" if self._k <= SAVED else (f"Without a kernel this page keeps {SAVED} of the {self._k} examples of "
                                           "each head (all of the head shown when it was saved).")
        super().__init__(model, layer=layer, head=head, neuron=-1 if neuron is None else neuron, corpus=corpus,
                         cut=cut, rank_by=rank_by, **kwargs)

    def _index_bounds(self, name):
        if name == "neuron":
            return 0, max((self._sweep.d_mlp or 0) - 1, 0), True
        return super()._index_bounds(name)

    @traitlets.validate("neuron")
    def _valid_neuron(self, proposal):
        if proposal["value"] >= 0 and not self._sweep.d_mlp:
            raise traitlets.TraitError("neuron: this sweep's model is attention-only: it has no MLP neurons")
        return proposal["value"]

    def _started(self) -> None:
        self.observe(self._on_unit, ["layer", "head", "neuron", "rank_by"])
        self._on_unit(None)

    def _on_unit(self, change) -> None:
        unit = (self.layer, self.head, self.neuron, self.rank_by)
        self._runner.submit("rows", lambda: self._steps(*unit))

    # -- results (on the runner) ------------------------------------------------------------
    def _steps(self, layer: int, head: int, neuron: int, rank_by: str = "norm"):
        """The rows from the sweep (at once), then with the re-run's values; a unit shown before
        answers with its values at once (the last ``KEPT_UNITS`` are kept: a revisit runs nothing)."""
        first = self.rows_patch(layer, head, neuron, rank_by)
        unit = (layer, head, neuron, rank_by)
        if unit in self._kept:
            self._kept.move_to_end(unit)
            yield {**first, "rows": self._kept[unit]}
            return
        yield first
        per_window: dict = {}
        yield from self._rerun(first["rows"], layer, head, neuron, per_window)
        rows = self._kept[unit] = self._valued(first["rows"], per_window, neuron)
        while len(self._kept) > KEPT_UNITS:
            self._kept.popitem(last=False)
        yield {"rows": rows, "shown": first["shown"]}

    def rows_patch(self, layer: int, head: int, neuron: int = -1, rank_by: str = "norm") -> dict:
        """What the page gets first for a unit: ``rows`` (no values yet), ``shown`` and ``strings``, from
        the sweep alone (``benchmarks/bench_examples.py`` times it)."""
        rows, ids = self.examples(layer, head, neuron, rank_by=rank_by)
        return {"rows": rows, "shown": [layer, head, neuron, rank_by], "strings": self._strings_of(ids)}

    def examples(self, layer: int, head: int, neuron: int = -1, k: int | None = None,
                 rank_by: str = "norm") -> tuple[list[dict], set[int]]:
        """The rows of head ``(layer, head)`` ranked by ``rank_by`` (or ``neuron`` of ``layer``'s, by its
        activation) without values, and the token ids they show (the sweep's tables and windows only: no
        forward)."""
        sweep, k = self._sweep, k or self._k
        if neuron < 0:
            table = sweep.head_examples(layer, head, by=rank_by).rename(columns={rank_by: "score"})
        else:
            table = sweep.neuron_examples(layer, neuron)
        table = table.iloc[:k]
        T = sweep.seq_len
        windows = sweep.windows
        rows, ids = [], set()
        for r in table.itertuples(index=False):
            w, p = int(r.window), int(r.position)
            lo, hi = max(0, p - BEFORE), min(T, p + AFTER + 1)
            spans = [(lo, hi)]
            source = int(r.source) if neuron < 0 else None
            if source is not None and source < lo:  # the strongest source, with a token either side
                spans.insert(0, (max(0, source - 1), min(lo, source + 2)))
            segments = []
            for a, b in spans:
                seg = windows[w, a:b].tolist()
                ids.update(seg)
                segments.append({"start": a, "ids": seg, "values": None})
            rows.append({"window": w, "position": p, "score": _short(float(r.score)),
                         "document": sweep.document_at(w, p), "segments": segments, "source": source,
                         "attention": None if neuron >= 0 else _short(float(r.attention))})
        return rows, ids

    def _strings_of(self, ids) -> dict:
        strings = self.model.token_strings
        return {str(i): strings[i] for i in sorted(ids)}

    def with_values(self, rows: list[dict], layer: int, head: int, neuron: int) -> list[dict]:
        """``rows`` with each segment's values: the windows read again, the attention from the destination
        on each token (``[layer, head]`` pattern row) or the neuron's activation on each."""
        per_window: dict = {}
        for _ in self._rerun(rows, layer, head, neuron, per_window):
            pass
        return self._valued(rows, per_window, neuron)

    @staticmethod
    def _valued(rows: list[dict], per_window: dict, neuron: int) -> list[dict]:
        shown = _short if neuron >= 0 else _attention
        out = []
        for r in rows:
            values = per_window[r["window"]]
            if neuron < 0:
                values = values[r["position"]]  # the destination's attention row [T]
            segments = [{**s, "values": [shown(v) for v in values[s["start"]:s["start"] + len(s["ids"])].tolist()]}
                        for s in r["segments"]]
            out.append({**r, "segments": segments})
        return out

    @torch.inference_mode()
    def _rerun(self, rows: list[dict], layer: int, head: int, neuron: int, out: dict):
        """Fill ``out`` with ``{window: [T, T] attention of head (layer, head)}`` or ``{window: [T] activation
        of the neuron}`` for the rows' windows: the sweep's windows through ``model.run_with_cache`` up to
        the unit's layer, as the sweep ran them, in batches whose patterns stay under ``RERUN_BYTES``; yields None after each batch
        (a runner checkpoint: a new selection stops the re-run there)."""
        cfg, T = self.model.cfg, self._sweep.seq_len
        batch = max(1, RERUN_BYTES // (cfg.n_layers * cfg.n_heads * T * T * 4))
        windows = sorted({r["window"] for r in rows})
        tokens = self._sweep.windows[windows]
        for start in range(0, len(windows), batch):
            # the layers up to the unit's: later layers change nothing it reads
            _, cache = self.model.run_with_cache(tokens[start:start + batch].to(self.model.device),
                                                 mlp_post=neuron >= 0, logits=False, layers=layer + 1)
            if neuron < 0:
                picked = cache.patterns[:, layer, head].float().cpu()  # [b, T, T]
            else:
                picked = cache.mlp_post[:, layer, :, neuron].float().cpu()  # [b, T]
            out.update(zip(windows[start:start + batch], picked))
            yield None

    # -- kernel-less answers ----------------------------------------------------------------------
    def offline_answers(self, answers) -> None:
        """Kernel-less: every head's first ``SAVED`` examples with their attention in the current ranking (the
        heads a save's plan chose, ``page_items``, with the attention of its first ones only, ``UNSHADED``;
        default every head, the current head first), then, where every head's fitted whole, the current
        head's in the other rankings, within the budget (a head or ranking past it says it needs a kernel);
        opening an example needs one. Each example's tokens are a part of its window's, which the page holds
        once (``offline.Part``), however many heads' examples show it."""
        saved = min(self._k, SAVED)
        every = offline.heads(self)
        heads = self._page_heads or every
        shaded = set(self._page_shaded if self._page_heads else heads)
        units = [(*unit, self.rank_by) for unit in heads]
        if len(shaded) == len(every):  # (the plan sized the heads in one ranking: the others only past them)
            units += [(self.layer, self.head, r) for r in RANKINGS if r != self.rank_by]
        group = len(units) if self._page_heads else GROUP

        def answers_of(group_units):
            valued = self._valued_heads([unit for unit in group_units if unit[:2] in shaded], saved)
            for unit in group_units:
                rows, ids = valued[unit] if unit in valued else self.examples(*unit[:2], -1, saved, unit[2])
                for r in rows:
                    r["segments"] = [{**s, "ids": offline.Part(("window", r["window"]), self._window(r["window"]),
                                                               s["start"], s["start"] + len(s["ids"]))}
                                     for s in r["segments"]]
                patch = {"rows": rows, "shown": [*unit[:2], -1, unit[2]], "neuron": -1}
                if unit not in valued:
                    patch["_offline_note"] = UNSHADED
                yield unit, patch, {"strings": self._strings_of(ids)}

        answers.rule(["layer", "head", "rank_by"],
                     (answer for at in range(0, len(units), group) for answer in answers_of(units[at:at + group])),
                     missing=offline.over_budget("This head's dataset examples in this ranking"))
        answers.needs_kernel("opened")

    def _window(self, window: int) -> np.ndarray:
        """int32 [seq_len]: the sweep's tokens of ``window`` (the page's shared table of examples' tokens)."""
        return self._sweep.windows[window].numpy().astype(np.int32)

    @torch.inference_mode()
    def _valued_heads(self, units: list[tuple[int, int, str]], k: int) -> dict:
        """``{(layer, head, rank_by): (rows with values, token ids)}`` of each head's first ``k`` examples in
        that ranking: every window they show read again once (``run_with_cache`` up to the last layer asked
        for, in batches whose patterns stay under ``RERUN_BYTES``), each head's attention row taken from it."""
        found = {unit: self.examples(*unit[:2], -1, k, unit[2]) for unit in units}
        if not units:
            return found
        wanted = collections.defaultdict(set)  # window -> {(layer, head, position)}
        for (layer, head, _), (rows, _) in found.items():
            for r in rows:
                wanted[r["window"]].add((layer, head, r["position"]))
        cfg, T = self.model.cfg, self._sweep.seq_len
        layers = 1 + max(unit[0] for unit in units)
        batch = max(1, RERUN_BYTES // (layers * cfg.n_heads * T * T * 4))
        windows = sorted(wanted)
        per_window = {unit[:2]: collections.defaultdict(dict) for unit in units}  # head -> window -> position -> row [T]
        for start in range(0, len(windows), batch):
            part = windows[start:start + batch]
            _, cache = self.model.run_with_cache(self._sweep.windows[part].to(self.model.device), logits=False,
                                                 layers=layers)
            for i, w in enumerate(part):
                for layer, head, position in wanted[w]:
                    per_window[layer, head][w][position] = cache.patterns[i, layer, head, position].float().cpu()
        return {unit: (self._valued(rows, per_window[unit[:2]], -1), ids) for unit, (rows, ids) in found.items()}

    def _answer_size(self, unit: tuple[int, int], k: int) -> tuple[int, int]:
        """(bytes, tokens) of a head's saved rows without their attention: their JSON with each segment's tokens a
        part of the shared table (``offline.Part``), and their token strings."""
        rows, ids = self.examples(*unit, -1, k, self.rank_by)
        saved_rows = [{**r, "segments": [{**s, "ids": {"packed": [1 << 24, "uint16", [len(s["ids"])]]}}
                                         for s in r["segments"]]} for r in rows]
        size = len(json.dumps(saved_rows, separators=(",", ":"))) + len(json.dumps(self._strings_of(ids)))
        return size, sum(len(s["ids"]) for r in rows for s in r["segments"])

    def page_items(self, context) -> list[PlanItem]:
        """A saved page's dataset examples (``core.save_plan``): the first ``SAVED`` examples of every head (the
        heads the reader chose first, then the selected one, then the rest), then the attention on each of
        their tokens. The rows' cost: reading the sweep's tables, timed on ``SIZED`` heads; the attention's:
        one forward of the windows the first heads show, each window once, up to the last layer among them.
        Bytes: the largest of ``SIZED`` heads' rows measured (their token strings included), each token's
        attention as ``VALUE_CHARS`` characters; a window's tokens once per window (int32, the worst case)."""
        cfg, saved, T = self.model.cfg, min(self._k, SAVED), self._sweep.seq_len
        heads = list(dict.fromkeys([*context.chosen, *offline.heads(self)]))
        sample = heads[::max(1, len(heads) // SIZED)]
        began = time.perf_counter()
        sized = [self._answer_size(unit, saved) for unit in sample]
        reading = (time.perf_counter() - began) / len(sample)
        rows_bytes, tokens = max(size for size, _ in sized), max(n for _, n in sized)
        windows_seen, seen, deepest = [0], set(), [0]  # after the first n heads: windows read, layers run
        for layer, head in heads:
            seen.update(self._sweep.head_examples(layer, head, by=self.rank_by)["window"].iloc[:saved].tolist())
            windows_seen.append(len(seen))
            deepest.append(max(deepest[-1], layer + 1))
        windows = 4 * T * len(seen) / len(heads)  # (int32 tokens: each window once, shared by its heads)
        per_head = rows_bytes + windows
        per_values = VALUE_CHARS * tokens
        flops = [forward_flops(cfg, windows_seen[n] * T, T, layers=deepest[n]) for n in range(len(heads) + 1)]

        def keep(n: int, shaded: int) -> None:  # the rows of the first n heads, the attention of the first shaded
            self._page_heads, self._page_shaded = heads[:n], heads[:shaded]
            self._offline_budget = int(n * per_head + shaded * per_values)
            self._offline_fresh = False
            self._offline_ready()

        def leave() -> None:
            self._page_heads, self._page_shaded = [], []
            self._offline_budget, self._offline_fresh = 0, False

        # (the rows are answered at once, without attention: cheap; the attention's item answers them again)
        bytes_of = lambda each: int(PAGE_BYTES_PER_ANSWER_BYTE * each * len(heads))
        return [PlanItem(context.section, "dataset examples", reading * len(heads), bytes_of(per_head), EXAMPLES,
                         lambda n: keep(n, 0), units=len(heads), unit="head", leave=leave),
                PlanItem(context.section, "attention shading of the dataset examples",
                         context.rate.seconds(flops[-1]), bytes_of(per_values), EXAMPLES,
                         lambda n: keep(len(self._page_heads), min(n, len(self._page_heads))), units=len(heads),
                         unit="head", cost_at=lambda n: context.rate.seconds(flops[n]))]
