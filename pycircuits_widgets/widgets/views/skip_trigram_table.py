"""SkipTrigramTable: one head's top skip-trigrams, and whole-vocabulary token queries."""

from __future__ import annotations

import torch
import traitlets

from ...analysis.circuits import embedding_note
from ...analysis.skip_trigrams import MODES, HeadTable, circuit_query, head_table, head_table_steps, kept_head_table
from ...corpus.sweeps import checked_sweep
from ...corpus.trigram_counts import kept_trigram_counts, trigram_counts
from ...models.tokenizer import visible_whitespace
from ..core import offline
from ..core.arrays import ArrayDict
from ..core.base import CircuitWidget, check_text, rolls_back
from ..core.meter import cancelled, metered
from ..core.offset_window import OffsetWindow
from ..core.read_through import READ_THROUGH, ReadThrough
from ..core.runner import GIVE_WAY, give_way_between
from ..core.save_plan import CHOSEN, PAGE_BYTES_PER_ANSWER_BYTE, REST, PlanItem
from ..core.selection import Bounded, HeadSelection, TokenSelection, check_model
from .notes import direct_path_ignores

SEARCH = {"screen": ("exact table: screening sources", "source blocks"),
          "offsets": ("exact table: screening offsets", "source blocks"),
          "exact": ("exact table: recomputing sources", "source blocks")}
"""The ``progress`` text and unit of each stage of a head's exact search (``head_table_steps``), metered apart."""
MAX_MATCHES = 20
MAX_K = 10_000  # most trigrams in a table: also the most pages, and the largest page
TABLE_ROW_BYTES = 64
"""Saved bytes of one row of a head's table (ids as uint16, scores as float16, its new token strings): a
plan's estimate."""


