"""CircuitExplorer: the circuit views of one model and one text, linked through one selection."""

from __future__ import annotations

import functools
import time
import types

import ipywidgets
import traitlets

from ... import progress as bars
from ...analysis.activations import run
from ...analysis.circuits import model_name as name_of_model
from ...analysis.patching import checked_task
from ...corpus.sweeps import checked_sweep
from ...models.tokenizer import check_tokenizer, reading, text_reading_as
from ..core import offline
from ..core.arrays import Array
from ..core.base import SAVE_BUDGET, CircuitWidget, PageState, check_text, rolls_back
from ..core.meter import Meter
from ..core.save_plan import MAX_BYTES
from ..core.selection import (
    SELECTION_KEYS,
    HeadSelection,
    PairSelection,
    PositionSelection,
    TokenSelection,
    check_model,
    resolve_selection,
)
from ..core.shown_run import ShownRun
from .induction_mechanism import EMBED_TABLES_MAX_VOCAB
from .registry import BY_NAME, EXPLORER, LINKS, ON_DEMAND, VIEWS, ViewSpec

SMALL_HEADS = 64
""":meth:`CircuitExplorer.save_html` computes the on-demand paper views of a model of at most this many heads
(and :data:`EMBED_TABLES_MAX_VOCAB` tokens): seconds of work; every other section's work is the save's plan
(``core.save_plan``)."""
VISITED = 16
"""Most heads the explorer remembers a reader selected (``visited_heads``), latest first."""
FILLING = "precomputing heads"
"""What the explorer's progress says while it precomputes heads (its background fill)."""


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

    Its sections are the views of ``registry.VIEWS`` (each a full widget, also usable on its own:
    ``explorer.trigrams`` is a ``SkipTrigramTable``). A click in any of them moves every view to it:
    in the browser at once (so a saved page with no kernel stays coherent) and in the kernel, which
    recomputes what depends on the selection. ``position`` and ``token`` stay consistent: a position
    selects its token; a token selects its last position in the text (-1 if absent); no token, no
    position. A pair selects its later head; selecting a head in layer >= 1 selects the pair of its
    strongest K-composition writer (``strongest_writers``, once the composition scores are in).

    The model reads each text once (``pcw.run``, :meth:`forward`): the sections show that run, or the
    run a causal check made of it (``run``, a ``core.shown_run.ShownRun``: the causal checks section,
    ``explorer.causal``, ablates the selected head and the loss and attention sections show the
    ablated run). The paper views in ``ON_DEMAND`` are computed on first use (:meth:`compute`).

    Under a kernel, once built, the explorer precomputes in the background what a click on each
    head would compute (each view's ``fill_steps``) into the per-model cache (``analysis.cache``),
    after each section's own background work (the head-loss table), so a later click answers from
    it. It gives way to every click (``widgets/core/scheduler.py``), its header says how far it is
    (``progress``: "precomputing heads 37/144"), and :meth:`stop_background` (or closing the
    explorer) stops it. In a plain script nothing runs in the background.

    A view the model cannot support honestly is not built: ``notices[name]`` says why (no
    composition in a one-layer model; only the loss and the bigram table in a zero-layer model).
    Rotary models: the QK circuits are read over the query - key offsets of the text, each view
    stating how and offering an offset control.

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
        task: a ``pcw.Task`` of this model (prompt pairs, answers, metric), for the task section
            (``explorer.circuit``: its patching heatmaps, ``TaskCircuit``).
        ablation: "off" (default), "zero" or "mean" (needs ``sweep``): the selected head ablated from the
            start (a section's option: ``registry.ViewSpec.options``).
    """

    _view = traitlets.Unicode("CircuitExplorer").tag(sync=True)
    _browser_writable = frozenset({*SELECTION_KEYS, "text"})

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

    # -- selection (layer, head, position, token from the mixins) --
    token_str = traitlets.Unicode("").tag(sync=True)
    """str (read-only): display string of ``token``, "" for none."""

    def __init__(self, model, text, *, sweep=None, task=None, **kwargs):
        try:
            check_model(model, "CircuitExplorer")
            no_heads = ""
        except ValueError as exc:  # a zero-layer model: only the loss view applies
            no_heads = str(exc)
        check_tokenizer(model)
        model, text = reading(model, text)
        self.sweep = checked_sweep(sweep, model, "CircuitExplorer")  # the corpus sections read it (class docstring)
        self.task = checked_task(task, model, "CircuitExplorer")  # the task section reads it
        self._strings = model.token_strings
        self._ran = None  # (text, RunResult): the one forward pass of the current text
        self._links = {}  # section name -> [(observed object, handler, trait names)]: undone if it is closed
        self._visited: dict[tuple[int, int], None] = {}  # heads selected here, oldest first (``visited_heads``)
        selection = {k: kwargs.pop(k) for k in SELECTION_KEYS if k in kwargs}
        options = {(spec, k): kwargs.pop(k) for spec in VIEWS for k in spec.options if k in kwargs}
        super().__init__(model, text=text, model_name=name_of_model(model),
                         sections=[spec.browser() for spec in VIEWS if spec.available(self)],
                         **kwargs)
        with bars.progress("CircuitExplorer", total=len(VIEWS), unit="view") as bar:  # shown past a second
            bar.note("running the model")
            self._show_tokens()
            self.run = ShownRun()
            self.run.read(self.text, self.forward(self.model, self.text))
            self._build_views(no_heads, bar)
        self._link()
        for name, value in selection.items():
            setattr(self, name, value)
        for (spec, name), value in options.items():  # once the selection is (a section acts on it)
            view = getattr(self, spec.name)
            if view is None and value != spec.cls.class_traits()[name].default_value:
                raise ValueError(f"CircuitExplorer: {name}={value!r} is an option of the {spec.noun} section, which "
                                 f"this model has not: {self.notices.get(spec.name, 'no such section')}")
            if view is not None:
                setattr(view, name, value)
        self.start_background()

    # -- building ---------------------------------------------------------------------------
    def _build_views(self, no_heads: str, progress) -> None:
        """Each registry entry's view (``ViewSpec.build``), or a notice saying why there is none."""
        notices = {}
        for spec in VIEWS:
            progress.note(spec.noun)
            progress.update()
            if not spec.available(self):
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

    def _show_tokens(self) -> None:
        """The header's tokens and loss of the current text (positions of an old text are cleared)."""
        out = self.forward(self.model, self.text)
        ids = out.tokens[0].tolist()
        with self.hold_sync():
            self.position = -1
            self.token_ids, self.tokens = ids, list(out.str_tokens[0])
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

    def save_html(self, path, *, title: str | None = None, offline: bool = True, budget: float | None = SAVE_BUDGET,
                  max_bytes: int = MAX_BYTES, heads=()):
        """As ``CircuitWidget.save_html``: the save plans every section's work (weight-only views, every head's
        dataset examples, the exact tables of ``heads`` and of the heads visited here, measured matrices and
        the head-loss table) within ``budget`` seconds and ``max_bytes``, and the page names what it left out
        with its cost. With ``offline``, the on-demand paper views of a small model (at most ``SMALL_HEADS``
        heads and ``EMBED_TABLES_MAX_VOCAB`` tokens: seconds of work) are computed first, so the page shows
        them. A section still computing when ``budget`` is spent is saved "not computed" (the page says so)
        and keeps computing here. The background precompute is never waited for."""
        cfg = self.model.cfg
        if offline and cfg.n_layers * cfg.n_heads <= SMALL_HEADS and cfg.d_vocab <= EMBED_TABLES_MAX_VOCAB:
            self.compute()
        return super().save_html(path, title=title, offline=offline, budget=budget, max_bytes=max_bytes, heads=heads)

    def page_views(self) -> dict[str, CircuitWidget]:
        """The sections a saved page plans for (``CircuitWidget.page_views``): every view, by section name."""
        return self.views()

    def visited_heads(self) -> list[tuple[int, int]]:
        """The heads a reader selected here, latest first (at most ``VISITED``)."""
        return list(reversed(self._visited))

    def for_page(self, deadline, offline, note=None) -> PageState:
        """The explorer's own work is its background precompute, which a page never waits for; its sections
        are saved as views of their own (``standalone.render_html``)."""
        return PageState("", self._fallback_html)

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

    def settle(self, timeout, note=None) -> bool:
        """Wait until every section's work a reader waits for (``CircuitWidget.settle``: its recomputes, the
        ablated run) is done and applied (True if all are idle); not the background precompute
        (:meth:`wait_background`). A result applied in one view can move the selection and start work in
        another, so this repeats until a full pass finds every view idle (``wait()``: with a bar). ``timeout``
        bounds each view's wait."""
        views = self.views()
        while True:
            busy_before = any(v.busy for v in views.values())
            for name, view in views.items():
                if not view.settle(timeout, note and (lambda what, name=name: note(f"{name}: {what}"))):
                    return False
            if not busy_before and not any(v.busy for v in views.values()):
                return True

    # -- background precompute ----------------------------------------------------------------
    def start_background(self) -> bool:
        """Precompute, in the background, every head's results a click would compute (class
        docstring), the selected head first, after each section's own background work (the head-loss
        table); False in a plain script (nothing runs). Restarts a running fill; heads already computed
        answer from the cache at once."""
        for view in self.views().values():
            view.start_background()
        views = [v for v in self.views().values() if type(v).fill_steps is not CircuitWidget.fill_steps]
        heads = offline.heads(self) if views else []
        return bool(heads) and self._runner.submit("fill", lambda: self._fill_steps(views, heads), tier="fill",
                                                   progress=None if self.progress else Meter(FILLING, len(heads)).report(0))

    def stop_background(self) -> None:
        """Stop the background precompute and each section's background work (what they computed stays)."""
        self._runner.cancel("fill")
        for view in self.views().values():
            view.stop_background()
        self.progress = {}

    def wait_background(self, timeout: float | None = None) -> bool:
        """Wait until the background precompute and each section's background work are done (True), or
        ``timeout`` s in all (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for waits in (self._runner.wait, *(v.wait_background for v in self.views().values())):
            if not waits(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True

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
                for source, handler, names in self._links.pop(name, []):
                    source.unobserve(handler, names)
                setattr(self, name, None)
                self.notices = {**self.notices, name: f"The {BY_NAME[name].noun} view was closed."}

    # -- linking: children -> explorer -> children. Values converge, so no feedback loop: a
    # child set to the explorer's value reports an unchanged value and traitlets stays quiet.
    def _link(self) -> None:
        """Each section follows the selection (``ViewSpec.follows``) and the shown run (``reads_run``,
        ``shows_run``), and the declared links between sections (``registry.LINKS``) are made."""
        views = self.views()

        def observe(name, source, handler, names):
            source.observe(handler, names)
            self._links.setdefault(name, []).append((source, handler, names))

        for name, view in views.items():
            spec = BY_NAME[name]
            observe(name, view, self._from_view, list(spec.follows))
            observe(name, view, self._busy_from_views, ["busy"])
            view.observe(self._drop_view, ["comm"])
            if spec.reads_run is not None:  # (built showing the run: the clean one, which it reads now)
                observe(name, self.run, lambda change, view=view, act=spec.reads_run: act(view, change["new"]),
                        ["clean"])
                spec.reads_run(view, self.run.clean)
            if spec.shows_run is not None:
                observe(name, self.run, lambda change, view=view, act=spec.shows_run: act(view, change["new"]),
                        ["shown"])
        for link in LINKS:
            source = self if link.source == EXPLORER else views.get(link.source)
            if source is None:
                continue
            handler = functools.partial(rolls_back(lambda explorer, change, link=link, source=source:
                                                   link.apply(explorer, source)), self)
            observe(link.source, source, handler, list(link.traits))
            link.apply(self, source)
        self.observe(self._to_views, list(SELECTION_KEYS))

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
    def _to_views(self, change):
        name = change["name"]
        if name in ("layer", "head"):
            self._visited.pop((self.layer, self.head), None)
            self._visited[self.layer, self.head] = None
            while len(self._visited) > VISITED:
                del self._visited[next(iter(self._visited))]
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
        text, start = text_reading_as(self.model.tokenizer, self.sweep.windows[window].tolist(), position)
        self.text = text
        self.position = position - start

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
        if not self.views():  # still in __init__
            return
        n_before = len(self.token_ids)
        self._show_tokens()
        for spec in VIEWS:
            view = getattr(self, spec.name)
            if spec.reads_text and view is not None and view.text != self.text:
                view.text = self.text
            if view is not None:
                spec.follow_window(self, view, n_before)
        self.run.read(self.text, self.forward(self.model, self.text))
