"""The base class of every pycircuits_widgets view.

A widget is an ``anywidget.AnyWidget`` whose front end is one Svelte file in
``js/src/views/``, chosen by the ``_view`` trait. The base class adds what every view
needs: its model (``self.model``, set before any trait), its runner of recomputes
(``self._runner``, ``wait()``) and the ``busy``/``error`` traits the runner drives; one order of
construction (traits, runner, the view's ``_started()`` hook, its kernel-less answers) so no
subclass has an ordering rule to remember; a narrow browser surface (only the traits a class
lists in ``_browser_writable`` -- selection, text, view controls -- accept browser writes);
rollback of a rejected or failing change to the last good state; strict keyword arguments;
and a self-contained HTML export of finished state (``widgets/sharing/``, loaded when used).
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import anywidget
import traitlets

from ... import progress as bars
from . import offline, runner, save_plan
from .bundle import BundleMissing, bundle_code, bundle_file, carrier_esm, ensure_carrier, stub_esm
from .runner import Runner


@dataclass(frozen=True)
class PageState:
    """A view's part of a saved page (:meth:`CircuitWidget.for_page`): ``unfinished``, what it was still
    computing when the page was written ("" where done), and ``picture()``, the static HTML a reader
    without JavaScript sees in its place."""

    unfinished: str
    picture: Callable[[], str]


SAVE_BUDGET = 60.0
"""Seconds ``save_html`` waits, in all, for views still computing before it saves them as "not computed"."""


def _in_marimo() -> bool:
    """True inside a marimo notebook or app (``mo.ui.anywidget`` hosts the views)."""
    marimo = sys.modules.get("marimo")
    return marimo is not None and marimo.running_in_notebook()


class CircuitWidget(anywidget.AnyWidget):
    """Base of all views. Subclasses set ``_view`` to the name of their Svelte file."""

    _view = traitlets.Unicode("").tag(sync=True)
    """str: name of the Svelte view (file name in js/src/views/ without extension)."""

    error = traitlets.Unicode("").tag(sync=True)
    """str, default "": message shown in the view's error panel; empty when all is well."""
    busy = traitlets.Bool(False).tag(sync=True)
    """bool (read-only): True while the kernel recomputes for the current selection (view shows a spinner)."""
    progress = traitlets.Dict().tag(sync=True)
    """dict (read-only): ``{"text", "done", "total"}`` while the kernel works through a long job the
    view reports on ("precomputing heads 37/144"), shown beside the spinner; {} otherwise."""

    _offline = traitlets.Dict().tag(sync=True)
    """dict (kernel's): precomputed answers for other selections, applied by the front end when
    no kernel is attached (a saved notebook, an exported or ``save_html`` page), and the controls
    that need a kernel; see ``widgets/core/offline.py``. Filled by ``offline_answers``."""

    _browser_writable: frozenset = frozenset()
    """Traits the front end may change (selection, text, view controls); the rest are the kernel's."""
    _offline_inputs: tuple = ()
    """Traits besides the selection whose change makes ``_offline`` stale (it is recomputed)."""
    _answers_offline: str = ""
    """How the view's kernel-less answers (``offline_answers``) are shared: "" (none), "now" (cheap:
    computed in the constructor) or "runner" (in the background on the view's runner, see
    ``_share_offline``). An on-demand view shares them once it starts computing."""
    _offline_budget: int | None = None
    """Most bytes of this view's kernel-less answers (None: ``offline.BUDGET``)."""
    _offline_fresh = True
    _has_front_end = True
    """False for a view made without a built front end (it cannot be shown)."""
    _tier = "click"
    """The tier of the view's jobs (``scheduler`` module docstring): "click", or "asked" for an
    on-demand section's (work the user asked for, which gives way to clicks)."""

    def __init__(self, model=None, **kwargs):
        """``model`` (if given) is ``self.model`` before any trait is set (defaults, validators and
        the selection bounds read it). Then the traits, the view's runner (``self._runner``), the
        view's own setup (``_started()``) and its kernel-less answers (``_answers_offline``) or,
        for an on-demand view, its start once ``active``: subclasses only override hooks."""
        if model is not None:
            self.model = model
        unknown = sorted(set(kwargs) - set(self.trait_names()))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}"
            )
        if _in_marimo():
            # marimo renders each anywidget from its own `_esm` and never creates the hidden
            # carrier, so a stub would wait forever: carry the whole front end instead, packed
            # as the carrier's (a third of its size; the bundle adds its CSS to the shadow root
            # marimo renders the view in).
            self._esm = carrier_esm()
        else:
            try:
                # A stub that renders with the bundle of the kernel's one carrier (its comm
                # opens before this view's): the bundle is sent and saved once, not once per
                # view (no ``_css`` either: the carrier's bundle adds its own CSS).
                self._esm = stub_esm(ensure_carrier().bundle_key)
            except BundleMissing:  # the analysis works without a front end; showing the view says how to build it
                self._has_front_end = False
        super().__init__(**kwargs)
        self._runner = Runner(self, tier=self._tier)
        self._started()
        if self._answers_offline and self._offline_inputs:
            self.observe(self._share_offline, list(self._offline_inputs))
        self._begin()

    def _started(self) -> None:
        """The view's setup once its traits are set (observers, first jobs on ``self._runner``)."""

    def fill_steps(self, selection: dict):
        """Runner steps that compute, into the per-model cache (``analysis.cache``), what this view
        would compute for ``selection`` (every ``SELECTION_KEYS`` value, as a click resolves them),
        so a later click there answers at once. The explorer's background fill runs them for every
        head. Default: nothing to compute."""
        return iter(())

    def _begin(self) -> None:
        """Start sharing kernel-less answers (an on-demand view: once it is ``active``)."""
        if self._answers_offline:
            self._share_offline()

    # -- changes from two threads: a browser message, a cell (runner.APPLY) -----------
    def _handle_msg(self, msg):
        with runner.APPLY:  # maybe on a kernel subshell's thread, while results are applied
            super()._handle_msg(msg)

    def __setattr__(self, name, value):
        if self.has_trait(name):
            with runner.APPLY:  # a cell's change: its stored value and its observers, as one change
                super().__setattr__(name, value)
        else:  # a plain attribute: a worker thread may set one, so it never waits for the lock
            super().__setattr__(name, value)

    @contextlib.contextmanager
    def hold_sync(self):
        with runner.APPLY, super().hold_sync():  # a cell's own block is one change, as our code's are
            yield

    @contextlib.contextmanager
    def hold_trait_notifications(self):
        with runner.APPLY, super().hold_trait_notifications():
            yield

    def set_state(self, sync_data):
        """Apply a state change from the browser. Traits outside ``_browser_writable`` are
        refused; a value that fails validation or whose observers fail is rolled back. Either
        way the view shows the message in ``error`` and is sent back the last good values."""
        refused = sorted(k for k in sync_data if k not in self._browser_writable)
        allowed = {k: v for k, v in sync_data.items() if k in self._browser_writable}
        message = ""
        if refused:
            message = (f"{', '.join(refused)} cannot be set from the browser (set by the kernel); "
                       f"the view may change: {', '.join(sorted(self._browser_writable)) or 'nothing'}")
        if allowed:
            old = {k: getattr(self, k) for k in allowed}
            try:
                super().set_state(allowed)
            except Exception as exc:  # noqa: BLE001 - validation or an observer failed: keep the last good state
                self._roll_back(old)
                message = message or _message(exc)
        if message:
            self.error = message
            self.send_state([k for k in sync_data if k in self.keys])
        elif self.error:
            self.error = ""

    def _roll_back(self, old: dict) -> None:
        """Restore traits to ``old`` (observers rerun, so dependent views follow back)."""
        try:
            with self.hold_trait_notifications():
                for name, value in old.items():
                    setattr(self, name, value)
        except Exception as exc:  # noqa: BLE001 - the old value should always be good; never hide it if not
            self.error = f"could not restore {', '.join(old)}: {_message(exc)}"

    def wait(self, timeout: float | None = 30.0) -> bool:
        """Wait until the view's recomputes are done and applied (True if idle; :meth:`settle`); a wait
        over a second shows a bar (``pycircuits_widgets.progress``)."""
        with bars.progress(f"{type(self).__name__}: computing") as bar:
            return self.settle(timeout, bar.note)

    def settle(self, timeout: float | None, note=None) -> bool:
        """Wait until the work a reader waits for is done and applied (True), or ``timeout`` s (False;
        None: no limit); ``note(what)``, if given, is called meanwhile with what is computing. Default:
        every job of the view's runner."""
        return self._runner.wait(timeout, tick=None if note is None else lambda: note(self._runner.running_kind()))

    def start_background(self) -> bool:
        """Start the view's background work under a kernel (an explorer starts each section's before its
        own precompute); False where it has none (the default) or in a plain script."""
        return False

    def stop_background(self) -> None:
        """Stop the view's background work (what it computed stays). Default: none to stop."""

    def wait_background(self, timeout: float | None = None) -> bool:
        """Wait until every job of the view, background work included, is done and applied (True), or
        ``timeout`` s (False; None: no limit)."""
        return self._runner.wait(timeout)

    def page_items(self, context) -> list:
        """What this view could add to a saved page (``core.save_plan``): a ``PlanItem`` per piece of work, its
        seconds estimated at this model's size (FLOPs over ``context.rate``) and its page bytes; ``context``: a
        ``save_plan.PlanContext`` (section name, rate, the heads the reader chose). Default: nothing."""
        return []

    def answers_item(self, context, what: str, seconds: float) -> save_plan.PlanItem:
        """A weight-only plan item (``save_plan.WEIGHTS``): the view's work and its kernel-less answers
        (within ``_offline_budget``) computed now, ``seconds`` of work; left out, the view saves no answers
        (the page says other selections need a kernel)."""
        def leave() -> None:
            self._offline_budget, self._offline_fresh = 0, False

        return save_plan.PlanItem(context.section, what, seconds,
                                  int(save_plan.PAGE_BYTES_PER_ANSWER_BYTE * self.answers_budget()), save_plan.WEIGHTS,
                                  lambda n: self._offline_ready(), leave=leave)

    def answers_budget(self) -> int:
        """Most bytes of this view's kernel-less answers (``_offline_budget``, else ``offline.BUDGET``)."""
        return offline.BUDGET if self._offline_budget is None else self._offline_budget

    def page_views(self) -> dict:
        """The views a saved page of this one plans for, by section name (``page_items``): itself; an explorer,
        its sections."""
        return {type(self).__name__: self}

    def visited_heads(self) -> list[tuple[int, int]]:
        """Heads a reader looked at here, latest first, whose exact tables a saved page keeps after the ones it
        lists (``save_html(heads=)``): the selected head, for a view with one."""
        return [(self.layer, self.head)] if self.has_trait("layer") and self.has_trait("head") else []

    def answers_reserve(self) -> int:
        """Page bytes a save may still add for this view's kernel-less answers (computed at save, within its
        budget) where no plan item of its own counts them: 0 once they are current."""
        if self._answers_offline != "runner" or self._offline_fresh:
            return 0
        return int(save_plan.PAGE_BYTES_PER_ANSWER_BYTE * self.answers_budget())

    # -- kernel-less answers ------------------------------------------------------------
    def offline_answers(self, answers: offline.Answers) -> None:
        """Add this view's kernel-less answers to ``answers``: one ``answers.rule(on, ...)``
        per result that depends on the selection traits ``on`` (the patch the kernel would
        send for each selection, current first), and ``answers.needs_kernel(name)`` for
        controls that always need a kernel. Default: none. A view that has some sets
        ``_answers_offline``."""

    def _share_offline(self, change=None) -> None:
        """(Re)compute ``_offline``: ``_answers_offline == "runner"``: in the background on the
        view's runner under a kernel (``wait()`` covers it), at the next ``save_html`` in a plain
        script (nothing saves state before); "now" (cheap answers): at once. Reruns when an
        ``_offline_inputs`` trait changes."""
        if self._answers_offline == "now":
            self._offline = offline.fill(self, self._offline_budget)
            self._offline_fresh = True
        else:
            self._offline_fresh = self._runner.submit("offline", lambda: offline.steps(self, self._offline_budget),
                                                      tier="fill")

    def for_page(self, deadline: float | None, offline: bool, note=None) -> PageState:
        """The view's part of a page about to be written: its work waited for up to ``deadline`` (a
        ``time.monotonic()`` value; None: no limit; ``note(what)`` says meanwhile what it computes) and,
        with ``offline``, its ``_offline`` made current. Work not done by then is named in the state
        (the page says that view is "not computed": ``standalone.render_html``)."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self.settle(left, note):
            return PageState(self._runner.running_kind() or "its results", self._fallback_html)
        if offline:
            self._offline_ready()
        return PageState("", self._fallback_html)

    def _offline_ready(self) -> None:
        """Make ``_offline`` current (a script computes it here, before a page is written, counting
        the answers on a bar)."""
        self.settle(None)
        if not self._offline_fresh:
            answers = bars.steps(offline.steps(self, self._offline_budget), f"{type(self).__name__}: kernel-less answers", unit="answer")
            self._offline = offline.last(answers)["_offline"]
            self._offline_fresh = True

    # -- closing ---------------------------------------------------------------------
    def close(self) -> None:
        """Close the view and what it opened: its runner (jobs stop at their next chunk, the
        scheduler drops them: ``self._runner.join()``), its child views (closed the same way) and
        its ``layout`` widget. A view made by another (an explorer's section) is also dropped by
        it (``CircuitExplorer`` observes its ``comm``). Safe to call twice, and from ``__del__``
        of a half-built view."""
        runner_ = self.__dict__.get("_runner")
        if runner_ is not None:
            runner_.close()
        children = self._child_views()
        super().close()
        for view in children:
            view.close()
        layout = self._trait_values.get("layout")  # DOMWidget's own Layout widget, one per view
        if layout is not None:
            layout.close()

    def _child_views(self) -> list[CircuitWidget]:
        """The views this one holds in its synced traits (an explorer's sections), in trait order."""
        return [value for name in self.trait_names(sync=lambda v: v)
                if isinstance(value := self._trait_values.get(name), CircuitWidget)]

    # -- sharing ---------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        """The widget view plus a static ``text/html`` fallback, which renderers without
        JavaScript (a code host's notebook preview) show instead of an empty cell.
        :class:`~.bundle.BundleMissing`, naming the build command, for a view made without
        a built front end."""
        if not self._has_front_end:
            bundle_file("widget.js")  # raises while the front end is still missing
            raise BundleMissing(f"{type(self).__name__} was made before the front end was built: make it again to show it")
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        return {**data, "text/html": self._fallback_html()}, metadata

    def _fallback_html(self) -> str:
        """Static HTML picture of this view drawn from its data (escaped, under
        ``pictures.BUDGET`` bytes); override for a better one."""
        from ..sharing.fallback import fallback_html  # the export stack: loaded when a view is shown

        return fallback_html(self)

    def save_html(self, path, *, title: str | None = None, offline: bool = True,
                  budget: float | None = SAVE_BUDGET, max_bytes: int = save_plan.MAX_BYTES,
                  heads=()) -> pathlib.Path:
        """Write a self-contained HTML file (bundle and data inlined, no CDN, no kernel)
        that shows this view with every interaction that needs no kernel. With ``offline``
        (default) the view's kernel-less answers (``_offline``: each head's skip-trigram table
        and eigenvalues, head pairs' composition detail, within ``widgets.core.offline.BUDGET``
        per view) are made current first: seconds of work for a 2-layer model in a script,
        already done in the background under a kernel.

        ``budget``: seconds the save waits, in all, for views still computing (default
        ``SAVE_BUDGET``; None: no limit), a bar saying which. A view not done by then is saved as
        it stands, marked "not computed" on the page; the explorer's background precompute is
        never waited for.

        The save plans (``core.save_plan``): before any work it estimates what each part of the page costs at
        this model's size and computes, in order of value, what fits ``budget`` and ``max_bytes`` (bytes of
        the page, default ``save_plan.MAX_BYTES``): weight-only views, then the dataset examples of every head,
        then the exact skip-trigram tables of ``heads`` (``[(layer, head), ...]``) and of the heads visited,
        then measured matrices and the head-loss table. The page states its size and budgets and names what it
        left out, each with its cost; the bar's estimate is the plan's."""
        from ..sharing import standalone

        standalone.refuse_notebook_target(path)  # before any work
        save_plan.check_max_bytes(max_bytes)
        if getattr(self, "model", None) is not None:
            save_plan.check_heads(heads, self.model.cfg)
        bundle_code()  # BundleMissing, naming the build command, before any work too
        return standalone.save_html([self], path, title=title or type(self).__name__, offline=offline, budget=budget,
                                    max_bytes=max_bytes, heads=heads)

    def save_figure(self, path, *, section: str | None = None, title: str | None = None, format: str | None = None,
                    scale: float = 3.0, width: int = 1000, budget: float | None = SAVE_BUDGET) -> pathlib.Path:
        """Write what the view shows as a figure for a paper or a slide: ``path`` ending in ``.svg``
        (text stays text) or ``.png`` (``scale`` pixels per CSS pixel: 3, about 300 dpi at the view's
        size, which the file states), or ``format="svg"``/``"png"``. The figure holds the view's title
        (``title``; default its explorer section's title), its selection, axes and legend, and none of
        the page's controls; it is the one the view's "figure" menu downloads (``js/src/lib/figure.js``),
        drawn from the same payload in headless Chromium (``pip install playwright`` and a Chromium:
        the error says which is missing). ``width``: CSS pixels of the page the view is laid out in; the
        figure is as wide as what the view shows, at most this (a narrower page: larger type relative to
        the figure, as a paper's column wants).

        ``section``: of an explorer, the section to draw (``"attention"``, ...: ``explorer.views()``).
        The view is drawn as it stands once its recompute is done (``budget`` seconds, as ``save_html``):
        an on-demand section not computed yet shows so (``explorer.compute(name)`` first)."""
        from ..sharing import figures

        bundle_code()  # BundleMissing, naming the build command, before any work
        return figures.save_figure(self, path, section=section, title=title, format=format, scale=scale,
                                   width=width, budget=budget)


def _message(exc: Exception) -> str:
    return str(exc) if isinstance(exc, traitlets.TraitError) else f"{type(exc).__name__}: {exc}"


MAX_TEXT = 100_000
"""Longest text (characters) a view accepts; the model's context is the real limit."""


def check_text(text: str, *, name: str = "text", empty: bool = False) -> str:
    """``text`` if it is a valid Unicode str (a browser can send a lone surrogate) of at most
    ``MAX_TEXT`` characters, non-empty unless ``empty``; else a ``TraitError`` naming ``name``."""
    if not text and not empty:
        raise traitlets.TraitError(f"{name} must be a non-empty str, got ''")
    if len(text) > MAX_TEXT:
        raise traitlets.TraitError(f"{name} must be at most {MAX_TEXT} characters, got {len(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise traitlets.TraitError(f"{name} must be valid Unicode: {exc.reason} at character {exc.start}") from exc
    return text


def check_range(name: str, value: int, lo: int, hi: int, *, none: bool = False) -> int:
    """``value`` if it is an int (not a bool) and ``lo <= value <= hi`` (or -1 meaning "none"
    when ``none``); else a ``TraitError`` naming the trait, the valid range and the bad value."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise traitlets.TraitError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if lo <= value <= hi or (none and value == -1):
        return value
    allowed = f"-1 (none) or in {lo}..{hi}" if none else f"in {lo}..{hi}"
    raise traitlets.TraitError(f"{name} must be {allowed}, got {value}")


def rolls_back(method):
    """An observer whose failure rolls its trait back to the old value and shows the error in
    the view; the exception still reaches whoever set the trait (Python raises, the browser's
    ``set_state`` reports it)."""

    @functools.wraps(method)
    def wrapper(self, change):
        try:
            return method(self, change)
        except Exception as exc:
            if change is not None:  # None: called directly, not as an observer
                self.error = f"{change['name']}: {_message(exc)}"
                if change.get("type") == "change":
                    self.set_trait(change["name"], change["old"])
            raise

    return wrapper
