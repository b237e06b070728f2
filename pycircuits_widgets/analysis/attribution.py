"""Attribution patching (AtP): the first-order estimate of exact activation patching, every cell at once.

Patching one activation ``a`` of the base run (the corrupted run to *denoise*, the clean one to *noise*)
with the other run's changes the task's metric by about ``(a_other - a_base) . dm/da``, the gradient
taken on the base run (Nanda, 2023; Kramár et al., 2024). Each site here enters the residual stream
additively, so ``dm/da`` is the gradient of the metric with respect to the stream where ``a`` is added:
one forward of the base run with zero ``Interventions.taps`` at every layer's three points (before it,
after its attention, after its MLP) and one backward give all of them.

==================  ============  ===============================================================
``"resid_pre"``     ``[L, P]``    the stream before layer ``l`` at ``p``: the gradient there
``"head_out"``      ``[L, H]``    head ``(l, h)``'s output at every position: the gradient after the
``"head_out_pos"``  ``[L, H, P]`` layer's attention, where each head's ``z @ W_O`` is added
``"attn_out"``      ``[L, P]``    (models with a post-attention norm are refused: it is not additive)
``"mlp_out"``       ``[L, P]``    layer ``l``'s MLP output at ``p``: the gradient after its MLP
``"neuron"``        ``[L, N]``    neuron ``n``'s activation at every position: that gradient through
                                  ``W_out`` (its row is what the neuron adds per unit of activation)
``"q_input"``       ``[L, H]``    the stream head ``(l, h)``'s query or key reads, by AtP*'s correction
``"k_input"``                     for saturated attention: the head's pattern recomputed exactly with the
                                  other run's query (key) input, its change dotted with the metric's
                                  gradient at the pattern (``Interventions(patterns=)``: the base pattern
                                  plus zeros requiring grad)
``"v_input"``       ``[L, H]``    the stream head ``(l, h)``'s value reads: the gradient of that head's
                                  own read (``Interventions(head_inputs=)``: the base stream plus zeros)
``"pattern"``       ``[L, H]``    head ``(l, h)``'s attention pattern: its change dotted with the
                                  metric's gradient at the pattern (as for the query-key correction)
==================  ============  ===============================================================

The input and pattern sites take a forward resumed at the layer and a backward per layer (about ``L`` forwards in
all, not one): a head's own read is not where the shared stream's gradient is.

Scores are on ``activation_patch``'s scale (``Task.normalise``: 0 the corrupted run, 1 the clean one),
so ``result.agreement(activation_patch(...))`` compares the estimate with the exact cells: rank
correlation, the overlap of the top cells, and where they disagree most.

**GradDrop** (``graddrop=True``; AtP*'s second part, Kramár et al., 2024, for the stream sites
``GRADDROP_SITES``): a cell whose effect reaches the metric by paths that cancel (a direct effect undone
by a later layer's) has a gradient near zero although patching it along one path alone moves the metric.
For each layer ``l``, the estimate again with the gradient through layer ``l``'s residual contribution
dropped (its attention's and MLP's outputs enter the stream detached: ``Interventions(detached=)``), which
keeps the paths past that layer and cuts those through it; ``result.dropped [L, ...]`` holds the ``L``
estimates (changes on the normalised scale), ``result.graddrop`` the score ``sum_l |dropped[l]| / (L - 1)``
(a cell of layer ``l`` that is part of its contribution, every site but ``resid_pre``, has no gradient
with it dropped: the mean of the magnitudes over the other layers). It costs ``L`` forwards with the taps
and ``L`` backwards more than the estimate alone (one graph per dropped layer: about ``3 L`` forwards'
time; 36.6 forwards in all, the estimate's included, at GPT-2-small's 12 layers: ``benchmarks/README.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.interventions import TAPS, Interventions
from .patching import PatchResult, Task, check_patching, head_outs

GRADDROP_SITES = ("resid_pre", "head_out", "head_out_pos", "attn_out", "mlp_out", "neuron")
"""The sites ``attribution_patch(graddrop=True)`` takes: the ones read from the stream's gradient in one backward
(an input or pattern site takes a backward per layer already: ``L`` per dropped layer)."""
SITES = {"resid_pre": ("layer", "position"), "head_out": ("layer", "head"),
         "head_out_pos": ("layer", "head", "position"), "attn_out": ("layer", "position"),
         "mlp_out": ("layer", "position"), "neuron": ("layer", "neuron"),
         "q_input": ("layer", "head"), "k_input": ("layer", "head"), "v_input": ("layer", "head"),
         "pattern": ("layer", "head")}
"""Each site's cells, by the names of the result's dimensions (module docstring)."""
WORST = 5
"""Cells ``Agreement.worst`` lists."""


@dataclass(frozen=True)
class Agreement:
    """How an attribution estimate agrees with exact patching of the same site and direction:
    ``rank_correlation`` (Spearman's, over every cell), ``top_k_overlap`` (the fraction of exact
    patching's ``k`` cells of largest effect that the estimate also puts in its top ``k``) and
    ``worst`` (``(cell, estimate, exact)`` of the ``WORST`` cells where they differ most)."""

    rank_correlation: float
    top_k_overlap: float
    k: int
    worst: list


@dataclass(frozen=True)
class AttributionResult:
    """``scores`` (float64, the site's shape, ``activation_patch``'s scale) of the attribution estimate of
    patching ``site`` in ``direction``; ``dims`` names its dimensions (``SITES``). ``dropped`` (with
    ``graddrop=True``, else None): ``[L, *shape]`` float64, the estimate's change from the base run with
    layer ``l``'s contribution detached, on the normalised scale (module docstring)."""

    site: str
    direction: str
    scores: torch.Tensor
    dims: tuple[str, ...]
    dropped: torch.Tensor | None = None

    @property
    def graddrop(self) -> torch.Tensor | None:
        """AtP*'s GradDrop score (the site's shape, ``>= 0``, on the normalised scale): ``sum_l |dropped[l]|
        / (L - 1)``; None without ``graddrop=True``."""
        return None if self.dropped is None else self.dropped.abs().sum(0) / (len(self.dropped) - 1)

    def agreement(self, exact: PatchResult, k: int = 10) -> Agreement:
        """The estimate against ``exact`` (``activation_patch`` of the same site and direction)."""
        if not isinstance(exact, PatchResult) or (exact.site, exact.direction) != (self.site, self.direction):
            raise ValueError(f"agreement: exact must be activation_patch(model, task, {self.site!r}, "
                             f"{self.direction!r}), got {exact!r:.80}")
        if exact.scores.shape != self.scores.shape:
            raise ValueError(f"agreement: exact has shape {list(exact.scores.shape)}, the estimate "
                             f"{list(self.scores.shape)}: not the same task")
        ours, theirs = self.scores.flatten(), exact.scores.flatten()
        k = max(1, min(int(k), len(ours)))
        unpatched = 0.0 if self.direction == "denoise" else 1.0  # the base run's score
        top = set(_top(theirs - unpatched, k)) & set(_top(ours - unpatched, k))
        gap = (ours - theirs).abs()
        cells = [tuple(int(i) for i in torch.unravel_index(torch.tensor(j), self.scores.shape))
                 for j in torch.argsort(gap, descending=True)[:WORST].tolist()]
        return Agreement(_spearman(ours, theirs), len(top) / k, k,
                         [(cell, float(self.scores[cell]), float(exact.scores[cell])) for cell in cells])


def _top(effects: torch.Tensor, k: int) -> list[int]:
    return torch.argsort(effects.abs(), descending=True)[:k].tolist()


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two vectors (ranks by sorting; ties, which measured scores
    almost never have, ranked in index order)."""
    ra, rb = (torch.argsort(torch.argsort(x)).double() for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float((ra.square().sum() * rb.square().sum()).sqrt())
    return float((ra * rb).sum()) / denominator if denominator else float("nan")


def attribution_patch(model, task: Task, site: str, direction: str = "denoise", graddrop: bool = False) -> AttributionResult:
    """The attribution estimate of ``activation_patch(model, task, site, direction)`` for every cell, from
    one forward and one backward of the base run, or for the heads' inputs and patterns one resumed
    forward and backward per layer (module docstring). ``graddrop``: also AtP*'s GradDrop (``result.dropped``,
    ``result.graddrop``; ``L`` forwards and backwards more)."""
    check_patching(model, task, site, SITES, direction, "attribution_patch")
    c = model.cfg
    if not isinstance(graddrop, bool):
        raise TypeError(f"attribution_patch: graddrop must be True or False, got {graddrop!r}")
    if graddrop and site not in GRADDROP_SITES:
        raise ValueError(f"attribution_patch: graddrop is for the sites {GRADDROP_SITES}, got {site!r} (its estimate "
                         "takes a backward per layer already)")
    if graddrop and c.n_layers < 2:
        raise ValueError(f"attribution_patch: graddrop drops one layer's gradient at a time and scores a cell over the "
                         f"other layers; {c.name!r} has {c.n_layers}")
    if site == "neuron" and c.post_norms:
        raise ValueError(f"attribution_patch: site 'neuron': {c.name!r} normalises its MLP's output, so a neuron "
                         "does not enter the stream additively (exact patching: pcw.activation_patch)")
    if site in ("head_out", "head_out_pos", "attn_out") and c.post_norms:
        raise ValueError(f"attribution_patch: site {site!r}: {c.name!r} normalises its attention's output after the "
                         "heads are summed, so a head's output does not enter the stream additively (exact patching: "
                         "pcw.activation_patch)")
    base, source = (task.corrupted, task.clean) if direction == "denoise" else (task.clean, task.corrupted)
    tokens = task.tokens_corrupted if direction == "denoise" else task.tokens_clean
    if site == "v_input":
        estimate = torch.stack([_value_estimate(model, task, layer, tokens, base, source)
                                for layer in range(c.n_layers)])
    elif site in ("q_input", "k_input", "pattern"):
        estimate = torch.stack([_pattern_estimate(model, task, site, layer, tokens, base, source)
                                for layer in range(c.n_layers)])
    else:
        estimate = _site_estimate(model, task, site, tokens, base, source)
    dropped = None
    if graddrop:
        dropped = torch.stack([_site_estimate(model, task, site, tokens, base, source, drop)
                               for drop in range(c.n_layers)]) / (task.metric_clean - task.metric_corrupted)
    start = task.metric_corrupted if direction == "denoise" else task.metric_clean
    return AttributionResult(site, direction, task.normalise(start + estimate), SITES[site], dropped)


def _site_estimate(model, task: Task, site: str, tokens, base, source, drop: int | None = None) -> torch.Tensor:
    """``[L, ...]``: every cell's estimate of a stream site (not normalised), from one forward of ``tokens``
    with taps and one backward; ``drop``: with that layer's contribution detached (GradDrop), its own
    cells then 0 but for ``resid_pre`` (the stream before it goes on past it)."""
    grads = _stream_gradients(model, task, tokens, frozenset() if drop is None else {drop})
    with torch.no_grad():
        estimate = torch.stack([_layer_estimate(model, site, layer, base, source, grads)
                                for layer in range(model.cfg.n_layers)])
    if drop is not None and site != "resid_pre":  # (the tap after the layer reads the stream, not its detached part)
        estimate[drop] = 0
    return estimate


def metric_gradients(task: Task, run, leaves: list, where: str = "attribution_patch", metric=None) -> tuple:
    """The task's metric of ``run()``'s logits (``metric()``, the metric itself, where given), differentiated
    with respect to ``leaves`` (refused, naming ``where``, unless the metric is a scalar tensor computed
    from the logits, and a finite one)."""
    with torch.enable_grad():
        value = metric() if metric is not None else task.metric_fn(run(), task)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
            raise TypeError(f"{where}: the task's metric must give a scalar tensor computed from the logits "
                            f"with torch operations (its gradient is taken), got {type(value).__name__}")
        if not bool(torch.isfinite(value.detach())):
            raise ValueError(f"{where}: the task's metric is {float(value.detach())} on the run its gradient is taken on; "
                             "it must be finite")
        return torch.autograd.grad(value, leaves)


def _zeros(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, pos, d_model]`` zeros requiring grad, in the dtype the forward's stream has."""
    dtype = model.dtype if model.dtype in (torch.float32, torch.float64) else torch.float32  # (a half model's stream)
    return torch.zeros(*tokens.shape, model.cfg.d_model, dtype=dtype, device=model.device, requires_grad=True)


