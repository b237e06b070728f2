"""The explorer's views, declared once: what each section is, what it follows, how it is built.

:data:`VIEWS` is the one list of the explorer's sections, in the order they are shown. The
explorer (``explorer.py``) builds its child views by iterating it, names its child traits
after it, and sends the browser what it needs of it (``CircuitExplorer.sections``: name,
title, hint, followed selection keys, layout), so ``js/src/views/CircuitExplorer.svelte`` and
``js/src/lib/selection.js`` declare no view of their own. Adding a section is one entry here.

What links sections besides the selection is declared here too: how a section shows the explorer's
run (``ViewSpec.reads_run``, ``ViewSpec.shows_run``: the clean run of the text, or the run a causal
check made, ``core.shown_run``) and what a change in one section does elsewhere (:data:`LINKS`: an
example opened, a neuron clicked). The explorer itself names no section.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...analysis.composition import strongest_writers
from ...models.tokenizer import escape_invisible
from .attention import AttentionPatterns
from .bigram_table import BigramTable
from .causal_checks import CausalChecks
from .colored_tokens import ColoredTokens
from .composition_matrix import CompositionMatrix
from .dataset_examples import DatasetExamples
from .eigenvalue_plot import EigenvaluePlot
from .induction_mechanism import InductionMechanism
from .neurons import NeuronView
from .path_expansion import PathExpansion
from .positional_qk import PositionalQK
from .skip_trigram_table import SkipTrigramTable
from .task_circuit import TaskCircuit
from .virtual_heads import VirtualHeads

if TYPE_CHECKING:
    from ..core.base import CircuitWidget
    from ..core.shown_run import Shown
    from .explorer import CircuitExplorer

LARGE_VOCAB_TRIGRAM_OFFSETS = 8
"""Rotary models over ``SkipTrigramTable.partial_above`` tokens read their skip-trigrams over at most
this many offsets by default (each offset is one more exact whole-vocabulary search: about a minute
per head at 49k tokens on a loaded 2-core machine); the view's offset control widens it."""


@dataclass(frozen=True)
class ViewSpec:
    """One section of the explorer.

    Attributes:
        name: the explorer's attribute (``explorer.trigrams``) and the section's ``data-view``.
        cls: the view class (also usable on its own).
        noun: what it shows, in a sentence ("No skip-trigrams for this model: ...").
        title: the section's heading. hint: the line under it (what a click does).
        follows: the selection keys it shows and may change by a click (``SELECTION_KEYS``).
        build: ``explorer -> view``: the view of the explorer's model, text and selection.
        doc: the child trait's docstring.
        on_demand: built inactive, computed on first use (``CircuitExplorer.compute``).
        wide: spans the explorer's whole row (tables whose columns must not scroll).
        picture: drawn in the explorer's static picture (``pictures.explorer``).
        reads_text: follows the explorer's text.
        needs_heads: refused (with a notice) for a model without attention heads.
        optional: a model the view refuses (``ValueError``) gets a notice instead; not optional:
            the refusal is the explorer's.
        needs_sweep: reads the explorer's corpus sweep (``CircuitExplorer(..., sweep=)``); an explorer
            without one has no such section (no view, no notice).
        needs_task: reads the explorer's task (``CircuitExplorer(..., task=)``), the same way.
        window: ``(explorer, n_tokens=None) -> {"offsets": range} | {}``: the rotary offset window
            ``build`` gives the view for a text of ``n_tokens`` (default: the explorer's); a new text
            moves the view to the new one unless its window was changed from that default.
        reads_run: ``(view, clean)``: what the view does with a new text's clean run (``pcw.run``).
        shows_run: ``(view, shown)``: how the view shows the run the explorer shows (a ``core.shown_run.Shown``:
            the clean run, or a causal check's).
        options: the explorer's keyword arguments that are this view's traits (``ablation=``), set on it
            once the explorer's selection is.
    """

    name: str
    cls: type
    noun: str
    title: str
    hint: str
    follows: tuple[str, ...]
    build: Callable[[CircuitExplorer], CircuitWidget] = field(repr=False)
    doc: str = ""
    on_demand: bool = False
    wide: bool = False
    picture: bool = False
    reads_text: bool = False
    needs_heads: bool = True
    optional: bool = True
    needs_sweep: bool = False
    needs_task: bool = False
    window: Callable[..., dict] | None = field(default=None, repr=False)
    reads_run: Callable[[CircuitWidget, object], None] | None = field(default=None, repr=False)
    shows_run: Callable[[CircuitWidget, Shown], None] | None = field(default=None, repr=False)
    options: tuple[str, ...] = ()

    def available(self, explorer: CircuitExplorer) -> bool:
        """Whether the explorer has what the section reads (its sweep, its task)."""
        return not (self.needs_sweep and explorer.sweep is None) and not (self.needs_task and explorer.task is None)

    def follow_window(self, explorer: CircuitExplorer, view, n_before: int) -> None:
        """A new text: a rotary view still on its default window (the old text's offsets, of ``n_before``
        tokens) moves to the new text's; a window the reader chose stays."""
        if self.window is None:
            return
        before, now = self.window(explorer, n_before), self.window(explorer)
        if before and list(view.offsets) == list(before["offsets"]) != list(now["offsets"]):
            view.offsets = list(now["offsets"])

    def browser(self) -> dict:
        """What the browser needs of this section (``CircuitExplorer.sections``)."""
        return {"name": self.name, "title": self.title, "hint": self.hint, "follows": list(self.follows),
                "wide": self.wide, "picture": self.picture}


