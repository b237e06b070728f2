"""InductionMechanism: how an earlier head and a later head form (or do not form) an induction pair."""

from __future__ import annotations

import torch
import traitlets

from ...analysis.composition import random_baseline
from ...analysis.induction import (
    COPY_THRESHOLD,
    MATCH_THRESHOLD,
    PairVerdict,
    best_offset,
    k_composition_diagonal_rank,
    k_composition_top,
    pair_verdicts_steps,
)
from ..core import offline
from ..core.arrays import ArrayDict, id_dtype
from ..core.base import CircuitWidget
from ..core.meter import Meter, metered
from ..core.offset_window import OffsetWindow
from ..core.on_demand import OnDemand
from ..core.payload import JSON_BUFFER
from ..core.selection import Bounded, HeadSelection, PairSelection, TokenSelection, check_model, pair_key

N_TABLES = 16
"""Ranked tables embedded up front (the strongest K-composition pairs) for small vocabularies."""
EMBED_TABLES_MAX_VOCAB = 8192
"""Above this vocabulary size only the selected pair's table is computed up front."""
STAGES = {"positivity": ("induction: K-composition eigenvalues", "head pairs"),
          "scores": ("induction: OV positivity, K-composition scores", "steps")}
"""The ``progress`` text and unit of each stage of ``pair_verdicts_steps`` (each metered apart)."""
K = Bounded(min=1, max=lambda model: min(200, model.cfg.d_vocab))
"""Bounds of the constructor's ``k`` (rows of each ranked table)."""


