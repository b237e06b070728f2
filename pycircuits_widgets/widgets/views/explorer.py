"""CircuitExplorer: the circuit views of one model and one text, linked through one selection."""

from __future__ import annotations

import types

import ipywidgets
import torch
import traitlets

from ...analysis.ablation import ablate
from ...analysis.activations import run
from ...analysis.circuits import model_name as name_of_model
from ...analysis.composition import strongest_writers
from ...corpus.sweeps import checked_sweep
from ..core.arrays import Array
from ... import progress as bars
from ..core import offline
from ..core.meter import Meter
from ..core.base import SAVE_BUDGET, CircuitWidget, check_text, rolls_back
from ...models.tokenizer import IdsText, check_tokenizer, reading_ids
from ..core.selection import (SELECTION_KEYS, HeadSelection, PairSelection, PositionSelection, TokenSelection,
                              check_model, resolve_selection)
from .induction_mechanism import EMBED_TABLES_MAX_VOCAB
from .registry import BY_NAME, LOSS_DISPLAY, ON_DEMAND, VIEWS, ViewSpec

SMALL_HEADS = 64
""":meth:`CircuitExplorer.save_html` computes the on-demand paper views (``registry.ON_DEMAND``), the
measured composition matrices and each head's ablation loss change of a model of at most this many
heads (and :data:`EMBED_TABLES_MAX_VOCAB` tokens): seconds of work (the ablations: at most one forward
each, ``SMALL_HEADS`` forwards in all)."""
FILLING = "precomputing heads"
"""What the explorer's progress says while it precomputes heads (its background fill)."""
NO_SWEEP = "mean ablation needs a sweep: CircuitExplorer(model, text, sweep=...)"
"""Why ``ablation="mean"`` is unavailable to an explorer without one (``ablation_kinds``)."""
ABLATED_NOTE = "0 (white) at the centre, symmetric: red = the ablation raised the loss, blue = lowered it"
"""The loss section's legend note while it shows an ablated run's loss change."""


def _child(spec: ViewSpec):
    trait = traitlets.Instance(spec.cls, allow_none=True).tag(sync=True, **ipywidgets.widget_serialization)
    trait.__doc__ = f"{spec.cls.__name__} | None: {spec.doc}"
    return trait


ExplorerViews = types.new_class("ExplorerViews", (traitlets.HasTraits,),
                                exec_body=lambda ns: ns.update({spec.name: _child(spec) for spec in VIEWS}))
ExplorerViews.__doc__ = """One child-widget trait per :data:`registry.VIEWS` entry, named after it (``explorer.trigrams``),
synced as ``"IPY_MODEL_<id>"``; None where the model does not support the view (``notices`` says why)."""


