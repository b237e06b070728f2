"""NeuronView: one MLP neuron of the selected layer through the paper's MLP path terms."""

from __future__ import annotations

import torch
import traitlets

from ...analysis.circuits import require_mlp
from ...analysis.neurons import (
    neuron_activations_steps,
    neuron_out_norms,
    neuron_out_norms_steps,
    neuron_terms,
    ranked_neurons,
    top_tokens,
)
from ..core import offline
from ..core.arrays import Array, ArrayDict
from ..core.base import CircuitWidget
from ..core.meter import metered
from ..core.selection import Bounded, HeadSelection, Index, PositionSelection, check_model
from ..core.text_data import TextData

NORM_NOTE = ("Token circuits through an MLP read the raw W_E (its stream also holds the attention output, so "
             "the norm's division depends on the context); the norm's learned scale is folded into W_in/W_gate.")

LABELS = {
    "in": "W_E W_in: tokens that drive it directly{reader}",
    "gate": "W_E W_gate: tokens that open its gate directly",
    "head_in": "W_E W_OV W_in through the head: source tokens it attends to that drive it{reader}",
    "head_gate": "W_E W_OV W_gate through the head: source tokens that open its gate",
    "out": "W_out W_U: tokens it promotes",
    "out_bottom": "W_out W_U: tokens it suppresses",
}
"""Each table's caption (``{reader}``: " (in-projection)" for a gated MLP)."""


K = Bounded(min=1, max=lambda model: min(100, model.cfg.d_vocab))
"""Bounds of the constructor's ``k`` (tokens per table)."""
N_NEURONS = Bounded(min=1, max=lambda model: model.cfg.d_mlp)
"""Bounds of the constructor's ``n_neurons`` (neurons listed)."""

STAGES = {"activations": ("neurons: activations on the text", "layers"),
          "gram": ("neurons: W_U W_U^T", "step"), "layers": ("neurons: ||W_out W_U|| per neuron", "layers")}
"""The ``progress`` text and unit of each stage of the text's job (each metered apart)."""

LIST_ANSWERS = 64
"""Most (layer, position) neuron lists a saved page holds (about 10 KB; the tables get the rest)."""


