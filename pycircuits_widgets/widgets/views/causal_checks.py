"""CausalChecks: ablate the selected head on a text, and each head's ablation loss change."""

from __future__ import annotations

import traitlets

from ...analysis import activations
from ...analysis.ablation import ablate, head_loss_changes_steps
from ...corpus.sweeps import checked_sweep
from ..core.arrays import Array
from ..core.base import CircuitWidget, rolls_back
from ..core.meter import Meter, metered
from ..core.save_plan import MEASURED, PAGE_BYTES_PER_ANSWER_BYTE, PlanItem, forward_flops
from ..core.selection import HeadSelection, check_model, head_label
from ..core.shown_run import RunWriter, ShownRun

NO_SWEEP = "mean ablation needs a sweep: CircuitExplorer(model, text, sweep=...)"
"""Why ``ablation="mean"`` is unavailable without a sweep (``ablation_kinds``)."""
ABLATING = ("ablating heads", "heads")
"""How ``progress`` names the head-loss table's pieces (one head's ablation each)."""


class CausalChecks(RunWriter, HeadSelection, CircuitWidget):
    """Causal checks of one text's run: ablate the selected head, and each head's ablation loss change.

    ``ablation`` "zero" or "mean" ablates the selected head (``pcw.ablate``, resumed from the clean run at
    the head's layer: at most one forward per head or kind chosen) and writes the ablated run to ``run``,
    the :class:`ShownRun` an explorer's sections show ("ablated: L1.H6 (zero)", ``ablated``); "off" shows
    the clean run again from what was kept (nothing recomputed). Another head or a new text while it is on
    ablates that. ``head_loss_change`` holds each head's zero-ablation loss change on the text
    (``pcw.head_loss_changes``): computed in the background under a kernel, queued before an explorer's
    precompute of every head (``start_background``), or by :meth:`compute_head_loss_change`.

    Args:
        model: a weight view with attention heads.
        run: the :class:`ShownRun` to write (an explorer's), or the text (a str or token ids) to read.
        sweep: a ``pcw.Sweep`` of this model, for ``ablation="mean"`` (each head's mean output).
        layer, head: the selected head. ablation: "off" (default), "zero" or "mean".
    """

    _view = traitlets.Unicode("CausalChecks").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "ablation"})

    ablation = traitlets.Enum(["off", "zero", "mean"], default_value="off").tag(sync=True)
    """str, default "off": ablate the selected head, its output removed ("zero") or replaced by its mean
    output over a corpus ("mean": needs a sweep, ``ablation_kinds``)."""
    ablated = traitlets.Unicode("").tag(sync=True)
    """str (read-only): the ablated run ``run`` shows ("ablated: L1.H6 (zero)"), "" while it shows another."""
    ablation_kinds = traitlets.Dict().tag(sync=True)
    """{kind: "" where available, else why not} (read-only), for "zero" and "mean"."""
    head_loss_change = Array("float32", ndim=2).tag(sync=True)
    """float32 [n_layers, n_heads] (read-only): the mean per-token loss change (nats) from zero-ablating
    each head alone on the text; None until computed (kept by a saved page)."""

    def __init__(self, model, run, *, sweep=None, **kwargs):
        check_model(model, "CausalChecks")
        self._owns_run = not isinstance(run, ShownRun)
        if self._owns_run:
            text, run = run, ShownRun()
            run.read(text, activations.run(model, text))
        self.run = run
        self._sweep = checked_sweep(sweep, model, "CausalChecks")
        ablation = kwargs.pop("ablation", "off")  # checked once the run is known
        super().__init__(model, ablation_kinds={"zero": "", "mean": "" if self._sweep is not None else NO_SWEEP},
                         **kwargs)
        self.ablation = ablation

    _answers_offline = "now"

    def offline_answers(self, answers) -> None:
        """Kernel-less: the toggle needs the model (a page keeps the head-loss table as computed)."""
        answers.needs_kernel("ablation")

    def _started(self) -> None:
        self.observe(self._on_ablation, ["ablation", "layer", "head"])
        self._follow_run()
        if self._owns_run:  # (an explorer starts it with the rest of its background work: start_background)
            self._start_head_losses()

    # -- the ablate toggle ----------------------------------------------------------------------
    @traitlets.validate("ablation")
    def _valid_ablation(self, proposal):
        kind = proposal["value"]
        if kind != "off" and self.ablation_kinds.get(kind):
            raise traitlets.TraitError(f"ablation={kind!r}: {self.ablation_kinds[kind]}")
        if kind != "off" and self.run.clean.tokens.shape[1] < 2:
            raise traitlets.TraitError(f"ablation={kind!r}: the loss change needs at least 2 tokens; the text has 1")
        return kind

    @rolls_back
    def _on_ablation(self, change):
        self._start_ablation()

    def _start_ablation(self) -> None:
        """The selected head's ablated run, on the view's runner (a script: at once); "off": the clean run
        at once (kept, never recomputed)."""
        self._runner.cancel("ablate")
        text = self.run.shown.text
        if self.ablation == "off":
            self.run.withdraw(text, self)
            return
        head, kind = (self.layer, self.head), self.ablation
        self._runner.submit("ablate", lambda: self._ablation_steps(text, head, kind))

    def _ablation_steps(self, text, head, kind):
        clean = self.run.clean
        result = ablate(self.model, clean.tokens, heads=[head], kind=kind,
                        means=self._sweep if kind == "mean" else None, clean=clean)
        yield {"_written_run": (text, f"ablated: {head_label(*head)} ({kind})", result)}

    def taken(self) -> None:
        self.ablation = "off"

    def _on_shown(self, change) -> None:
        shown = change["new"]
        self.ablated = shown.label if shown.by is self else ""
        super()._on_shown(change)

    # -- a new text ------------------------------------------------------------------------------
    def _on_text(self, change) -> None:
        self.head_loss_change = None
        self._start_ablation()
        self._start_head_losses()

    # -- each head's loss change --------------------------------------------------------------
    def start_background(self) -> bool:
        """``head_loss_change`` in the background (a script: never, see ``compute_head_loss_change``);
        restarts a running one."""
        return self._start_head_losses()

    def stop_background(self) -> None:
        """Stop computing ``head_loss_change`` in the background."""
        self._runner.cancel("head losses")

    def _start_head_losses(self) -> bool:
        self._runner.cancel("head losses")
        clean = self.run.clean
        if clean.tokens.shape[1] < 2:
            return False
        L, H = self.model.cfg.n_layers, self.model.cfg.n_heads
        return self._runner.submit("head losses", lambda: self._head_loss_steps(clean), tier="fill",
                                   progress=Meter(ABLATING[0], L * H, ABLATING[1]).report(0))

    def _head_loss_steps(self, clean):
        """``pcw.head_loss_changes`` on the text's clean run, one head a piece, counted in ``progress``."""
        steps = head_loss_changes_steps(self.model, clean.tokens, clean=clean)
        table = yield from metered(steps, {None: ABLATING})
        if clean is self.run.clean:  # (not of a text replaced meanwhile)
            yield {"head_loss_change": table, "progress": {}}

    def compute_head_loss_change(self) -> None:
        """``head_loss_change`` of the current text, synchronously (at most one forward per head)."""
        self._runner.cancel("head losses")
        for update in self._head_loss_steps(self.run.clean):
            for name, value in (update or {}).items():
                setattr(self, name, value)

    def page_items(self, context) -> list[PlanItem]:
        """A saved page's head-loss table (``core.save_plan``), where not computed yet: one forward of the text
        per head."""
        pos = self.run.clean.tokens.shape[1]
        if pos < 2 or self.head_loss_change is not None:
            return []
        cfg = self.model.cfg
        heads = cfg.n_layers * cfg.n_heads
        return [PlanItem(context.section, "the head-loss table", context.rate.seconds(heads * forward_flops(cfg, pos, pos)),
                         int(PAGE_BYTES_PER_ANSWER_BYTE * 4 * heads), MEASURED,
                         lambda n: self.compute_head_loss_change())]

    def settle(self, timeout, note=None) -> bool:
        """The ablated run is waited for; the head-loss table (background work) is not."""
        return self._runner.wait(timeout, tick=note and (lambda: note(self._runner.running_kind())), fill=False)