def rotary_window(explorer, n_tokens: int | None = None) -> dict:
    """Rotary QK circuits are read over the query - key offsets a text of ``n_tokens`` tokens has
    (default: the explorer's text; each view says so)."""
    n = len(explorer.token_ids) if n_tokens is None else n_tokens
    return {"offsets": range(0, n)} if explorer.model.cfg.positional == "rotary" else {}


def trigram_window(explorer, n_tokens: int | None = None) -> dict:
    """The rotary window of the skip-trigram table: at most ``LARGE_VOCAB_TRIGRAM_OFFSETS`` offsets
    for a large vocabulary."""
    window = rotary_window(explorer, n_tokens)
    if window and explorer.model.cfg.d_vocab > SkipTrigramTable.partial_above:
        return {"offsets": range(0, min(len(window["offsets"]), LARGE_VOCAB_TRIGRAM_OFFSETS))}
    return window


LOSS_DISPLAY = {"label": "loss (nats)", "colormap": "sequential", "vmin": None, "vmax": None, "note": ""}
"""How the loss section shows the clean run's per-token loss (``ColoredTokens`` display traits)."""
CHANGE_NOTE = "0 (white) at the centre, symmetric: red = the {verb} run's loss is higher, blue = lower"
"""The loss section's legend note while it shows a checked run's loss change."""


def _head(e) -> dict:
    return {"layer": e.layer, "head": e.head}


def show_loss(view: ColoredTokens, shown: Shown) -> None:
    """The clean run's per-token loss, or a checked run's loss change (checked - clean) on a diverging scale
    symmetric about 0."""
    clean = shown.clean
    tokens = list(clean.str_tokens[0][1:])
    if view.tokens != [escape_invisible(t) for t in tokens]:  # a new text
        view.set_values(tokens, clean.token_loss[0])
    if shown.result is None:
        view.show_values(clean.token_loss[0], **LOSS_DISPLAY)
        return
    verb = shown.label.split(":")[0]  # "ablated"
    change = (shown.result.loss - shown.result.clean_loss)[0]
    m = float(change.abs().max())
    view.show_values(change, label=f"loss change, {verb} − clean (nats)", colormap="diverging", vmin=-m, vmax=m,
                     note=CHANGE_NOTE.format(verb=verb))


def show_patterns(view: AttentionPatterns, shown: Shown) -> None:
    """A checked run's patterns under its label, or the text's own again."""
    view.show_run(None if shown.result is None else shown.result.cache.patterns[0], shown.label)


def show_label(view, shown: Shown) -> None:
    """A view read from the weights says which run the others show (no causal check changes its numbers)."""
    view.run_label = shown.label


def measure_on(view: CompositionMatrix, clean) -> None:
    """The composition section measures composition on the text."""
    view.measure_on(clean, f"measured on this text ({clean.tokens.shape[1]} tokens): h1's output removed from "
                           "h2's input")