class NeuronView(TextData, HeadSelection, PositionSelection, CircuitWidget):
    """A neuron (``neuron``) of the selected layer's MLP (``layer``) seen through the paper's MLP path
    terms (``pcw.analysis.neurons``): ``W_E W_in`` (tokens that drive it directly; a gated MLP
    ``act(x W_gate) * (x W_in)`` also shows its gate's ``W_E W_gate``), ``W_E W_OV W_in`` through the
    selected head (``head`` of the same layer: an MLP reads what its own layer's heads wrote) and
    ``W_out W_U`` (tokens it promotes, top, and suppresses, bottom); each the exact top ``k`` over the
    vocabulary. The circuits read the raw ``W_E`` (``NORM_NOTE``).

    Beside them, the layer's neurons worth looking at (``neurons``): with a ``position`` selected, the
    ``n_neurons`` largest ``|activation|`` there on ``text`` (``analysis.neurons.neuron_activations``
    of the forward's cache); with none, the largest ``||W_out[n] W_U||``. Computed on the view's runner
    (``on_demand``); a saved page holds the lists (``LIST_ANSWERS``: this layer's first) and the tables
    of the listed neurons, within ``widgets.core.offline.BUDGET``.

    Args:
        model: a weight view with MLPs (an attention-only model is refused: ``ValueError``).
        text: the text whose activations rank the neurons.
        k: tokens per table. n_neurons: neurons listed.
        forward, one_token, active: as ``TextData`` and ``OnDemand``.
    """

    _view = traitlets.Unicode("Neurons").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "position", "neuron", "text", "active"})
    _answers_offline = "runner"
    _offline_inputs = ("text",)

    # -- selection (layer, head, position from the mixins) --
    neuron = Index(-1).tag(sync=True)
    """int, default -1: the neuron of layer ``layer``'s MLP, in ``0..d_mlp-1``, -1 for none."""

    # -- data --
    text = traitlets.Unicode("").tag(sync=True)
    """str: the text whose activations rank the neurons."""
    d_mlp = traitlets.Int().tag(sync=True)
    """int (read-only): neurons per MLP layer."""
    neurons = Array("int32", ndim=1).tag(sync=True)
    """int32 [n_neurons] or None: the layer's listed neurons, first the most worth looking at (``ranking``)."""
    neuron_scores = Array("float32", ndim=1).tag(sync=True)
    """float32 [n_neurons] or None: their activation at ``position``, or ``||W_out[n] W_U||``."""
    ranking = traitlets.Unicode("").tag(sync=True)
    """str: how ``neurons`` are ranked: "activation" (largest ``|activation|`` at ``listed_for``'s position)
    or "norm" (largest ``||W_out[n] W_U||``: how strongly the neuron moves the logits)."""
    listed_for = traitlets.List(traitlets.Int()).tag(sync=True)
    """[layer, position] that ``neurons`` answer."""
    direct = ArrayDict(None).tag(sync=True)
    """{"layer", "neuron", "tables": [{"term", "ids": int32 [k], "values": float32 [k]}]}: the
    neuron's direct tables (``W_E W_in``, ``W_E W_gate``, ``W_out W_U`` top and bottom; none for neuron
    -1), stamped with the selection they answer (a saved page never shows another neuron's)."""
    through_head = ArrayDict(None).tag(sync=True)
    """The same (with "head") for ``W_E W_OV W_in`` (and ``W_gate``) through head ``(layer, head)``."""
    strings = traitlets.Dict().tag(sync=True)
    """{str(token id): display string} of the tokens in the tables (a saved page: of every saved table)."""
    labels = traitlets.Dict().tag(sync=True)
    """{term: caption} (read-only): each table's caption (``LABELS``)."""
    note = traitlets.Unicode(NORM_NOTE).tag(sync=True)
    """str (read-only): which embedding the circuits read."""

    def __init__(self, model, text: str, k: int = 10, n_neurons: int = 10, forward=None, one_token: bool = False,
                 **kwargs):
        check_model(model, "NeuronView")
        require_mlp(model, 0)
        self._k = K.check(k, model, "k")
        self._n_neurons = N_NEURONS.check(n_neurons, model, "n_neurons")
        self._acts: torch.Tensor | None = None  # [L, pos, d_mlp] of the current text
        self._norms: torch.Tensor | None = None  # [L, d_mlp], once
        position = kwargs.pop("position", -1)  # bounded by the text, which TextData sets after the traits
        reader = " (in-projection)" if model.cfg.gated_mlp else ""
        super().__init__(model, text, forward, one_token, d_mlp=model.cfg.d_mlp,
                         labels={term: label.format(reader=reader) for term, label in LABELS.items()}, **kwargs)
        self.position = position

    def _started(self) -> None:
        super()._started()
        self.observe(self._on_list, ["layer", "position"])
        self.observe(self._on_neuron, ["layer", "head", "neuron"])

    def _index_bounds(self, name):
        if name == "neuron":
            return 0, self.model.cfg.d_mlp - 1, True
        return super()._index_bounds(name)

    def _n_positions(self) -> int:
        return self._n_tokens

    _short_text = "neurons need one"

    def _ready(self) -> bool:
        return self.neurons is not None

    def _start(self) -> None:
        super()._start()
        self._on_neuron(None)

    def _on_list(self, change) -> None:
        if self._computing:
            layer, position = self.layer, self.position
            self._runner.submit("list", lambda: iter([self._list(*self._ranked(layer, position))]))

    def _on_neuron(self, change) -> None:
        if self._computing:
            layer, head, neuron = self.layer, self.head, self.neuron
            self._runner.submit("tables", lambda: iter([self._tables(layer, head, neuron)]))

    # -- results (on the runner) ---------------------------------------------------------
    def _text_steps(self, text: str):
        """The text's forward, every layer's activations (one layer a piece), the norms where the
        list needs them, then the list; metered."""
        out = self._forward(self.model, text)
        acts = yield from metered(neuron_activations_steps(self.model, out.cache), {None: STAGES["activations"]})
        self._acts = acts[0].float()  # [L, pos, d_mlp] of the one text
        position = self.position if self.position < out.tokens.shape[-1] else -1
        if position < 0 and self._norms is None:
            self._norms = (yield from metered(neuron_out_norms_steps(self.model), STAGES)).float()
        yield {**self._list(*self._ranked(self.layer, position)), "progress": {}}

    def _ranked(self, layer: int, position: int) -> tuple[list[int], list[int], torch.Tensor, str]:
        """``[layer, position]``, the listed neurons of ``layer`` for ``position`` (-1: by
        ``||W_out[n] W_U||``), their scores and the rule."""
        if position >= 0 and self._acts is not None:
            scores, ranking = self._acts[layer, position], "activation"
        else:
            if self._norms is None:
                self._norms = neuron_out_norms(self.model).float()
            scores, ranking = self._norms[layer], "norm"
        ids, values = ranked_neurons(scores, self._n_neurons)
        return [layer, position], ids.tolist(), values, ranking

    @staticmethod
    def _list(listed_for: list[int], ids: list[int], values: torch.Tensor, ranking: str) -> dict:
        return {"listed_for": listed_for, "neurons": ids,
                "neuron_scores": values.float(), "ranking": ranking}

    def _tables(self, layer: int, head: int, neuron: int) -> dict:
        """``direct`` and ``through_head`` of ``neuron`` of ``layer`` and head ``(layer, head)``, and the
        ``strings`` of their tokens."""
        direct, through = {"layer": layer, "neuron": neuron}, {"layer": layer, "head": head, "neuron": neuron}
        if neuron < 0:
            return {"direct": {**direct, "tables": []}, "through_head": {**through, "tables": []}, "strings": {}}
        terms = neuron_terms(self.model, layer, neuron, (layer, head))
        tops = {name: top_tokens(v, self._k) for name, v in terms.items()}
        tops["out_bottom"] = top_tokens(terms["out"], self._k, largest=False)
        tables = {name: {"term": name, "ids": ids, "values": values.float()} for name, (values, ids) in tops.items()}
        strings = self.model.token_strings
        return {"direct": {**direct, "tables": [tables[n] for n in ("in", "gate", "out", "out_bottom") if n in tables]},
                "through_head": {**through, "tables": [tables[n] for n in ("head_in", "head_gate") if n in tables]},
                "strings": {str(i): strings[i] for _, ids in tops.values() for i in ids.tolist()}}

    # -- kernel-less answers -------------------------------------------------------------
    def offline_answers(self, answers) -> None:
        """Kernel-less: the neuron lists (at most ``LIST_ANSWERS``: this layer's for every position,
        the current position first, then the other layers' for the current position and none, then
        theirs for the other positions), then the tables of the listed neurons through the current head (the
        current neuron first), then of the current neuron through the layer's other heads."""
        others = [l for l in range(self.model.cfg.n_layers) if l != self.layer]
        positions = list(dict.fromkeys([self.position, -1, *range(self._n_tokens)]))
        wanted = [(self.layer, p) for p in positions] + [(l, p) for l in others for p in positions[:2]] + [
            (l, p) for l in others for p in positions[2:]]
        lists = {(l, p): self._ranked(l, p) for l, p in wanted[:LIST_ANSWERS]}
        answers.rule(["layer", "position"], (((l, p), self._list(*ranked)) for (l, p), ranked in lists.items()),
                     missing=offline.over_budget("This layer's neuron list"))
        candidates = list(dict.fromkeys([(self.layer, self.neuron)] + [
            (l, n) for (l, _), (_, ids, _, _) in lists.items() for n in ids]))
        # one answer holds all of a neuron's tables, so a saved neuron shows whole
        selections = list(dict.fromkeys([(l, self.head, n) for l, n in candidates] + [
            (self.layer, h, self.neuron) for h in range(self.model.cfg.n_heads)]))
        answers.rule(["layer", "head", "neuron"], (_shared_strings((l, h, n), self._tables(l, h, n))
                                                   for l, h, n in selections),
                     missing=offline.over_budget("This neuron's tables"))


def _shared_strings(selection: tuple, patch: dict) -> tuple:
    """A saved answer whose token strings go to the rule's shared base (each string saved once)."""
    tables = {k: v for k, v in patch.items() if k != "strings"}
    return selection, tables, {"strings": patch["strings"]}
