"""What a page without a kernel answers: kernel results precomputed when the page is written.

In a kernel-less page (``save_html``) a view that changes its selection gets no recompute.
So that a reader can still click through every head, :func:`offline_answers` computes,
while the page is written, the result the kernel would send for each selection: each
head's skip-trigram table (top :data:`TABLE_K`), each head's eigenvalue detail, and each
head pair's composition detail for the composition kind shown. The page's host (``js/src/lib/host.js``) applies the
answer for the new selection, as the kernel would; a selection with no answer (over
:data:`BUDGET`) shows a one-line reason saying it needs a kernel. Controls that always
need the kernel (the whole-vocabulary token search, new text) are listed in ``kernel``
with the reason the view shows when it disables them.

Answers are trait patches in the saved-state format (JSON state, binary buffers in
base64 with their paths), keyed by the selection's values as JSON joined by ",".
"""

from __future__ import annotations

import base64
import itertools
import json

BUDGET = 400_000
"""Most bytes of precomputed answers in one page (all views together)."""
TABLE_K = 40
"""Rows of each precomputed skip-trigram table (two pages of the view)."""

NEEDS_KERNEL = {
    "query": "Token search reads the whole vocabulary: it needs a running kernel.",
    "token": "A token's query reads the whole vocabulary: it needs a running kernel.",
    "text": "New text needs the model: it needs a running kernel.",
}


def saved_form(patch: dict) -> dict:
    """A trait patch as saved state: binary values (memoryview/bytes) moved to base64
    buffers with their paths."""
    paths, buffers = [], []

    def walk(value, path):
        if isinstance(value, (memoryview, bytes, bytearray)):
            paths.append(path)
            buffers.append(base64.b64encode(bytes(value)).decode("ascii"))
            return None
        if isinstance(value, dict):
            return {k: walk(v, [*path, k]) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, [*path, i]) for i, v in enumerate(value)]
        return value

    return {"state": walk(patch, []), "buffer_paths": paths, "buffers": buffers}


def key(*values) -> str:
    """The selection key the page's host builds (JSON.stringify of each value, joined by ",")."""
    return ",".join(json.dumps(v, separators=(",", ":")) for v in values)


class Budget:
    """Bytes left for answers in one page."""

    def __init__(self, size: int | None = None):
        self.left = BUDGET if size is None else size

    def take(self, answer: dict) -> bool:
        n = len(json.dumps(answer))
        if n > self.left:
            self.left = 0
            return False
        self.left -= n
        return True


def _rule(on, patches_by_key, budget: Budget, missing: str) -> dict:
    """One answer rule: the patches that fit in the budget, in the given order (the
    current selection first), and the reason shown for the others."""
    patches = {}
    for k, make in patches_by_key:
        answer = saved_form({**make(), "error": ""})
        if not budget.take(answer):
            break
        patches[k] = answer
    return {"on": on, "patches": patches, "missing": missing}


def _over_budget(what: str) -> str:
    return f"{what} is not in this page (over its {BUDGET // 1000} KB budget for precomputed results): it needs a running kernel."


def _heads(w):
    """(layer, head) of every head, the widget's current one first."""
    cfg = w.model.cfg
    heads = list(itertools.product(range(cfg.n_layers), range(cfg.n_heads)))
    heads.remove((w.layer, w.head))
    return [(w.layer, w.head), *heads]


def _last(steps) -> dict:
    """The final update of a widget's recompute steps (a generator of trait patches)."""
    update = {}
    for update in steps:
        pass
    return update


def _skip_trigrams(w, budget):
    if w.model.cfg.d_vocab > w.partial_above:  # seconds per head: a page would take minutes to write
        return [{"on": ["layer", "head"], "patches": {},
                 "missing": "Skip-trigram tables of other heads need a running kernel (large vocabulary)."}]
    return [_rule(["layer", "head"], [
        (key(l, h), lambda l=l, h=h: {**_last(w._table_steps(l, h, TABLE_K)),
                                      "k": TABLE_K, "related": {}, "token": -1})
        for l, h in _heads(w)
    ], budget, _over_budget("This head's skip-trigram table"))]


def _eigen(w, budget):
    return [_rule(["layer", "head"], [
        (key(l, h), lambda l=l, h=h: _last(w._detail_steps(l, h, w.n_copies))) for l, h in _heads(w)
    ], budget, _over_budget("This head's eigenvalue detail"))]


def _composition(w, budget):
    cfg = w.model.cfg
    pairs = [[l1, h1, l2, h2] for l1, h1, l2, h2 in itertools.product(
        range(cfg.n_layers), range(cfg.n_heads), range(cfg.n_layers), range(cfg.n_heads)) if l1 < l2]
    current = list(w.selected_pair)
    if current in pairs:
        pairs.remove(current)
        pairs.insert(0, current)
    return [_rule(["selected_pair", "kind"], [
        (key(p, w.kind), lambda p=p: _last(w._detail_steps(p, w.kind))) for p in pairs
    ], budget, f"This page holds the {w.kind}-composition details of head pairs (within its {BUDGET // 1000} KB "
                 "budget for precomputed results); this one needs a running kernel.")]


_ANSWERS = {"SkipTrigramTable": _skip_trigrams, "EigenvaluePlot": _eigen, "CompositionMatrix": _composition}
_KERNEL = {"SkipTrigramTable": ("query", "token"), "AttentionPatterns": ("text",)}


_SELECTION = {
    "SkipTrigramTable": (["layer", "head"], "Other heads' skip-trigram tables"),
    "EigenvaluePlot": (["layer", "head"], "Other heads' eigenvalue details"),
    "CompositionMatrix": (["selected_pair", "kind"], "Other head pairs' composition details"),
}


def saved_state_answers(state: dict) -> dict | None:
    """The ``offline`` entry of a view shown from saved state alone (a notebook export):
    the notebook holds only the results of the selection it was saved with, so another
    selection says it needs a kernel (the view keeps the saved results, captioned with
    their head); kernel-only controls are disabled."""
    view = state.get("_view")
    rules = []
    if view in _SELECTION:
        on, what = _SELECTION[view]
        rules = [{"on": on, "patches": {}, "missing": f"{what} are not in this page (exported from a saved notebook, "
                                                     "which holds the selection it was saved with): they need a running "
                                                     "kernel, or a page written with save_html."}]
    kernel = {name: NEEDS_KERNEL[name] for name in _KERNEL.get(view, ())}
    if view == "AttentionPatterns" and not state.get("editable"):
        kernel = {}
    return {"answers": rules, "kernel": kernel} if rules or kernel else None


def offline_answers(widget, budget: Budget) -> dict | None:
    """The ``offline`` entry of a live widget's page: answer rules and controls that need
    a kernel; None for a view that needs neither."""
    view = getattr(widget, "_view", None)
    rules = _ANSWERS[view](widget, budget) if view in _ANSWERS and getattr(widget, "model", None) is not None else []
    kernel = {name: NEEDS_KERNEL[name] for name in _KERNEL.get(view, ())}
    if view == "AttentionPatterns" and not widget.editable:
        kernel = {}
    return {"answers": rules, "kernel": kernel} if rules or kernel else None