def _value_estimate(model, task: Task, layer: int, tokens, base, source) -> torch.Tensor:
    """``[H]``: each head of ``layer`` reading its values from the other run's stream before the layer: the
    change of that stream dotted with the gradient of the head's own read (the base stream plus zeros
    requiring grad as every head's value input, a forward resumed at the layer and a backward)."""
    leaves = [_zeros(model, tokens) for _ in range(model.cfg.n_heads)]
    inputs = {(layer, h, "V"): base.resid[:, layer] + leaf for h, leaf in enumerate(leaves)}
    grads = metric_gradients(task, lambda: model.run_with_cache(tokens, Interventions(head_inputs=inputs),
                                                                 resume=base)[0], leaves)
    delta = (source.resid[:, layer] - base.resid[:, layer]).double()
    return torch.stack([torch.einsum("bpd,bpd->", delta, g.double()) for g in grads])


def _pattern_estimate(model, task: Task, site: str, layer: int, tokens, base, source) -> torch.Tensor:
    """``[H]``: each head of ``layer`` with a new pattern, its change dotted with the metric's gradient at
    the pattern (the base pattern plus zeros requiring grad for every head, a forward resumed at the
    layer and a backward). ``site`` "pattern": the other run's pattern; "q_input" / "k_input", AtP*'s
    query-key correction: the pattern recomputed exactly with the query (key) read from the other run's
    stream."""
    patterns = base.patterns[:, layer]  # [b, H, dest, src]
    leaves = [torch.zeros_like(patterns[:, 0], requires_grad=True) for _ in range(model.cfg.n_heads)]
    given = {(layer, h): patterns[:, h] + leaf for h, leaf in enumerate(leaves)}
    grads = metric_gradients(task, lambda: model.run_with_cache(tokens, Interventions(patterns=given),
                                                                 resume=base)[0], leaves)
    with torch.no_grad():
        if site == "pattern":
            patched = source.patterns[:, layer]
        else:
            ours, theirs = (model.layer_read(run.resid[:, layer])[0] for run in (base, source))
            q = model.project(layer, theirs if site == "q_input" else ours, "Q")
            k = model.project(layer, theirs if site == "k_input" else ours, "K")
            patched = model.attention_pattern(layer, q, k)  # [b, H, dest, src]
        delta = (patched - patterns).double()
    return torch.stack([torch.einsum("bqs,bqs->", delta[:, h], g.double()) for h, g in enumerate(grads)])


