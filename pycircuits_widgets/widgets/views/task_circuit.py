"""TaskCircuit: where a task's behaviour lives, by exact and attribution patching of its prompt pairs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import traitlets

from ...analysis import activations
from ...analysis.attribution import attribution_patch
from ...analysis.composition import composition_scores
from ...analysis.edges import edge_attribution
from ...analysis.patching import DIRECTIONS, Task, activation_patch_steps, check_patching, head_outs
from ...analysis.patching import SITES as PATCH_SITES
from ...analysis.path_patching import measured_composition
from ...models.forward import next_token_loss
from ...models.interventions import Interventions
from ..core.arrays import ArrayDict
from ..core.base import CircuitWidget, rolls_back
from ..core.meter import Meter
from ..core.selection import HeadSelection, check_model, head_label
from ..core.shown_run import RunWriter, ShownRun

SITES = ("head_out", "resid_pre")
"""What the view patches: each head's output over all positions ``[L, H]`` (a click selects the head) and
the residual stream before each layer at each position ``[L, pos]`` (columns labelled by the tokens)."""
AGREEMENT_K = 5
"""The top cells whose overlap ``agreement`` reports."""
CIRCUIT_SIZES = (10, 20, 40, 80, 160, 320)
"""The circuit sizes tried, in edges of largest |score|: the graph shows the first whose faithfulness reaches
``FAITHFUL`` (else the largest, at most the graph's edges)."""
FAITHFUL = 0.8
"""The faithfulness (1 the full model, 0 the corrupted run) the graph's circuit is grown to."""
NO_RUN = "patching the shown run needs an explorer reading one of the task's clean prompts"
"""Why ``patched`` is unavailable to a view without one (``patch_run``)."""


@dataclass(frozen=True)
class PatchedRun:
    """A clean prompt's run with one head's output from its corrupted prompt: ``loss`` and ``clean_loss``
    ``[1, pos - 1]`` (per-token next-token loss, nats) and the run's ``cache`` (what a ``ShownRun`` shows)."""

    loss: torch.Tensor
    clean_loss: torch.Tensor
    cache: object


class TaskCircuit(RunWriter, HeadSelection, CircuitWidget):
    """A task's patching heatmaps: for each site of :data:`SITES`, exact activation patching
    (``pcw.activation_patch``: a layer's cells in one batched resumed forward) beside its first-order estimate
    (``pcw.attribution_patch``: two forwards and a backward), both on the task's scale (0 the
    corrupted run, 1 the clean one), and how well the estimate ranks the cells (``agreement``). A
    click on a head's cell selects the head. The estimate comes first (seconds), then the exact
    cells layer by layer, counted in ``progress`` (work asked for: it gives way to clicks, and
    ``cancel`` stops it between layers; what was computed stays).

    In an explorer reading one of the task's clean prompts, ``patched`` shows that prompt's run with the
    selected head's output taken from its corrupted prompt (noising one head) in every section that shows
    a run ("patched: L1.H6 from the corrupted prompt": the loss section shows each token's loss change).

    Args:
        model: a weight view with attention heads.
        task: a ``pcw.Task`` of this model (its prompt pairs, answers and metric).
        run: the explorer's ``ShownRun`` (``patched`` writes to it); None: a view on its own.
        direction: "denoise" (default: the corrupted run with one activation from the clean run) or
            "noise" (the clean run with one from the corrupted run); the browser may switch it.
        layer, head: the selected head.
    """

    _view = traitlets.Unicode("TaskCircuit").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "direction", "patched"})
    _tier = "asked"

    direction = traitlets.Enum(list(DIRECTIONS), default_value="denoise").tag(sync=True)
    """str: which run is patched ("denoise": the corrupted one, with the clean run's activation)."""
    prompt = traitlets.Dict().tag(sync=True)
    """(read-only) the task as shown: ``{"clean", "corrupted": [str] (the first pair's tokens), "answer",
    "wrong", "position", "n_prompts", "metric_clean", "metric_corrupted"}``."""
    exact = ArrayDict("float32").tag(sync=True)
    """{site: float32 [L, H] or [L, pos]} (read-only): exact patching, NaN for cells not computed yet."""
    estimate = ArrayDict("float32").tag(sync=True)
    """{site: float32, the site's shape} (read-only): attribution patching's estimate of the same cells."""
    circuit = traitlets.Dict().tag(sync=True)
    """(read-only) the circuit graph, once computed: ``{"method", "total" (the graph's edges), "nodes": [{"name",
    "rank" (the column: embed 0, layer l's heads 2l + 1, its MLP 2l + 2, the logits last), "layer", "head"
    (-1 for a non-head)}], "edges": [{"from", "to", "via" ("Q" | "K" | "V" | "mlp" | "logits"), "score" (the
    metric's units), "composition", "measured" (head -> head: the weights' composition score and the one
    measured on the clean prompts, for the via; else absent)}], "faithfulness": {"score", "metric",
    "metric_clean", "metric_corrupted", "edges", "total"}, "sizes": [[edges, faithfulness], ...], "target"}``:
    the smallest circuit of ``CIRCUIT_SIZES`` edges of largest |score| by edge attribution patching
    (``pcw.edge_attribution``) whose run, measured exactly, keeps ``FAITHFUL`` of the behaviour (the sizes
    tried, with theirs)."""
    patched = traitlets.Bool(False).tag(sync=True)
    """bool: the explorer's sections show the run patched at the selected head (class docstring)."""
    patch_run = traitlets.Unicode("").tag(sync=True)
    """str (read-only): why ``patched`` is unavailable ("" where it is)."""
    agreement = traitlets.Dict().tag(sync=True)
    """{site: {"rank_correlation", "top_k_overlap", "k", "worst": [[cell, estimate, exact], ...]}} (read-only),
    once the site's exact cells are all in."""

    def __init__(self, model, task, *, run: ShownRun | None = None, **kwargs):
        check_model(model, "TaskCircuit")
        for site in SITES:
            check_patching(model, task, site, PATCH_SITES, kwargs.get("direction", "denoise"), "TaskCircuit")
        self.task, self.run = task, run
        self._done = {}  # direction -> (exact, estimate, agreement): computed once each
        super().__init__(model, prompt=_shown_task(model, task), **kwargs)

    _answers_offline = "now"

    def offline_answers(self, answers) -> None:
        """Kernel-less: the tables as computed; another direction and the patched run need the model."""
        answers.needs_kernel("direction", "patched")

    def _started(self) -> None:
        self.observe(self._on_direction, ["direction"])
        self.observe(self._on_patched, ["patched", "layer", "head"])
        if self.run is not None:
            self._follow_run()
        self._on_text(None)
        self._start()

    # -- the patched run -------------------------------------------------------------------------
    def _prompt(self) -> int | None:
        """The index of the task's clean prompt the explorer reads, or None."""
        if self.run is None or self.run.clean is None:
            return None
        tokens = self.run.clean.tokens[0].to(self.task.tokens_clean.device)
        same = [i for i, row in enumerate(self.task.tokens_clean) if len(row) == len(tokens) and torch.equal(row, tokens)]
        return same[0] if same else None

    def _on_text(self, change) -> None:
        self.patch_run = "" if self._prompt() is not None else NO_RUN
        if self.patched:
            self._start_patched()

    def writing(self) -> bool:
        return self.patched

    def taken(self) -> None:
        self.patched = False

    @traitlets.validate("patched")
    def _valid_patched(self, proposal):
        if proposal["value"] and self.patch_run:
            raise traitlets.TraitError(f"patched: {self.patch_run}")
        return proposal["value"]

    @rolls_back
    def _on_patched(self, change) -> None:
        self._start_patched()

    def _start_patched(self) -> None:
        """The selected head patched into the shown prompt's run (one resumed forward), on the view's runner."""
        self._runner.cancel("patched run")
        if self.run is None:
            return
        text = self.run.shown.text
        if not self.patched:
            self.run.withdraw(text, self)
            return
        i, head = self._prompt(), (self.layer, self.head)
        self._runner.submit("patched run", lambda: self._patched_steps(text, i, head), tier="click")

    def _patched_steps(self, text: str, i: int, head: tuple[int, int]):
        clean, (layer, h) = self.run.clean, head
        value = head_outs(self.model, self.task.corrupted, layer)[i:i + 1, h]  # [1, pos, d_model]
        with torch.no_grad():
            logits, cache = self.model.run_with_cache(clean.tokens, interventions=Interventions(heads={head: value}),
                                                      resume=clean.cache)
        result = PatchedRun(next_token_loss(logits, cache.tokens), clean.token_loss, cache)
        yield {"_written_run": (text, f"patched: {head_label(layer, h)} from the corrupted prompt", result)}

    # -- the patching tables ---------------------------------------------------------------------
    @rolls_back
    def _on_direction(self, change) -> None:
        self._start()

    def _start(self) -> None:
        self._runner.cancel("patching")
        direction = self.direction
        if direction in self._done:
            exact, estimate, agreement = self._done[direction]
            with self.hold_sync():
                self.exact, self.estimate, self.agreement = exact, estimate, agreement
            return
        self._runner.submit("patching", lambda: self._patching_steps(direction),
                            progress=self._patching(direction).report(0))

    def _patching(self, direction: str) -> Meter:
        """The meter of the exact cells: each site's layers."""
        return Meter(f"patching ({direction})", len(SITES) * self.model.cfg.n_layers, "layers")

    def _patching_steps(self, direction: str):
        """The estimate of every site (one piece), then each site's exact cells a layer a piece."""
        estimate = {site: attribution_patch(self.model, self.task, site, direction) for site in SITES}
        yield {"estimate": {site: r.scores for site, r in estimate.items()}, "exact": {}, "agreement": {}}
        L = self.model.cfg.n_layers
        meter = self._patching(direction)
        exact, agreement = {}, {}
        for i, site in enumerate(SITES):
            partial = {}
            steps = activation_patch_steps(self.model, self.task, site, direction, into=partial)
            while True:
                try:
                    done, _ = next(steps)
                except StopIteration as stop:
                    result = stop.value
                    break
                yield {**(meter.at(i * L + done) or {}), "exact": {**exact, site: partial["scores"].clone()}}
            exact[site] = result.scores
            found = estimate[site].agreement(result, AGREEMENT_K)
            agreement[site] = {"rank_correlation": found.rank_correlation, "top_k_overlap": found.top_k_overlap,
                               "k": found.k, "worst": [[list(cell), e, x] for cell, e, x in found.worst]}
            yield {"agreement": dict(agreement)}
        self._done[direction] = ({s: t.float() for s, t in exact.items()},
                                 {s: r.scores.float() for s, r in estimate.items()}, dict(agreement))
        if not self.circuit:
            circuit = yield from self._circuit_steps()
            yield {"circuit": circuit}
        yield {"progress": {}}

    def _circuit_steps(self):
        """The ``circuit`` trait (returned): edge attribution, then each size's faithfulness a piece (about
        ``n_layers`` forwards each), each head -> head edge with the weights' and the measured composition
        of the pair."""
        found = edge_attribution(self.model, self.task, "eap")
        sizes = []
        for n in sorted({min(n, len(found.edges)) for n in CIRCUIT_SIZES}):
            yield None  # a chunk boundary: a click goes first
            circuit = found.circuit(top_n=n, prune=True)  # (the same faithfulness; drawn, only paths to the logits)
            faithful = found.faithfulness(circuit)
            sizes.append([n, faithful.score])
            if faithful.score >= FAITHFUL:
                break
        vias = {via for _, _, via in circuit.edges if via in "QKV"}
        weights = {via: composition_scores(self.model, via, offsets=None) for via in vias
                   if self.model.cfg.positional != "rotary" or via == "V"}
        clean = activations.run(self.model, self.task.tokens_clean)  # one clean run for every via's measurement
        measured = {via: measured_composition(self.model, clean.tokens, via, clean=clean) for via in vias}

        def head(name: str) -> tuple[int, int]:
            layer, h = name[1:].split(".H")
            return int(layer), int(h)

        edges = []
        for (up, down, via), score in zip(circuit.edges, circuit.scores.tolist()):
            edge = {"from": up, "to": down, "via": via, "score": score}
            if via in vias and up.startswith("L"):
                pair = (*head(up), *head(down))
                if via in weights:
                    edge["composition"] = float(weights[via][pair])
                edge["measured"] = float(measured[via][pair])
            edges.append(edge)
        nodes = [{"name": n, "rank": circuit.ranks[n], **dict(zip(("layer", "head"), head(n) if n.startswith("L")
                                                                  else (-1, -1)))} for n in circuit.nodes]
        return {"method": found.method, "total": len(found.edges), "nodes": nodes, "edges": edges,
                "sizes": sizes, "target": FAITHFUL,
                "faithfulness": {"score": faithful.score, "metric": faithful.metric,
                                 "metric_clean": faithful.metric_clean, "metric_corrupted": faithful.metric_corrupted,
                                 "edges": faithful.edges, "total": faithful.total}}

    def cancel(self) -> None:
        """Stop the patching between two layers (what was computed stays shown)."""
        self._runner.cancel("patching")


def _shown_task(model, task: Task) -> dict:
    """The ``prompt`` trait: the first pair's tokens, its answers and the task's metrics."""
    if not isinstance(task, Task):
        raise TypeError(f"TaskCircuit: task must be a pcw.Task of this model, got {type(task).__name__}")
    strings = model.token_strings
    correct, wrong = (strings[int(i)] for i in task.answer_ids[0]) if len(task.answer_ids) else ("", "")
    return {"clean": [strings[int(i)] for i in task.tokens_clean[0]],
            "corrupted": [strings[int(i)] for i in task.tokens_corrupted[0]],
            "answer": correct, "wrong": wrong, "position": task.position % task.n_pos,
            "n_prompts": len(task.tokens_clean), "metric_clean": task.metric_clean,
            "metric_corrupted": task.metric_corrupted}
