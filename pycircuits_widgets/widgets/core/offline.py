"""Kernel-less answers: what a view shows for another selection when no kernel is attached.

A reader of a saved notebook (JupyterLab without a kernel, or with a kernel that never ran
the cell), of an exported page or of a ``save_html`` page gets no recompute when a click
changes the selection. So each view precomputes, in the kernel, the results the kernel
would send for the other selections (each head's skip-trigram table, each head's
eigenvalue detail, each head pair's composition detail) and keeps them in its ``_offline``
trait. That trait is ordinary widget state, so JupyterLab and nbclient save it with the
notebook, ``export`` and ``save_html`` carry it, and one front-end piece
(``js/src/lib/offline.js``) applies it in all three: when a selection trait changes and
the model has no live kernel connection, it sets the precomputed patch for the new
selection, as the kernel would; with a live kernel it does nothing (the kernel answers
fresh). A selection without an answer (over :data:`BUDGET`) shows the rule's one-line
reason that it needs a kernel, and controls that always need one (whole-vocabulary token
search, new text) are disabled with their reason (:data:`NEEDS_KERNEL`); these reasons are
limits of a page without a kernel, shown as a neutral note (the front end's
``_offline_note``), not as the view's ``error``.

The protocol for a view: override ``CircuitWidget.offline_answers(answers)`` and add rules
with :meth:`Answers.rule`; see README "Adding a view".

Encoding (compact, since it lands in every saved notebook): a patch holds trait values as the
view's own traits hold them (numpy arrays in :mod:`.arrays` traits, cast by those traits when
the answer is added, so an answer carries what the live trait would); ``_offline`` is
``{"rules": payload, "kernel": {name: reason}, "data": memoryview}``; the rules are one
JSON text (a notebook writes nested state indented, a line per key), deflated into a uint8
payload (``payload.encode_json``; the JSON of answers repeats keys and token strings, so
it shrinks five to seven times; :func:`rules` reads it back). Every array of every
answer is packed into the one binary ``data`` buffer (float16 for floats within its range, else
float32; uint16 for vocabulary ids that fit) and referenced from the JSON as ``{"packed": [byte offset,
dtype, shape]}`` (one buffer for hundreds of small arrays, not one payload each: a notebook
saves every buffer with its path, about 150 bytes apiece); a rule's ``base`` holds what all its answers share (e.g. the token
strings of every table, each string once), merged under each answer's own patch. An array many
answers show in part (a corpus window's tokens, in every head's examples from it) is packed once, each
answer referencing its part (:class:`Part`: a packed reference with an offset into it).
A rule: ``{"on": [trait names], "base": patch, "patches": {key: patch}, "missing": str,
"merge": [dict traits the patch adds entries to] (optional)}``,
keyed by the selection's values as JSON joined by "," (:func:`key`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from .arrays import ARRAY_TRAITS
from .payload import decode_json, encode_json, half_or_single

BUDGET = 64_000
"""Most bytes of kernel-less answers one view carries (JSON plus packed arrays, before a
notebook's base64): the quick start's explorer stays well under 0.4 MB saved."""
TABLE_K = 100
"""Most rows of each precomputed skip-trigram table: the view's own ``k`` up to this (its
default), so a saved page's tables are as long as the kernel's; a larger ``k`` is cut to it
and the page says so."""

NEEDS_KERNEL = {
    "query": "Token search reads the whole vocabulary: it needs a running kernel.",
    "token": "A token's query reads the whole vocabulary: it needs a running kernel.",
    "text": "New text needs the model: it needs a running kernel.",
    "offsets": "Other query - key offsets need the model's QK circuits: they need a running kernel.",
    "opened": "Reading a corpus example in the explorer needs the model: it needs a running kernel.",
    "ablation": "Ablating a head runs the model: it needs a running kernel.",
    "patched": "Patching a head runs the model: it needs a running kernel.",
    "direction": "The other direction's patching runs the model: it needs a running kernel.",
    "embedding": "Reading the heads through another embedding runs the model: it needs a running kernel.",
}


def key(*values) -> str:
    """The selection key the front end builds (JSON.stringify of each value, joined by ",")."""
    return ",".join(json.dumps(v, separators=(",", ":")) for v in values)


def over_budget(what: str) -> str:
    """The reason shown for a selection whose answer did not fit (the view's budget, :data:`BUDGET` unless a
    save's plan gave it another, ``core.save_plan``)."""
    return f"{what} is not saved with this view (over its budget for kernel-less answers): it needs a running kernel."


NONFINITE = "__pcw_nonfinite__"
"""A non-finite float in the rules' JSON: ``{NONFINITE: "NaN" | "Infinity" | "-Infinity"}``
(the front end reads it back as the number; the page boot uses the same tag)."""


def tag_nonfinite(x: float) -> dict:
    """A non-finite float as strict JSON can carry it: ``{NONFINITE: "NaN" | "Infinity" | "-Infinity"}``."""
    return {NONFINITE: "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")}