VIEWS: tuple[ViewSpec, ...] = (
    ViewSpec("loss", ColoredTokens, "per-token loss", "Per-token loss",
             "loss of predicting each token from the ones before it; click a token to select it", ("position",),
             lambda e: ColoredTokens(e.tokens[1:], e.forward(e.model, e.text).token_loss[0], first_position=1,
                                     **LOSS_DISPLAY),
             "loss of predicting each token from those before it (text positions 1..n-1).",
             wide=True, picture=True, needs_heads=False, optional=False, shows_run=show_loss),
    ViewSpec("causal", CausalChecks, "causal checks", "Causal checks of the selected head",
             "ablate it: the loss and attention sections show the ablated run; the table: each head's ablation "
             "loss change (a click selects the head)", ("layer", "head"),
             lambda e: CausalChecks(e.model, e.run, sweep=e.sweep, **_head(e)),
             "the selected head ablated on ``text`` (``ablation``), each head's ablation loss change.",
             wide=True, options=("ablation",)),
    ViewSpec("circuit", TaskCircuit, "task circuit", "Task: where the behaviour lives",
             "exact and attribution patching of the task's prompt pairs; a head's cell or point selects the head",
             ("layer", "head"), lambda e: TaskCircuit(e.task.model, e.task, run=e.run, **_head(e)),
             "the task's patching heatmaps (``CircuitExplorer(model, text, task=pcw.Task(...))``).", wide=True,
             needs_task=True),
    ViewSpec("attention", AttentionPatterns, "attention patterns", "Attention patterns",
             "click a head to select it; pin a token in the token view", ("layer", "head", "position"),
             lambda e: AttentionPatterns(e.model, e.text, forward=e.forward, **_head(e)),
             "every head's pattern on ``text``.", wide=True, picture=True, reads_text=True, shows_run=show_patterns),
    ViewSpec("trigrams", SkipTrigramTable, "skip-trigrams", "Skip-trigrams of the selected head",
             "[source] … [destination] → [out]; search a token for its query", ("layer", "head", "token"),
             lambda e: SkipTrigramTable(e.model, **_head(e), **trigram_window(e), sweep=e.sweep),
             "the selected head's skip-trigrams and the selected token's query.", wide=True, picture=True,
             window=trigram_window),
    ViewSpec("examples", DatasetExamples, "dataset examples", "Dataset examples of the selected head",
             "where in the corpus sweep the head writes most (in the neurons section: the selected neuron); "
             "click an example to read it here", ("layer", "head"),
             lambda e: DatasetExamples(e.sweep, e.model, openable=True, **_head(e)),
             "the selected head's (or neuron's) top examples in ``explorer.sweep``, each in its context.",
             wide=True, picture=True, needs_sweep=True),
    ViewSpec("composition", CompositionMatrix, "composition scores", "Composition",
             "click a cell: the reading head becomes the selected head", ("layer", "head", "selected_pair"),
             lambda e: CompositionMatrix(e.model, **_head(e), **rotary_window(e)),
             "Q/K/V composition of head pairs (models with >= 2 layers).", picture=True, window=rotary_window,
             reads_run=measure_on),
    ViewSpec("eigen", EigenvaluePlot, "eigenvalues (copying)", "Eigenvalues",
             "click a head; positive eigenvalues mean copying", ("layer", "head"),
             lambda e: EigenvaluePlot(e.model, **_head(e), **rotary_window(e), sweep=e.sweep),
             "OV/QK eigenvalue positivity of every head, the selected head's spectrum.", picture=True,
             window=rotary_window),
    ViewSpec("paths", PathExpansion, "path expansion", "Path expansion",
             "direct path + heads + virtual heads (attention frozen); click a term to select its head or pair, "
             "hover a token", ("layer", "head", "position", "selected_pair"),
             lambda e: PathExpansion(e.model, e.text, forward=e.forward, one_token=True, active=False, **_head(e)),
             "the logits on ``text`` as direct path + heads + virtual heads (attention-only models).",
             on_demand=True, wide=True, reads_text=True),
    ViewSpec("induction", InductionMechanism, "induction mechanism", "Induction mechanism of the selected pair",
             "K-composition of earlier → later head, then copying; a composition cell, a virtual head or a reading "
             "head selects the pair", ("layer", "head", "token", "selected_pair"),
             lambda e: InductionMechanism(e.model, selected_pair=[], active=False, **_head(e), **rotary_window(e)),
             "K-composition and copying of the selected pair (>= 2 layers, no rotary).", on_demand=True,
             window=rotary_window, shows_run=show_label),
    ViewSpec("positional", PositionalQK, "positional attention", "Positional attention of the selected head",
             "score by relative offset from the positional QK term, beside the measured attention", ("layer", "head"),
             lambda e: PositionalQK(e.model, e.text, forward=e.forward, one_token=True, active=False, **_head(e)),
             "the selected head's positional score and attention by relative offset.", on_demand=True,
             reads_text=True),
    ViewSpec("neurons", NeuronView, "MLP neurons", "MLP neurons of the selected layer",
             "W_E W_in, W_E W_OV W_in through the selected head, W_out W_U; click a neuron (ranked by activation "
             "at the selected position)", ("layer", "head", "position"),
             lambda e: NeuronView(e.model, e.text, forward=e.forward, one_token=True, active=False, **_head(e)),
             "the selected layer's MLP neurons through the paper's MLP path terms (models with MLPs).",
             on_demand=True, reads_text=True),
    ViewSpec("virtual", VirtualHeads, "virtual heads", "Virtual heads (V-composition)",
             "click a row to select the pair", ("layer", "head", "selected_pair"),
             lambda e: VirtualHeads(e.model, active=False, **_head(e)),
             "the strongest V-composition pairs (>= 2 layers).", on_demand=True),
    # milliseconds, but every row is saved with the page: computed at once only where it is the
    # model's one view (zero layers), else on first use like the other paper views
    ViewSpec("bigrams", BigramTable, "bigram table", "Direct path (bigrams)",
             "W_E W_U: the selected token's most likely next tokens; search the vocabulary", ("token",),
             lambda e: BigramTable(e.model, active=e.n_layers == 0),
             "the direct path ``W_E W_U``'s top next tokens for the selected token (every model).",
             on_demand=True, needs_heads=False),
)
"""The explorer's sections, in the order shown."""