def _stream_gradients(model, task: Task, tokens: torch.Tensor, detached: frozenset = frozenset()) -> dict:
    """``{(layer, where): dm/dstream [b, pos, d_model] float64}`` on the run of ``tokens`` at every tap point
    (``detached``: layers whose contribution enters the stream detached, ``Interventions.detached``)."""
    points = [(layer, where) for layer in range(model.cfg.n_layers) for where in TAPS
              if where != "post" or not model.cfg.attn_only]
    taps = {p: _zeros(model, tokens) for p in points}
    edits = Interventions(taps=taps, detached=frozenset(detached))
    grads = metric_gradients(task, lambda: model.run_with_cache(tokens, edits)[0], list(taps.values()))
    return {p: g.double() for p, g in zip(points, grads)}


def _layer_estimate(model, site: str, layer: int, base, source, grads: dict) -> torch.Tensor:
    """Layer ``layer``'s cells of ``site``: each cell's change of activation dotted with the gradient where
    it enters the stream, summed over the prompts (the metric's mean over them is in the gradient)."""
    if site == "resid_pre":
        delta = (source.resid[:, layer] - base.resid[:, layer]).double()
        return torch.einsum("bpd,bpd->p", delta, grads[layer, "pre"])
    if site == "mlp_out":
        delta = (source.mlp_out[:, layer] - base.mlp_out[:, layer]).double()
        return torch.einsum("bpd,bpd->p", delta, grads[layer, "post"])
    if site == "neuron":
        delta = (source.mlp_post[:, layer] - base.mlp_post[:, layer]).double()  # [b, pos, d_mlp]
        return torch.einsum("bpn,bpn->n", delta, grads[layer, "post"] @ model.W_out[layer].double().T)
    delta = (head_outs(model, source, layer) - head_outs(model, base, layer)).double()  # [b, H, pos, d_model]
    spec = {"head_out": "bhpd,bpd->h", "head_out_pos": "bhpd,bpd->hp", "attn_out": "bhpd,bpd->p"}[site]
    return torch.einsum(spec, delta, grads[layer, "mid"])