def _short(x: float):
    """A float as JSON short enough for saved state: 5 significant digits (non-finite tagged)."""
    return float(f"{x:.5g}") if math.isfinite(x) else tag_nonfinite(x)


@dataclass(frozen=True, eq=False)
class Part:
    """Part ``[start, stop)`` of a 1-D array that many answers share (a corpus window's tokens, which every
    head's examples in it show): packed once in the view's data under ``key``, each answer holding a
    reference to its part (``{"packed": [byte offset, dtype, [stop - start]]}``, as any packed array)."""

    key: object
    array: np.ndarray
    start: int
    stop: int


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class Answers:
    """Builds one view's ``_offline`` state within :data:`BUDGET` bytes; ``widget``: the view
    whose array traits cast each patch's values (None: patches hold their arrays as given)."""

    def __init__(self, budget: int | None = None, widget=None):
        self.left = BUDGET if budget is None else budget
        self._widget = widget
        self.rules: list[dict] = []
        self.kernel: dict[str, str] = {}
        self._data = bytearray()
        self._shared: dict = {}  # Part.key -> (byte offset, dtype) of the array packed once
        self._pending: list = []

    def needs_kernel(self, *names: str) -> None:
        """Controls (trait names) that always need a kernel: disabled offline with their reason."""
        self.kernel.update({n: NEEDS_KERNEL[n] for n in names})

    def rule(self, on: list[str], answers, *, missing: str, base: dict | None = None, merge=()) -> None:
        """Add a rule: ``answers`` yields ``(selection values, trait patch)`` pairs, most
        wanted first (the current selection first), or ``(values, patch, shared)`` where
        ``shared`` is merged into the rule's ``base`` (what all answers share, e.g. token
        strings, stored once). Answers are packed until the budget is spent; ``missing`` is
        shown for every other selection. ``merge``: dict traits an answer adds entries to
        (e.g. one pair's table into ``tables``) instead of replacing. Answers are computed
        when :meth:`steps` runs."""
        self._pending.append((list(on), answers, missing, base, list(merge)))

    def steps(self):
        """Compute every rule's answers, yielding None between answers (a runner's chunk
        boundaries), then ``{"_offline": state}``."""
        for on, answers, missing, base, merge in self._pending:
            rule = {"on": on, "base": self._compact(self._as_traits(dict(base or {}))), "patches": {}, "missing": missing}
            if merge:
                rule["merge"] = merge
            self.left -= len(_json(rule))
            self.rules.append(rule)
            if self.left <= 0:  # no answer fits: none is computed
                continue
            for values, patch, *shared in answers:
                mark, base_size = len(self._data), len(_json(rule["base"]))
                compact = self._compact(self._as_traits(patch))
                grown = _merged(rule["base"], self._compact(self._as_traits(shared[0]))) if shared else rule["base"]
                cost = len(_json(compact)) + len(self._data) - mark + len(_json(grown)) - base_size
                if cost > self.left:
                    del self._data[mark:]  # the answer did not fit: neither do the rest
                    self._shared = {k: v for k, v in self._shared.items() if v[0] < mark}
                    self.left = 0
                    break
                self.left -= cost
                rule["base"] = grown
                rule["patches"][key(*values)] = compact
                yield None
        self._pending = []
        yield {"_offline": self.state()}

    def state(self) -> dict:
        """The ``_offline`` trait value ({} when the view has nothing to say offline)."""
        if not self.rules and not self.kernel:
            return {}
        return {"rules": encode_json(self.rules), "kernel": self.kernel,
                "data": memoryview(bytes(self._data))}

    # -- encoding ------------------------------------------------------------------------
    def _as_traits(self, patch: dict) -> dict:
        """``patch`` with each array trait's value cast by that trait (as setting it would)."""
        if self._widget is None:
            return patch
        traits = self._widget.traits()
        return {name: traits[name].validate(self._widget, value)
                if isinstance(traits.get(name), ARRAY_TRAITS) else value for name, value in patch.items()}

    def _pack(self, arr: np.ndarray) -> dict:
        if arr.dtype.kind == "f":  # half the bytes, unless a value is past float16's range
            arr = arr.astype(half_or_single(arr))
        elif arr.dtype.kind in "iu" and arr.size and arr.min() >= 0 and arr.max() < 1 << 16:
            arr = arr.astype(np.uint16)
        self._data.extend(b"\0" * (-len(self._data) % arr.dtype.itemsize))  # typed-array alignment
        offset = len(self._data)
        self._data.extend(np.ascontiguousarray(arr).tobytes())
        return {"packed": [offset, str(arr.dtype), list(arr.shape)]}

    def _part(self, part: Part) -> dict:
        if part.key not in self._shared:
            offset, dtype, _ = self._pack(np.asarray(part.array))["packed"]
            self._shared[part.key] = (offset, dtype)
        offset, dtype = self._shared[part.key]
        return {"packed": [offset + part.start * np.dtype(dtype).itemsize, dtype, [part.stop - part.start]]}

    def _compact(self, value):
        if isinstance(value, Part):
            return self._part(value)
        if isinstance(value, np.ndarray):
            return self._pack(value)
        if isinstance(value, dict):
            return {k: self._compact(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._compact(v) for v in value]
        if isinstance(value, float):
            return _short(value)
        return value


def answer_bytes(patch: dict, widget=None) -> int:
    """Bytes one answer of ``patch`` counts against a view's budget (its JSON and packed arrays, as
    :class:`Answers` packs them): a save's plan sizes a view's answers with it."""
    answers = Answers(widget=widget)
    return len(_json(answers._compact(answers._as_traits(patch)))) + len(answers._data)


def rules(state: dict) -> list[dict]:
    """The rules of an ``_offline`` state (inverse of the deflated JSON of ``Answers.state``)."""
    return decode_json(state["rules"])


def _merged(base: dict, shared: dict) -> dict:
    """``base`` with ``shared`` merged in (dicts merged key by key, recursively)."""
    out = dict(base)
    for k, v in shared.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def fill(widget, budget: int | None = None) -> dict:
    """The ``_offline`` state of ``widget``, computed now (its ``offline_answers``)."""
    return last(steps(widget, budget))["_offline"]


def steps(widget, budget: int | None = None):
    """The runner steps that compute ``widget``'s ``_offline`` (None between answers)."""
    answers = Answers(budget, widget)
    widget.offline_answers(answers)
    return answers.steps()


def heads(widget) -> list[tuple[int, int]]:
    """(layer, head) of every head of the widget's model, its current one first."""
    cfg = widget.model.cfg
    current = (widget.layer, widget.head)
    return [current] + [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads) if (l, h) != current]


def last(steps) -> dict:
    """The final update of a widget's recompute steps (a generator of trait patches; checkpoints,
    None or ``runner.GIVE_WAY``, are skipped)."""
    update = {}
    for step in steps:
        update = step if isinstance(step, dict) and step else update
    return update