class CircuitExplorer(ExplorerViews, HeadSelection, PositionSelection, TokenSelection, PairSelection, CircuitWidget):
    """One model reading one text, seen through every circuit view at once, all following
    one selection: a head ``(layer, head)``, a text ``position``, a vocabulary ``token`` and a
    head pair ``selected_pair`` (earlier head -> later head).

    Views (each a full widget, also usable on its own): per-token loss of ``pcw.run(model,
    text)`` (``ColoredTokens``), ``AttentionPatterns``, ``SkipTrigramTable``,
    ``CompositionMatrix``, ``EigenvaluePlot``, and the paper's two-layer story:
    ``PathExpansion``, ``InductionMechanism`` (of the selected pair), ``PositionalQK``,
    ``VirtualHeads`` and the direct path's ``BigramTable``. A click in any of them (a head
    thumbnail, a composition cell, a path term, a virtual head, a token) moves every view to
    it: in the browser at once (so a saved page with no kernel stays coherent) and in the
    kernel, which recomputes what depends on the selection (skip-trigrams of the head, its
    eigenvalues, a token's query...). ``position`` and ``token`` stay consistent: a position
    selects its token; a token selects its last position in the text (-1 if absent); no
    token, no position. A pair selects its later head; selecting a head in layer >= 1 selects
    the pair of its strongest K-composition writer (from the composition view's K scores,
    once they are computed) and that head.

    The model reads each text once (``pcw.run``); the loss, attention, path and positional
    views share that pass. The paper views in ``ON_DEMAND`` are built inactive and computed
    on first use (their section's "compute" button, or :meth:`compute`), on their own runner.

    Under a kernel, once built, the explorer precomputes in the background what a click on each
    head would compute (each view's ``fill_steps``: the head's exact skip-trigram table, its
    eigenvalue detail, the composition detail of the pair the click selects) into the per-model
    cache (``analysis.cache``), so a later click answers from it. It gives way to every click
    (``widgets/core/runner.py``), its header says how far it is (``progress``: "precomputing
    heads 37/144"), and :meth:`stop_background` (or closing the explorer) stops it. In a plain
    script nothing runs in the background.

    Causal checks (``ablation``): "zero" or "mean" ablates the selected head (``pcw.ablate``, resumed
    from the clean run at the head's layer: at most one forward per head or kind chosen) and the
    loss section shows each token's loss change (ablated - clean) on a diverging scale, the attention
    section the ablated run's patterns, both headed ``ablated`` ("ablated: L1.H6 (zero)"); "off"
    shows the clean run again from what was kept (the same arrays, nothing recomputed). The
    composition section can show, beside the weights' scores, the composition measured on this text
    (``pcw.measured_composition``; its "measured on this text" switch). ``head_loss_change`` holds
    each head's zero-ablation loss change on the text (computed in the background before the
    precompute of every head, or by :meth:`compute_head_loss_change`; :meth:`save_html` computes it for a small model).

    A view the model cannot support honestly is not built: ``notices[name]`` says why
    (no composition, induction or virtual heads in a one-layer model; only the bigram table in
    a zero-layer model). Rotary models: the QK circuits (skip-trigrams, QK eigenvalues,
    Q/K-composition, the induction mechanism) are read over the query - key offsets of the text
    (0 to its length - 1; skip-trigrams of a vocabulary over ``SkipTrigramTable.partial_above``
    tokens: the first ``registry.LARGE_VOCAB_TRIGRAM_OFFSETS``), each view stating how and offering an
    offset control.

    Args:
        model: a weight view (``pcw.load_pretrained("attn-only-2l")``, ``pcw.from_hf(...)``).
        text: the text the model reads (editable in the attention view), or token ids (a list,
            tensor or numpy array, ``[pos]`` or ``[1, pos]``), which a model without a tokenizer
            needs: the views then show each id as its token (``<id N>`` without a tokenizer) and
            the editable text is the ids separated by spaces. A tokenizer whose vocabulary does
            not fit the model's is refused (``check_tokenizer``).
        layer, head, position, token, selected_pair: the initial selection.
        sweep: a ``pcw.Sweep`` of this same model over a corpus (``pcw.sweep``), for the sections that
            read a corpus (``explorer.sweep``) and mean ablation (each head's mean output, ``head_means``);
            a sweep of another model is refused, naming both.
        ablation: "off" (default), "zero" or "mean" (needs ``sweep``): the selected head ablated from the start.
    """

    _view = traitlets.Unicode("CircuitExplorer").tag(sync=True)
    _browser_writable = frozenset({*SELECTION_KEYS, "text", "ablation"})

    # -- views: the child traits, one per registry entry (ExplorerViews) --
    sections = traitlets.List(traitlets.Dict()).tag(sync=True)
    """[{"name", "title", "hint", "follows", "wide", "picture"}] (read-only): the sections in order
    (``registry.ViewSpec.browser``); the browser lays them out and links them by ``follows``."""
    strongest_writers = Array("int32", ndim=3).tag(sync=True)
    """int32 [n_layers, n_heads, 2] (read-only): the strongest K-composition writer ``(l1, h1)``
    into each head, ``(-1, -1)`` for none (``analysis.composition.strongest_writers`` of the composition
    view's K scores; None until they are computed). A head click in layer >= 1 selects that pair, here
    and in the browser (which reads this table, so a page without a kernel links the same)."""
    notices = traitlets.Dict().tag(sync=True)
    """{view name: str} (read-only): why a view is not shown for this model."""

    # -- data --
    text = traitlets.Unicode("").tag(sync=True)
    """str: the text the model reads; setting it re-runs the model once for every text view
    (a text the model cannot read is refused: Python raises, the view shows the error)."""
    model_name = traitlets.Unicode("").tag(sync=True)
    """str (read-only): the model's name, for the header."""
    mean_loss = traitlets.Float(None, allow_none=True).tag(sync=True)
    """float | None (read-only): mean next-token loss on ``text`` (None for one token)."""
    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    """list[str] (read-only): display string of each text position."""
    token_ids = traitlets.List(traitlets.Int()).tag(sync=True)
    """list[int] (read-only): vocabulary id of each text position (the browser links position and token with it)."""

    # -- causal checks --
    ablation = traitlets.Enum(["off", "zero", "mean"], default_value="off").tag(sync=True)
    """str, default "off": ablate the selected head, its output removed ("zero") or replaced by its
    mean output over a corpus ("mean": needs a sweep, ``ablation_kinds``); class docstring."""
    ablated = traitlets.Unicode("").tag(sync=True)
    """str (read-only): "ablated: L1.H6 (zero)" while the loss and attention sections show an ablated
    run, else ""."""
    ablation_kinds = traitlets.Dict().tag(sync=True)
    """{kind: "" where available, else why not} (read-only), for "zero" and "mean"."""
    head_loss_change = Array("float32", ndim=2).tag(sync=True)
    """float32 [n_layers, n_heads] (read-only): the mean per-token loss change (nats) from zero-ablating
    each head alone on ``text``; None until computed (kept by a saved page)."""
    _shown_run = traitlets.Any(None)
    # (text, label, AblationResult) shown by the loss and attention sections, or None: the clean run

    # -- selection (layer, head, position, token from the mixins) --
    token_str = traitlets.Unicode("").tag(sync=True)
    """str (read-only): display string of ``token``, "" for none."""

    def __init__(self, model, text, *, sweep=None, **kwargs):
        try:
            check_model(model, "CircuitExplorer")
            no_heads = ""
        except ValueError as exc:  # a zero-layer model: only the loss view applies
            no_heads = str(exc)
        check_tokenizer(model)
        if isinstance(text, str):
            if not text:
                raise TypeError("CircuitExplorer(model, text): text must be a non-empty str or token ids, got ''")
            if getattr(model, "tokenizer", None) is None:
                raise ValueError("CircuitExplorer: this model has no tokenizer, and reading text needs a tokenizer "
                                 "(pcw.from_hf(hf_model, tokenizer)); or pass token ids (a list, tensor or numpy array)")
        else:
            model, text = reading_ids(model, text)
        self.sweep = checked_sweep(sweep, model, "CircuitExplorer")  # the corpus sections read it (class docstring)
        self._strings = model.token_strings
        self._ran = None  # (text, RunResult): the one forward pass of the current text
        selection = {k: kwargs.pop(k) for k in SELECTION_KEYS if k in kwargs}
        ablation = kwargs.pop("ablation", "off")  # set once the views show the run
        super().__init__(model, text=text, model_name=name_of_model(model),
                         sections=[spec.browser() for spec in VIEWS if self.sweep is not None or not spec.needs_sweep],
                         **kwargs)
        with bars.progress("CircuitExplorer", total=len(VIEWS), unit="view") as bar:  # shown past a second
            bar.note("running the model")
            self._show_run()
            self._build_views(no_heads, bar)
        self.ablation_kinds = {"zero": no_heads, "mean": no_heads or ("" if self.sweep is not None else NO_SWEEP)}
        self._link()
        self._measure_composition()
        for name, value in selection.items():
            setattr(self, name, value)
        self.ablation = ablation
        self.start_background()

    # -- building ---------------------------------------------------------------------------
    def _build_views(self, no_heads: str, progress) -> None:
        """Each registry entry's view (``ViewSpec.build``), or a notice saying why there is none."""
        notices = {}
        for spec in VIEWS:
            progress.note(spec.noun)
            progress.update()
            if spec.needs_sweep and self.sweep is None:
                continue
            if no_heads and spec.needs_heads:
                notices[spec.name] = f"No {spec.noun}: {no_heads}."
                continue
            try:
                setattr(self, spec.name, spec.build(self))
            except ValueError as exc:  # the analysis refuses this model: say why, show no numbers
                if not spec.optional:
                    raise
                notices[spec.name] = f"No {spec.noun} for this model: {exc}"
        self.notices = notices

    def forward(self, model, text: str):
        """``pcw.run(model, text)``, once per text: the ``forward`` the text views built here share
        (``registry.VIEWS``), so the model reads each text once."""
        ran = self._ran  # read once: the paper views' runners call this from their threads
        if ran is None or ran[0] != text:
            ran = self._ran = (text, run(model, text))
        return ran[1]

    def _show_run(self) -> None:
        """Tokens and the loss view of the current text (positions of an old text are cleared)."""
        out = self.forward(self.model, self.text)
        ids = out.tokens[0].tolist()
        with self.hold_sync():
            self.position = -1
            self.token_ids, self.tokens = ids, list(out.str_tokens[0])
            if self.loss is not None:  # (built with the other views the first time)
                self.loss.set_values(self.tokens[1:], out.token_loss[0])
            self.mean_loss = float(out.loss) if len(ids) > 1 else None

    def views(self) -> dict[str, CircuitWidget]:
        """The views this model supports, by name (``loss``, ``attention``, ...), in section order."""
        return {spec.name: getattr(self, spec.name) for spec in VIEWS if getattr(self, spec.name) is not None}

    def compute(self, *names: str) -> None:
        """Start the on-demand paper views named (default: all of ``ON_DEMAND`` this model has);
        ``wait()`` blocks until they are done."""
        unknown = sorted(set(names) - set(ON_DEMAND))
        if unknown:
            raise ValueError(f"compute() takes names from {', '.join(ON_DEMAND)}; got {', '.join(unknown)}")
        for name in names or ON_DEMAND:
            view = getattr(self, name)
            if view is not None:
                view.active = True

    def save_html(self, path, *, title: str | None = None, offline: bool = True, budget: float | None = SAVE_BUDGET):
        """As ``CircuitWidget.save_html``; with ``offline``, a small model's paper views, measured
        composition matrices and ``head_loss_change`` (at most ``SMALL_HEADS`` heads and
        ``EMBED_TABLES_MAX_VOCAB`` tokens: seconds of work) are computed first, so the page shows
        them. A larger model's page shows the ones computed so far and says which were not. ``budget`` (seconds, default ``SAVE_BUDGET``)
        bounds the wait for sections still computing: one not done by then is saved "not
        computed" (the page says so) and keeps computing here. The background precompute is
        never waited for."""
        cfg = self.model.cfg
        if offline and cfg.n_layers * cfg.n_heads <= SMALL_HEADS and cfg.d_vocab <= EMBED_TABLES_MAX_VOCAB:
            self.compute()
            if self.composition is not None:
                self.composition.compute_measured()
            if self.n_layers > 0 and len(self.token_ids) > 1:
                self.compute_head_loss_change()
        return super().save_html(path, title=title, offline=offline, budget=budget)

    def _saved_ready(self, deadline, offline, tick=None) -> bool:
        """The explorer's own runner does the background precompute and each head's ablation loss
        change, which a page never waits for, and the ablate toggle's run, saved as it stands (its
        sections are saved as views of their own: ``standalone.render_html``)."""
        return True

    def cancel(self, *names: str) -> list[str]:
        """Cancel the on-demand sections named (default: every one computing), between two pieces
        of their work (``OnDemand.cancel``: what they computed stays, each says "cancelled" and
        offers "restart"); the names cancelled. The background precompute: ``stop_background``."""
        unknown = sorted(set(names) - set(ON_DEMAND))
        if unknown:
            raise ValueError(f"cancel() takes names from {', '.join(ON_DEMAND)}; got {', '.join(unknown)}")
        cancelled = []
        for name in names or ON_DEMAND:
            view = getattr(self, name)
            if view is not None and view.active and (view.busy or names):
                view.cancel()
                cancelled.append(name)
        return cancelled

    def wait(self, timeout: float | None = 30.0) -> bool:
        """Wait until every view's kernel-side recomputes and the ablate toggle's run are done and
        applied (True if all are idle); not the background precompute (:meth:`wait_background`). A result applied in one
        view can move the selection and start work in another, so this repeats until a full pass
        finds every view idle. A wait over a second shows a bar of the views done."""
        views = self.views()
        with bars.progress("CircuitExplorer: computing", total=len(views), unit="view") as bar:
            while True:
                busy_before = [v for v in views.values() if v.busy]
                bar.n = 0
                for name, view in views.items():
                    bar.note(name)

                    def tick(name=name, runner=view._runner):  # what this view's runner is computing
                        bar.note(f"{name}: {runner.running_kind()}")

                    if not view._runner.wait(timeout, tick=tick):
                        return False
                    bar.update()
                # the ablate toggle's run (the explorer's own request; not its background work)
                if not self._runner.wait(timeout, fill=False):
                    return False
                if not busy_before and not any(v.busy for v in views.values()):
                    return True

    # -- background precompute ----------------------------------------------------------------
    def start_background(self) -> bool:
        """Precompute, in the background, every head's results a click would compute (class
        docstring), the selected head first; False in a plain script (nothing runs). Restarts a
        running fill; heads already computed answer from the cache at once."""
        self._start_head_losses()  # first: one table, at a forward a head
        views = [v for v in self.views().values() if type(v).fill_steps is not CircuitWidget.fill_steps]
        heads = offline.heads(self) if views else []
        return bool(heads) and self._runner.submit("fill", lambda: self._fill_steps(views, heads), tier="fill",
                                                   progress=None if self.progress else Meter(FILLING, len(heads)).report(0))

    def stop_background(self) -> None:
        """Stop the background precompute (what it computed stays cached)."""
        self._runner.cancel("fill")
        self._runner.cancel("head losses")
        self.progress = {}

    def wait_background(self, timeout: float | None = None) -> bool:
        """Wait until the background precompute is done (True), or ``timeout`` s (False)."""
        return self._runner.wait(timeout)

    def _fill_steps(self, views, heads):
        """Each head's ``fill_steps`` of each view, for the selection a click on it resolves to."""
        current = {k: getattr(self, k) for k in SELECTION_KEYS}
        meter = Meter(FILLING, len(heads))  # (heads cost alike: the same views' work)
        for done, (layer, head) in enumerate(heads):
            yield meter.first() if done == 0 else meter.at(done)
            selection = resolve_selection(current, {"layer": layer, "head": head}, self.token_ids,
                                          self.strongest_writer)
            for view in views:
                if view.comm is None:  # closed since the fill began
                    continue
                for _ in view.fill_steps(selection):
                    yield None
        yield {"progress": {}}

    def close(self) -> None:
        """Close the explorer, its background precompute and every section's view
        (``CircuitWidget.close``)."""
        if hasattr(self, "_runner"):  # (also called by __del__, maybe of a failed construction)
            self.stop_background()
        super().close()

    def _drop_view(self, change) -> None:
        """A section's view was closed on its own (``explorer.trigrams.close()``): the explorer lets
        go of it (no link, no fill, no reference) and the section says so."""
        if change["new"] is not None:
            return
        for name, view in self.views().items():
            if view is change["owner"]:
                view.unobserve(self._from_view, list(BY_NAME[name].follows))
                view.unobserve(self._busy_from_views, ["busy"])
                view.unobserve(self._drop_view, ["comm"])
                if name == "attention":
                    view.unobserve(self._text_from_view, ["text"])
                if name == "composition":
                    view.unobserve(self._on_k_scores, ["scores"])
                if name == "examples":
                    view.unobserve(self._open_from_view, ["opened"])
                setattr(self, name, None)
                self.notices = {**self.notices, name: f"The {BY_NAME[name].noun} view was closed."}

    # -- linking: children -> explorer -> children. Values converge, so no feedback loop: a
    # child set to the explorer's value reports an unchanged value and traitlets stays quiet.
    def _link(self) -> None:
        for name, view in self.views().items():
            view.observe(self._from_view, list(BY_NAME[name].follows))
            view.observe(self._busy_from_views, ["busy"])
            view.observe(self._drop_view, ["comm"])
        if self.attention is not None:
            self.attention.observe(self._text_from_view, ["text"])
        if self.composition is not None:
            self.composition.observe(self._on_k_scores, ["scores"])
            self._on_k_scores(None)
        if self.examples is not None:
            self.examples.observe(self._open_from_view, ["opened"])
            if self.neurons is not None:
                self.neurons.observe(self._examples_of_neuron, ["neuron"])
        self.observe(self._to_views, list(SELECTION_KEYS))
        self.observe(self._examples_of_head, ["layer", "head"])

    @rolls_back
    def _from_view(self, change):
        view, name = change["owner"], change["name"]
        if name in ("layer", "head", "selected_pair"):
            with self.hold_trait_notifications():  # never (new layer, old head), nor (new head, old pair)
                self.layer, self.head = view.layer, view.head
                pair = list(getattr(view, "selected_pair", []))
                if pair and pair[2:] == [view.layer, view.head]:  # the view's pair came with its head
                    self.selected_pair = pair
        else:
            setattr(self, name, change["new"])

    def _busy_from_views(self, change):
        self.busy = any(v.busy for v in self.views().values())

    @rolls_back
    def _text_from_view(self, change):
        self.text = change["new"]

    @rolls_back
    def _to_views(self, change):
        name = change["name"]
        if name == "token":
            self.token_str = self._strings[self.token] if self.token >= 0 else ""
        current = {k: getattr(self, k) for k in SELECTION_KEYS}
        resolved = resolve_selection(current, {name: change["new"]}, self.token_ids, self.strongest_writer)
        for key in SELECTION_KEYS:  # each set runs this again, which then finds nothing to change
            if resolved[key] != getattr(self, key):
                setattr(self, key, resolved[key])
        for view_name, view in self.views().items():
            keys = [k for k in BY_NAME[view_name].follows if getattr(view, k) != getattr(self, k)]
            if keys:
                # both set before its observers run, and sent as one message with the busy flag
                # those raise: the page never shows (new layer, old head)
                with view.hold_sync(), view.hold_trait_notifications():
                    for k in keys:
                        setattr(view, k, getattr(self, k))

    def _examples_of_neuron(self, change) -> None:
        """A neuron clicked in the neurons section: the examples section shows its examples."""
        if self.examples is not None and change["new"] >= 0:
            with self.examples.hold_trait_notifications():
                self.examples.layer, self.examples.neuron = self.neurons.layer, change["new"]

    def _examples_of_head(self, change) -> None:
        """A head selected anywhere: the examples section shows the head's examples again."""
        if self.examples is not None:
            self.examples.neuron = -1

    @rolls_back
    def _open_from_view(self, change) -> None:
        if change["new"]:
            self.open_example(*change["new"])

    def open_example(self, window: int, position: int) -> None:
        """Read window ``window`` of ``explorer.sweep`` here (every view recomputes on it) and select
        ``position`` in it: the window's exact tokens, as the sweep read them (the text is their decoding
        from the first token whose decoding re-reads as exactly the tokens from there: a window that
        starts inside a word or a character starts a token or two later)."""
        if self.sweep is None:
            raise ValueError("open_example: the explorer has no corpus sweep (CircuitExplorer(model, text, sweep=...))")
        for name, value, n in (("window", window, self.sweep.n_windows), ("position", position, self.sweep.seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
                raise ValueError(f"open_example: {name} must be an int in 0..{n - 1}, got {value!r}")
        text, start = self._text_of(self.sweep.windows[window].tolist(), position)
        self.text = text
        self.position = position - start

    def _text_of(self, ids: list[int], keep: int) -> tuple[str, int]:
        """``(text, start)``: a text this explorer reads as exactly ``ids[start:]``, the smallest ``start``
        (at most ``keep``, a position that must stay in the text)."""
        tokenizer = self.model.tokenizer
        if isinstance(tokenizer, IdsText):
            return " ".join(map(str, ids)), 0
        for start in range(keep + 1):
            text = tokenizer.decode(ids[start:])
            if list(tokenizer.encode(text)) == ids[start:]:
                return text, start
        raise ValueError(f"this window's tokens do not read back exactly from any text that keeps position {keep} "
                         "(its decoding tokenizes differently)")

    def _on_k_scores(self, change) -> None:
        """The strongest-writer table, again whenever the composition view's K scores change."""
        scores = self.composition.scores.get("K", {}).get("correct")
        writers = None if scores is None else strongest_writers(scores)
        if writers is not None or self.strongest_writers is not None:
            self.strongest_writers = writers

    def strongest_writer(self, layer: int, head: int) -> tuple[int, int] | None:
        """The earlier head ``(l1, h1)`` with the largest K-composition score into ``(layer, head)``
        (``strongest_writers``; None before the composition view's K scores are computed, without
        one, or where no score is defined)."""
        writers = self.strongest_writers
        if writers is None or not 1 <= layer < writers.shape[0]:
            return None
        l1, h1 = (int(x) for x in writers[layer, head])
        return None if l1 < 0 else (l1, h1)

    def _n_positions(self) -> int:
        return len(self.token_ids)

    # -- text -----------------------------------------------------------------------------
    @traitlets.validate("text")
    def _valid_text(self, proposal):
        """The model reads the text here, so a text it cannot read is refused before it is set."""
        text = check_text(proposal["value"])
        try:
            self.forward(self.model, text)
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(f"text: {exc}") from exc
        return text

    @traitlets.observe("text")
    @rolls_back
    def _on_text(self, change):
        if self.loss is None:  # still in __init__
            return
        n_before = len(self.token_ids)
        self._show_run()
        self._shown_run = None  # the new text's clean run, until its ablation is in
        for spec in VIEWS:
            view = getattr(self, spec.name)
            if spec.reads_text and view is not None and view.text != self.text:
                view.text = self.text
            if spec.window is not None and view is not None:
                self._follow_window(spec, view, n_before)
        self.head_loss_change = None
        self._measure_composition()
        self._start_ablation()
        self._start_head_losses()

    def _follow_window(self, spec: ViewSpec, view, n_before: int) -> None:
        """A rotary view still on its default window (the old text's offsets) moves to the new
        text's; a window the reader chose stays."""
        before, now = spec.window(self, n_before), spec.window(self)
        if before and list(view.offsets) == list(before["offsets"]) != list(now["offsets"]):
            view.offsets = list(now["offsets"])

    # -- causal checks ------------------------------------------------------------------------
    @traitlets.validate("ablation")
    def _valid_ablation(self, proposal):
        kind = proposal["value"]
        why = self.ablation_kinds.get(kind, "")
        if kind != "off" and why:
            raise traitlets.TraitError(f"ablation={kind!r}: {why}")
        if kind != "off" and len(self.token_ids) < 2:
            raise traitlets.TraitError(f"ablation={kind!r}: the loss change needs at least 2 tokens; the text has 1")
        return kind

    @traitlets.observe("ablation", "layer", "head")
    @rolls_back
    def _on_ablation(self, change):
        if self.loss is not None:  # (not while __init__ builds the views)
            self._start_ablation()

    def _start_ablation(self) -> None:
        """The selected head's ablated run, on the explorer's runner (a script: at once); "off": the
        clean run at once (kept, never recomputed)."""
        self._runner.cancel("ablate")
        if self.ablation == "off":
            self._shown_run = None
            return
        text, head, kind = self.text, (self.layer, self.head), self.ablation
        self._runner.submit("ablate", lambda: self._ablation_steps(text, head, kind))

    def _ablation_steps(self, text, head, kind):
        """``pcw.ablate`` of ``head`` on the text's clean run (resumed at the head's layer)."""
        clean = self.forward(self.model, text)
        result = ablate(self.model, clean.tokens, heads=[head], kind=kind, means=self.sweep if kind == "mean" else None,
                        clean=clean)
        yield {"_shown_run": (text, f"ablated: L{head[0]}.H{head[1]} ({kind})", result)}

    @traitlets.observe("_shown_run")
    def _show_ablation(self, change):
        """The loss and attention sections (and the induction section's header) show ``_shown_run``:
        the ablated run of the current text, or the clean one."""
        shown = change["new"]
        if shown is not None and shown[0] != self.text:  # (of a text replaced meanwhile)
            return
        clean = self.forward(self.model, self.text)
        label = "" if shown is None else shown[1]
        with self.hold_sync():
            if shown is None:
                self.loss.show_values(clean.token_loss[0], **LOSS_DISPLAY)
                if self.attention is not None:
                    self.attention.show_run(None)
            else:
                result = shown[2]
                change = (result.loss - result.clean_loss)[0]
                m = float(change.abs().max())
                self.loss.show_values(change, label="loss change, ablated − clean (nats)", colormap="diverging",
                                      vmin=-m, vmax=m, note=ABLATED_NOTE)
                if self.attention is not None:
                    self.attention.show_run(result.cache.patterns[0], label)
            if self.induction is not None:
                self.induction.run_label = label
            self.ablated = label

    def compute_head_loss_change(self) -> None:
        """``head_loss_change`` of the current text, synchronously (every head's zero ablation: at most
        one forward each)."""
        self._runner.cancel("head losses")
        for update in self._head_loss_steps(self.text):
            for name, value in (update or {}).items():
                setattr(self, name, value)

    def _start_head_losses(self) -> None:
        """``head_loss_change`` in the background (queued before the precompute: one table at a forward a
        head; a script: never, see ``compute_head_loss_change``). Its count shows at once unless the
        explorer already reports other work."""
        if self.n_layers > 0 and len(self.token_ids) > 1:
            text = self.text
            self._runner.submit("head losses", lambda: self._head_loss_steps(text), tier="fill",
                                progress=None if self.progress else self._ablating().report(0))

    def _ablating(self) -> Meter:
        """The meter of the head-loss table: one head's ablation a piece."""
        return Meter("ablating heads", self.model.cfg.n_layers * self.model.cfg.n_heads, "heads")

    def _head_loss_steps(self, text):
        """Each head's zero-ablation mean loss change on ``text``, one head per chunk, counted in
        ``progress``."""
        meter = self._ablating()
        clean = self.forward(self.model, text)
        L, H = self.model.cfg.n_layers, self.model.cfg.n_heads
        table = torch.full((L, H), float("nan"))
        for i in range(L * H):
            yield meter.first() if i == 0 else meter.at(i)
            table[divmod(i, H)] = ablate(self.model, clean.tokens, heads=[divmod(i, H)], clean=clean).loss_change
        if text == self.text:
            yield {"head_loss_change": table, "progress": {}}

    def _measure_composition(self) -> None:
        """The composition section measures composition on this text (once switched to it)."""
        if self.composition is not None:
            n = len(self.token_ids)
            self.composition.measure_on(self.forward(self.model, self.text),
                                        f"measured on this text ({n} tokens): h1's output removed from h2's input")