class SkipTrigramTable(OffsetWindow, ReadThrough, HeadSelection, TokenSelection, CircuitWidget):
    """Top skip-trigrams ``[source] … [destination] → [out]`` of head ``(layer, head)``
    with their QK and OV scores (``pcw.skip_trigrams``), sortable and paginated; a token
    search that runs in the kernel over the whole vocabulary ("what does this token attend
    to, what attends to it, what does it copy to").

    Args:
        model: a weight view (``pcw.load_pretrained("attn-only-1l")``). Deeper models are
            read through each head's direct-path circuits (ignoring composition; the view says so).
        layer, head: the head shown; changing either (trait or picker) recomputes.
        k: number of trigrams in the table (exact top-k by ``qk * ov``).
        n_related: rows per list in a token query.
        offsets: rotary models: the window of query - key offsets the QK circuit is read over, each
            triple at its strongest offset (default ``analysis.rotary.DEFAULT_OFFSETS``; the explorer
            passes its text's offsets). ``offset_note`` states it in the view.
        sweep: a ``pcw.Sweep`` of this model: each listed triple also shows how often it occurs in the
            swept windows and the head's mean attention from destination to source there
            (``pcw.trigram_counts``: exact, counted when the table is shown); "never seen" for none.
        embedding: what a head of layer >= 1 is read through (``pcw.effective_embedding``): "raw" (``W_E``,
            the paper's reading, default), "mlp0" (``W_E`` through block 0) or "corpus" (each token's mean
            stream entering the head's layer over the sweep's positions: needs ``sweep``). A layer-0 head
            reads ``W_E`` itself: "raw" is exact there, and the view reads it whatever the choice.
            ``read_through`` says what the shown table read.

    ``recompute()`` and ``search(text)`` / ``query_token(id)`` run synchronously and return
    the new state; trait changes run them on the widget's runner, where the head's table, the
    token query and the search are separate kinds of result (none drops another).
    """

    _view = traitlets.Unicode("SkipTrigramTable").tag(sync=True)
    _embedding_note = traitlets.Unicode("").tag(sync=True)
    """str (kernel's): which embedding the token circuits read (``analysis.circuits.embedding_note``)."""
    _browser_writable = frozenset({"layer", "head", "token", "query", "sort_by", "page", "page_size", "offsets",
                                   "embedding"})
    # Above ``partial_above`` vocabulary entries, a first table over the ``partial_sources``
    # sources with the largest factors is sent before the exact one (seconds at GPT-2 size).
    partial_sources = 64
    partial_above = 8192
    # With a sweep, the mean attention is measured on the first this many windows holding a listed triple
    # (one forward each: seconds at this size for small models); the counts are always over every window.
    attention_windows = 256

    # -- data --
    trigrams = ArrayDict(None).tag(sync=True)
    """{"layer", "head", "src"/"dest"/"out": int32 [n] (vocab ids), "qk"/"ov"/"score":
    float32 [n], "strings": {id: display string}, "exact": bool, "progress": float}; rotary
    models add "offset": int32 [n], the query - key offset of each triple's ``qk``; with a sweep, once
    counted, "count": int32 [n] (occurrences in the swept windows), "attention": float32 [n] (the
    head's mean attention from destination to source there, NaN where never seen or not measured),
    "measured": int32 [n] (the occurrences it is the mean of), "windows_run" and "windows_holding" (windows
    the attention was measured on, of those holding a triple: ``attention_windows``)."""
    corpus = traitlets.Dict().tag(sync=True)
    """{"windows", "seq_len", "model"} (read-only): the sweep the triples are counted over; {} without one."""
    matches = traitlets.List().tag(sync=True)
    """list of {"id", "str"}: vocabulary tokens matching ``query`` (exact matches first)."""
    related = traitlets.Dict().tag(sync=True)
    """{"token", "str", "layer", "head", MODE: [{"id", "str", "score"}]} for the selected token."""
    approximate = traitlets.Bool(False).tag(sync=True)
    """bool (read-only): True for models deeper than one layer (direct-path circuits only)."""
    ignores = traitlets.List(traitlets.Unicode()).tag(sync=True)
    """list[str] (read-only): what this model has that the view's weight-only circuits leave out."""

    # -- input --
    query = traitlets.Unicode("").tag(sync=True)
    """str: token search text (typed as text; "·" or a space both mean a space)."""
    k = Bounded(100, min=1, max=MAX_K).tag(sync=True)
    """int, default 100: number of skip-trigrams in the table, in ``1..MAX_K``."""
    n_related = Bounded(10, min=1, max=lambda model: min(1000, model.cfg.d_vocab)).tag(sync=True)
    """int, default 10: rows per list of a token query, in ``1..min(1000, d_vocab)``."""

    # -- display --
    sort_by = traitlets.Enum(["score", "qk", "ov"], default_value="score").tag(sync=True)
    """str, default "score": table order (descending)."""
    # (the browser writes page, page_size and query: checked like any Python write)
    page = Bounded(0, min=0, max=MAX_K - 1).tag(sync=True)
    """int, default 0: table page shown (``page_size`` rows each)."""
    page_size = Bounded(20, min=1, max=MAX_K).tag(sync=True)
    """int, default 20: rows per page, in ``1..MAX_K``."""

    _offline_inputs = ("k", "embedding")  # the saved tables are k rows long, read through the embedding

    def __init__(self, model, offsets=None, sweep=None, **kwargs):
        check_model(model, "SkipTrigramTable")
        if checked_sweep(sweep, model, "SkipTrigramTable") is not None:
            kwargs["corpus"] = {"windows": sweep.n_windows, "seq_len": sweep.seq_len, "model": sweep.model_name}
        self._page_heads: list[tuple[int, int]] = []  # the heads a save's plan keeps (``page_items``); [] as before
        self._strings = model.token_strings
        super().__init__(model, offsets, sweep=sweep, approximate=not (model.cfg.n_layers == 1 and model.cfg.attn_only),
                         ignores=direct_path_ignores(model.cfg), _embedding_note=embedding_note(model), **kwargs)

    _answers_offline = "runner"
    _window_what = "a skip-trigram table"

    def _started(self) -> None:
        self._snapshot_window()
        if self.model.cfg.d_vocab > self.partial_above:
            self._on_head(None)  # seconds of work: the view shows the partial table, then the exact one
        else:
            self.recompute()
        if self.query:
            self.search(self.query)
        elif self.token >= 0:
            self.query_token(self.token)
        self.observe(self._on_head, ["layer", "head", "k", "embedding"])
        self.observe(self._on_query, ["query"])
        self.observe(self._on_token, ["token", "n_related"])

    _window_text = ("Rotary positions: the QK circuit W_E W_Q R(offset) W_K^T W_E^T is read {how}; each skip-trigram "
                    "is scored at its strongest offset (column \"offset\"), and a token's query takes each entry's "
                    "largest value over them.")

    def _snapshot_window(self) -> None:
        """The window as one snapshot (a job reads it once, so a window changed meanwhile never mixes
        into its table; the job rotates by its own layer's rule); None when not rotary."""
        self._window = self._offsets

    def _on_window(self) -> None:
        self._snapshot_window()
        self._on_head({"name": "offsets"})

    @traitlets.validate("query")
    def _valid_query(self, proposal):
        return check_text(proposal["value"], name="query", empty=True)

    # -- recomputes (synchronous; the observers run them in the worker) -------------------
    def recompute(self) -> dict:
        """Recompute the table for the current ``layer``/``head`` (and the token query)."""
        self._on_head(None)
        self._on_token(None)
        self.wait(None)
        return {"trigrams": self.trigrams, "related": self.related}

    def search(self, text: str) -> dict:
        """Find vocabulary tokens matching ``text``; an exact match becomes the selected token."""
        self._runner.submit("search", lambda: self._search_steps(text))
        self.wait(None)
        return {"matches": self.matches, "token": self.token, "related": self.related}

    def query_token(self, token: int) -> dict:
        """What ``token`` attends to, is attended by and copies to, through the current head."""
        self.token = token
        self._on_token(None)
        self.wait(None)
        return {"related": self.related}

    def offline_answers(self, answers) -> None:
        """Kernel-less: every head's table, as many rows as the kernel's (``k``, at most
        ``offline.TABLE_K``; the token strings of all tables once, in the rule's base); token
        search and token queries need a kernel."""
        answers.needs_kernel("query", "token", "embedding", *self._window_needs_kernel())
        heads = self._page_heads or offline.heads(self)
        if self.model.cfg.d_vocab > self.partial_above and not self._page_heads:  # seconds per head: minutes for all
            answers.rule(["layer", "head"], [], missing="Skip-trigram tables of other heads need a running "
                                                        "kernel (large vocabulary).")
            return
        if self.embedding != "raw":  # a whole search per head, kept nowhere: the shown head's table only
            answers.rule(["layer", "head"], [], missing=f"Skip-trigram tables of other heads read through "
                                                        f"{READ_THROUGH[self.embedding]} need a running kernel.")
            return
        rows = min(self.k, offline.TABLE_K)
        base = {"trigrams": {"strings": {}, "exact": True, "progress": 1.0}, "k": rows,
                "related": {}, "token": -1, "error": ""}
        if rows < self.k:  # the page says why another head's table is shorter
            base["_offline_note"] = (f"This page saved each head's top {rows} skip-trigrams "
                                     f"(a running kernel computes the top {self.k}).")

        def tables():
            for layer, head in heads:  # corpus counts: the shown head's, and others' counted already
                counting = "count" if (layer, head) == (self.layer, self.head) else "kept"
                table = dict(offline.last(self._table_steps(layer, head, rows, counting))["trigrams"])
                strings = table.pop("strings")
                for name in ("exact", "progress"):
                    del table[name]
                yield (layer, head), {"trigrams": table}, {"trigrams": {"strings": strings}}

        answers.rule(["layer", "head"], tables(), base=base,
                     missing=offline.over_budget("This head's skip-trigram table"))

    def page_items(self, context) -> list[PlanItem]:
        """A saved page's exact tables (``core.save_plan``): of the heads the reader chose (``CHOSEN``), then of
        every other head (``REST``). Cost: a whole-vocabulary search per head (source x destination scores over
        the head's rank: QK at each offset of the window, OV once); bytes: ``k`` rows of ids, scores and strings."""
        cfg = self.model.cfg
        chosen = list(dict.fromkeys([*context.chosen, (self.layer, self.head)]))
        rest = [unit for unit in offline.heads(self) if unit not in chosen]
        searched = 2 * cfg.d_vocab ** 2 * cfg.d_head * (max(1, len(self._offsets or ())) + 1)
        rows = min(self.k, offline.TABLE_K)
        per_head = rows * TABLE_ROW_BYTES
        self._page_heads = []  # (a new plan: no head kept yet)

        def keep(heads):
            def run(n: int) -> None:  # (the chosen heads' tables are cached when the rest's run)
                self._page_heads = list(dict.fromkeys(self._page_heads + heads[:n]))
                self._offline_budget = int(len(self._page_heads) * per_head)
                self._offline_fresh = False
                self._offline_ready()
            return run

        def leave() -> None:  # (before any kept item runs: a kept one sets its own budget)
            self._offline_budget, self._offline_fresh = 0, False

        return [PlanItem(context.section, "exact skip-trigram tables", context.rate.seconds(len(heads) * searched),
                         int(PAGE_BYTES_PER_ANSWER_BYTE * per_head * len(heads)), rank, keep(heads), units=len(heads),
                         unit="head", leave=leave)
                for heads, rank in ((chosen, CHOSEN), (rest, REST)) if heads]

    # -- observers: each kind of result has its own slot on the runner -----------------------
    @rolls_back
    def _on_head(self, change):
        layer, head, k = self.layer, self.head, self.k
        self._runner.submit("table", lambda: self._table_steps(layer, head, k))
        if change is not None and self.token >= 0:
            self._on_token(None)  # the token's query is through the head

    @rolls_back
    def _on_query(self, change):
        text = change["new"]
        self._runner.submit("search", lambda: self._search_steps(text))

    @rolls_back
    def _on_token(self, change):
        token, layer, head, n = self.token, self.layer, self.head, self.n_related
        if token < 0:
            self._runner.submit("token", lambda: iter([{"related": {}}]))
            return
        self._runner.submit("token", lambda: self._related_steps(token, layer, head, n))

    # -- the work ------------------------------------------------------------------------
    def _table_steps(self, layer, head, k, counting="count"):
        """Yields (large vocabularies) the top-k over the strongest sources, then the exact top-k
        (``analysis.skip_trigrams.head_table_steps``, kept per model: a revisited head answers at once;
        searched block by block, metered: ``SEARCH``); with a
        sweep, then the same table with its corpus counts (``pcw.trigram_counts``, kept per model too;
        ``counting="kept"``: only counts the cache holds, none computed)."""
        window = self._window
        embedding, read_through = self._read(layer)
        table = kept_head_table(self.model, layer, head, k, offset=window) if embedding is None else None
        if table is None and self.model.cfg.d_vocab > self.partial_above:
            partial = head_table(self.model, layer, head, k, offset=window, approximate=True,
                                 sources=self.partial_sources, embedding=embedding)
            # (no count of the head before)
            yield {"trigrams": self._payload(partial), "read_through": read_through, "progress": {}}
            yield GIVE_WAY  # the exact search takes seconds: the click's other views first
        if table is None:  # block by block (a newer head stops it at the next), each after other views' clicks
            table = yield from give_way_between(metered(
                head_table_steps(self.model, layer, head, k, offset=window, approximate=True, embedding=embedding),
                SEARCH))
        payload = self._payload(table)
        yield {"trigrams": payload, "read_through": read_through, "progress": {}}
        if self._sweep is not None:
            yield GIVE_WAY  # a forward of every window holding a triple: the click's other views first
            count = trigram_counts if counting == "count" else kept_trigram_counts
            counts = count(self._sweep, self.model, layer, head,
                           torch.stack([table.source, table.destination, table.out], 1),
                           max_windows=self.attention_windows)
            if counts is None:
                return
            attention = [float("nan") if a is None else a for a in counts.attention]
            yield {"trigrams": {**payload, "count": counts.count.to(torch.int32),
                                "attention": torch.tensor(attention, dtype=torch.float32),
                                "measured": counts.measured.to(torch.int32), "windows_run": counts.windows_run,
                                "windows_holding": counts.windows_holding}}

    def fill_steps(self, selection):
        """The exact table of ``selection``'s head into the per-model cache (no partial first), block
        by block: the fill gives way between blocks. A table read through another embedding is kept
        nowhere: nothing to precompute."""
        if self.embedding != "raw":
            return
        for _ in head_table_steps(self.model, selection["layer"], selection["head"], self.k, offset=self._window,
                                  approximate=True):
            yield None

    def cancel(self) -> None:
        """Stop computing the head's exact table, between two blocks of sources: the table shown
        stays (a partial one labelled partial) and ``progress`` says "cancelled" at the count reached.
        Selecting a head (or ``recompute()``) computes again."""
        self._runner.cancel("table")
        self.progress = cancelled(self.progress) if self.progress else {}

    def _payload(self, table: HeadTable) -> dict:
        """The ``trigrams`` trait value of ``table``: its columns (ids sent as int32: ``ArrayDict``) and the
        strings of its tokens."""
        ids = sorted({*table.source.tolist(), *table.destination.tolist(), *table.out.tolist()})
        offsets = {} if table.offset is None else {"offset": table.offset}
        return {**offsets,
            "layer": table.layer, "head": table.head, "src": table.source, "dest": table.destination,
            "out": table.out, "qk": table.qk, "ov": table.ov, "score": table.score,
            "strings": {str(i): self._strings[i] for i in ids},
            "exact": table.exact, "progress": float(table.progress),
        }

    def _search_steps(self, text):
        matches = find_tokens(self._strings, text)
        update = {"matches": [{"id": i, "str": self._strings[i]} for i in matches]}
        exact = [i for i in matches if _normal(self._strings[i]) == _normal(text)]
        if exact:
            update["token"] = exact[0]  # its query follows as the "token" kind
        yield update

    def _related_steps(self, token, layer, head, n):
        """The three whole-vocabulary queries of one token (``pcw.analysis.circuit_query``)."""
        offsets = self._offsets
        result = {"token": token, "str": self._strings[token], "layer": layer, "head": head}
        for mode in MODES:
            yield None  # a chunk boundary: a newer token stops this one here
            rows = circuit_query(self.model, layer, head, token, mode, k=n, approximate=True, offset=offsets)
            result[mode] = [{"id": i, "str": s, "score": v} for i, s, v in rows]
        yield {"related": result}


def _normal(text: str) -> str:
    return visible_whitespace(text)


def find_tokens(strings: list[str], text: str, limit: int = MAX_MATCHES) -> list[int]:
    """Vocabulary ids whose display string matches ``text``: exact, then prefix, then
    substring matches, shorter strings first; at most ``limit``. Spaces in ``text`` match "·"."""
    needle = _normal(text)
    if not needle:
        return []
    exact, prefix, inner = [], [], []
    for i, s in enumerate(strings):
        if s == needle:
            exact.append(i)
        elif s.startswith(needle):
            prefix.append(i)
        elif needle in s:
            inner.append(i)
    ranked = exact + sorted(prefix, key=lambda i: len(strings[i])) + sorted(inner, key=lambda i: len(strings[i]))
    return ranked[:limit]