BY_NAME = {spec.name: spec for spec in VIEWS}
"""View name -> its :class:`ViewSpec`."""
ON_DEMAND = tuple(spec.name for spec in VIEWS if spec.on_demand)
"""The views the explorer builds inactive (``on_demand``)."""


EXPLORER = "explorer"
"""A :class:`Link`'s source for the explorer's own traits (its selection)."""


@dataclass(frozen=True)
class Link:
    """A change in one section that moves the explorer or another section (besides the selection, which
    every section follows by ``ViewSpec.follows``): when a trait in ``traits`` of section ``source`` (or
    of the explorer: :data:`EXPLORER`) changes, ``apply(explorer, source)`` runs. Applied once when the
    explorer links its sections, so it must be a no-op where nothing was changed."""

    source: str
    traits: tuple[str, ...]
    apply: Callable[[CircuitExplorer, object], None] = field(repr=False)
    doc: str = ""


def _open_example(explorer, examples) -> None:
    if examples.opened:
        explorer.open_example(*examples.opened)


def _examples_of_neuron(explorer, neurons) -> None:
    examples = explorer.views().get("examples")
    if examples is not None and neurons.neuron >= 0:
        with examples.hold_trait_notifications():
            examples.layer, examples.neuron = neurons.layer, neurons.neuron


def _examples_of_head(explorer, _) -> None:
    examples = explorer.views().get("examples")
    if examples is not None:
        examples.neuron = -1


def _strongest_writers(explorer, composition) -> None:
    scores = composition.scores.get("K", {}).get("correct")
    writers = None if scores is None else strongest_writers(scores)
    if writers is not None or explorer.strongest_writers is not None:
        explorer.strongest_writers = writers


LINKS: tuple[Link, ...] = (
    Link("attention", ("text",), lambda e, attention: setattr(e, "text", attention.text),
         "a text typed in the attention section is the explorer's text (every section reads it)"),
    Link("examples", ("opened",), _open_example,
         "an example opened in the examples section is read here: its window's text, its position selected"),
    Link("neurons", ("neuron",), _examples_of_neuron, "a neuron clicked: the examples section shows its examples"),
    Link(EXPLORER, ("layer", "head"), _examples_of_head, "a head selected: the examples section shows the head's"),
    Link("composition", ("scores",), _strongest_writers,
         "the composition section's K scores: each head's strongest writer (a head click selects that pair)"),
)
"""Every link between sections besides the selection."""