class InductionMechanism(OffsetWindow, OnDemand, HeadSelection, TokenSelection, PairSelection, CircuitWidget):
    """The induction mechanism of the selected pair ``selected_pair`` (earlier head h1 -> later
    head h2; ``pcw.analysis.induction``): the K-composition term's token x token QK circuit as a
    ranked table (which source tokens a destination token attends to through h1), its eigenvalue
    positivity beside h2's OV positivity, and one sentence classifying the pair from those two
    numbers (thresholds ``MATCH_THRESHOLD``, ``COPY_THRESHOLD``, shown in the view).

    The verdict of every pair is embedded; the ranked tables of the ``n_tables`` pairs with the
    largest K-composition score (and of every pair selected since) are too, so a page without a
    kernel shows those and, within ``offline.BUDGET``, the tables of the other pairs as kernel-less
    answers (``offline_answers``); past it, it says "needs a kernel". Clicking a token in the
    table selects it (``token``). Rotary models: each pair is read at one query - key offset of h2,
    the one in ``offsets`` where its K-composition QK positivity is largest (``pairs[key]["offset"]``;
    ``offset_note`` says so in the view).

    Everything is computed on the widget's runner (``on_demand``; minutes at GPT-2-small shapes):
    the verdicts first (kind ``"pairs"``), then one table per chunk; a newly selected pair's table
    is its own kind (``"table"``). Nothing runs until ``active``.

    Args:
        model: a weight view with at least 2 layers.
        selected_pair: ``[l1, h1, l2, h2]``; default (``None``) the pair with the largest
            K-composition score, once the verdicts are in.
        k: rows of each ranked table. n_tables: tables embedded up front (default ``N_TABLES``, or 1
            above ``EMBED_TABLES_MAX_VOCAB`` tokens).
        active: compute now (default) or when ``active`` is first set (``on_demand``).
        offsets: rotary models: the window of query - key offsets (default
            ``analysis.rotary.DEFAULT_OFFSETS``; the explorer passes its text's offsets).
    """

    _view = traitlets.Unicode("InductionMechanism").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "selected_pair", "token", "active", "offsets"})
    _window_text = ("Rotary positions: h2's QK circuit W_Q R(offset) W_K^T is read {how}; each pair is shown at the "
                    "offset where its K-composition QK positivity is largest (named with the pair).")

    # -- data --
    pairs = traitlets.Dict().tag(sync=True, **JSON_BUFFER)
    """{"l1,h1,l2,h2": {"k_score", "qk_positivity", "ov_positivity", "kind", "sentence"}} for every pair
    (rotary models add "offset": the query - key offset the pair's numbers and table are read at)."""
    tables = ArrayDict(None).tag(sync=True)
    """{"l1,h1,l2,h2": {"values": float32 [k], "tokens": uint16 [2, k] (destination ids, source ids; int32 past 65536 tokens), "diagonal_rank"}}:
    ranked K-composition entries (row-centred) and ``k_composition_diagonal_rank`` (chance 0.5), for the
    embedded pairs."""
    strings = traitlets.Dict().tag(sync=True)
    """{token id (str): display string} for every token in ``tables``."""
    thresholds = traitlets.Dict().tag(sync=True)
    """{"match": MATCH_THRESHOLD, "copy": COPY_THRESHOLD, "baseline": random K-composition score}."""
    run_label = traitlets.Unicode("").tag(sync=True)
    """str (read-only): the explorer's ablated run ("ablated: L1.H6 (zero)"), shown in the header
    with what it means here: these numbers are read from the weights, which no ablation changes."""

    def __init__(self, model, k: int = 12, n_tables: int | None = None, selected_pair=None, offsets=None, **kwargs):
        check_model(model, "InductionMechanism")
        if model.cfg.n_layers < 2:
            raise ValueError(f"InductionMechanism needs at least 2 layers (heads compose across layers), "
                             f"got n_layers={model.cfg.n_layers}")
        self._k = K.check(k, model, "k")
        if n_tables is None:  # a table costs d_vocab^2 d_head flops: ~5 s each at GPT-2's 50257
            n_tables = N_TABLES if model.cfg.d_vocab <= EMBED_TABLES_MAX_VOCAB else 1
        self._n_tables = n_tables
        self._default_pair = selected_pair is None
        self._pairs: dict = {}  # pair key -> verdict (all of them once ``_complete``), and
        self._complete = False
        self._tables: dict = {}  # pair key -> table: filled by the runner's jobs (one at a time)
        self._strings: dict = {}
        super().__init__(
            model, offsets, selected_pair=selected_pair or [],
            thresholds={"match": MATCH_THRESHOLD, "copy": COPY_THRESHOLD,
                        "baseline": random_baseline(model.cfg.d_model, model.cfg.d_head)},
            **kwargs,
        )

    _answers_offline = "runner"
    _window_what = "the K-composition QK circuit"

    def _started(self) -> None:
        self.observe(self._on_pair, ["selected_pair"])

    def _ready(self) -> bool:
        return bool(self.pairs) and bool(self.selected_pair)

    def _on_window(self) -> None:
        """Every verdict and table again at the new window (the pairs job replaces a running one)."""
        self._pairs, self._tables, self._strings, self._complete = {}, {}, {}, False
        if self.active:
            self._restart()

    def _start(self) -> None:
        pair = list(self.selected_pair)
        self._runner.submit("pairs", lambda: self._pairs_steps(pair))

    def offline_answers(self, answers) -> None:
        """Kernel-less: the ranked table of every pair not embedded, added to ``tables`` (and its
        tokens to ``strings``) when the pair is selected; an embedded pair (and no pair) needs
        nothing, so its answer only clears the error. First the strongest K-composition writer
        into each head (the pair a head click selects in the explorer), then by score, so what
        fits the budget is what a reader reaches first."""
        answers.needs_kernel(*self._window_needs_kernel())
        by_score = sorted(self._pairs, key=lambda key: -self._pairs[key]["k_score"])
        writers = {}  # later head -> the key of its strongest writer's pair
        for key in by_score:
            writers.setdefault(key.split(",", 2)[2], key)
        order = dict.fromkeys([*writers.values(), *by_score])
        embedded = [[]] + [[int(x) for x in key.split(",")] for key in self._pairs if key in self._tables]
        todo = [[int(x) for x in key.split(",")] for key in order if key not in self._tables]

        def tables():
            for pair in embedded:
                yield (pair,), {}
            for pair in todo:
                table, strings = self._table(pair)
                yield (pair,), {"tables": {pair_key(pair): table}, "strings": strings}

        answers.rule(["selected_pair"], tables(), base={"error": ""}, merge=("tables", "strings"),
                     missing=offline.over_budget("This pair's ranked table"))

    def _on_pair(self, change):
        if change["new"] and self.active and pair_key(change["new"]) not in self._tables:
            pair = list(change["new"])
            self._runner.submit("table", lambda: self._tables_steps([pair]))

    def _pairs_steps(self, pair):
        """Every pair's verdict (in pieces, strongest K-composition first: ``pair_verdicts_steps``,
        metered), shown as they come, then the tables of the strongest ``n_tables`` pairs and
        ``pair``. Verdicts already computed (a restart after a cancel) are not computed again."""
        if not self._complete:
            pair = yield from self._verdicts_steps(pair)
        pairs = self._pairs
        order = [[int(x) for x in key.split(",")] for key in sorted(pairs, key=lambda key: -pairs[key]["k_score"])]
        update = {"pairs": pairs, "tables": dict(self._tables), "strings": dict(self._strings),  # (none of an old window)
                  "progress": {}}
        if self._default_pair and not pair:  # the strongest pair, unless one was chosen meanwhile
            pair = order[0]
            update["selected_pair"] = pair
        yield update
        yield from self._tables_steps(([pair] if pair else []) + order[:self._n_tables])

    def _verdicts_steps(self, pair):
        """``pair_verdicts`` piece by piece, strongest pairs first, reporting how far; returns ``pair``,
        or the pair it selected. The verdicts done so far are shown each time their number doubles
        (1, 2, 4, ...: about twice the final payload sent in all); with the first, the strongest pair
        is selected (unless ``pair`` was given) and its table computed, so the section shows its
        strongest result within seconds of the ranking while the rest fill in (an hour at
        SmolLM2-135M's shape and a 100-token window, at 2 threads)."""
        found = {}  # (l1, h1, l2, h2) -> PairVerdict, filled by the pieces
        for key, entry in self._pairs.items():  # a restart: what was computed stays
            found[tuple(int(x) for x in key.split(","))] = _verdict(entry)
        steps = metered(pair_verdicts_steps(self.model, self._offsets, into=found), STAGES)
        shown = len(found)
        while True:
            try:
                report = next(steps)
            except StopIteration as stop:
                verdicts = stop.value
                break
            if len(found) < max(1, 2 * shown):
                yield report
                continue
            first, shown = shown == 0, len(found)
            self._pairs = {pair_key(key): _entry(v) for key, v in found.items()}  # strongest first
            update = {"pairs": self._pairs, **(report or {})}
            if first and self._default_pair and not pair:
                pair = [int(x) for x in next(iter(self._pairs)).split(",")]
                update["selected_pair"] = pair
            yield update
            if first and pair and pair_key(pair) in self._pairs:
                yield from self._tables_steps([pair], clear=False)
        self._pairs = {pair_key(key): _entry(v) for key, v in verdicts.items()}
        self._complete = True
        return pair

    def _tables_steps(self, pairs, clear: bool = True):
        """One chunk per missing table (``d_vocab``-blocked top-k): stale work stops between tables;
        metered (every table costs the same), the count gone with the last (unless not ``clear``:
        another count goes on)."""
        todo = [pair for pair in dict.fromkeys(map(tuple, pairs)) if pair_key(pair) not in self._tables]
        meter = Meter("induction: ranked tables", len(todo), "pairs")
        if len(todo) > 1:
            yield meter.first()
        for done, pair in enumerate(todo, 1):
            self._tables[pair_key(pair)], strings = self._table(list(pair))
            self._strings.update(strings)
            update = {"strings": dict(self._strings), "tables": dict(self._tables)}
            if done < len(todo) or clear:
                update["progress"] = meter.report(done) if done < len(todo) else {}
            yield update

    def _table(self, pair) -> tuple[dict, dict]:
        """One pair's ranked table entry and the display strings of its tokens."""
        h1, h2 = tuple(pair[:2]), tuple(pair[2:])
        verdict = self._pairs.get(pair_key(pair))
        # a pair selected before its verdict came: its offset as the verdict will read it
        offset = verdict.get("offset") if verdict else best_offset(self.model, h1, h2, self._offsets)
        values, dest, src = k_composition_top(self.model, h1, h2, self._k, offset)
        diagonal_rank = k_composition_diagonal_rank(self.model, h1, h2, offset=offset)
        tokens = torch.stack([dest, src]).numpy().astype(id_dtype(self.model.cfg.d_vocab))
        table = {"values": values.float(), "tokens": tokens, "diagonal_rank": diagonal_rank}
        strings = self.model.token_strings
        return table, {str(i): strings[i] for i in dest.tolist() + src.tolist()}


def _entry(v: PairVerdict) -> dict:
    """A verdict as the view's ``pairs`` holds it."""
    return {"k_score": v.k_score, "qk_positivity": v.qk_positivity, "ov_positivity": v.ov_positivity, "kind": v.kind,
            "sentence": v.sentence, **({} if v.offset is None else {"offset": v.offset})}


def _verdict(entry: dict) -> PairVerdict:
    """``_entry``'s inverse (a restart resumes from the verdicts shown)."""
    return PairVerdict(entry["k_score"], entry["qk_positivity"], entry["ov_positivity"], entry["kind"], entry["sentence"],
                       entry.get("offset"))
