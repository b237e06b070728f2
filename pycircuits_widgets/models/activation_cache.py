"""What a forward pass records: ``ActivationCache`` (``CircuitModel.run_with_cache``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from .interventions import Interventions


@dataclass
class ActivationCache:
    """What ``run_with_cache`` records (``b`` = batch, ``L`` = n_layers, ``H`` = n_heads).

    * ``tokens [b, pos]``
    * ``embed [b, pos, d_model]``: ``W_E[tokens]`` (+ ``W_pos`` when positions are "learned")
    * ``resid [b, L + 1, pos, d_model]``: residual stream before each layer, then the final one
    * ``patterns [b, L, H, dest, src]``: attention probabilities
    * ``z [b, L, H, pos, d_head]``: each head's ``pattern @ v``, what it reads before ``W_O``
    * ``head_out [b, L, H, pos, d_model]``: what each head writes to the residual stream
      (``z @ W_O``, without ``b_O``); computed from ``z`` on first access, because at real
      sizes it is the largest tensor here (GPT-2-medium, 100 tokens: 157 MB) and most
      analyses never read it
    * ``mlp_out [b, L, pos, d_model]`` or None (attention-only), ``b_out`` included
    * ``mlp_post [b, L, pos, d_mlp]`` or None: every neuron's post-activation, what ``W_out`` reads;
      recorded only when asked (``run_with_cache(tokens, mlp_post=True)``, MLP models), since it is
      ``d_mlp / d_model`` times the size of ``mlp_out``
    * ``ln_scale [b, L + 1, pos]``: the norm the stream is divided by where it is read (ones for
      the layers of a model without pre-norms, ``cfg.pre_norm`` False),
      aligned with ``resid``: layer ``l``'s attention reads ``resid[:, l] / ln_scale[:, l, :, None]``
      (after centering for layernorm) and the unembedding reads
      ``resid[:, L] / ln_scale[:, L, :, None]``. All ones when normalization is None.
    * ``ln_scale_mlp [b, L, pos]`` or None (attention-only): the MLP of layer ``l`` reads
      ``(resid[:, l] + attention output of layer l) / ln_scale_mlp[:, l, :, None]``, or
      ``resid[:, l] / ln_scale_mlp[:, l, :, None]`` when ``cfg.parallel_attn_mlp`` (GPT-NeoX).
    * ``post_scale_attn [b, L, pos]`` or None (without ``cfg.post_norms``): the division of layer
      ``l``'s post-attention norm, which adds ``norm(attn_out) * w_post_attn[l]`` to the stream with
      ``norm(y) = (y - mean(y)) / post_scale_attn[:, l, :, None]`` (no centering for rmsnorm) and
      ``attn_out = head_out[:, l].sum(1) (+ b_O[l])``. (``mlp_out`` is already post-normed.)
    * ``interventions``: the ``Interventions`` the run made (None: a clean run). An ablated head's
      ``z`` is zero and its ``head_out`` is its replacement (zero, or the mean output it was given).

    Identity (exact up to float rounding), without post-norms (``cfg.post_norms`` False):
    ``resid[:, L] = embed + head_out.sum((1, 2)) (+ b_O.sum(0)) (+ mlp_out.sum(1))``; with them,
    each layer adds ``norm(attention output) * w_post_attn`` instead (``mlp_out`` is already the
    post-normed MLP output). With ``patterns`` and ``ln_scale`` frozen, the logits
    are linear in ``embed``, each ``head_out`` and each ``mlp_out``.
    """

    tokens: torch.Tensor
    embed: torch.Tensor
    resid: torch.Tensor
    patterns: torch.Tensor
    z: torch.Tensor
    mlp_out: torch.Tensor | None
    ln_scale: torch.Tensor
    ln_scale_mlp: torch.Tensor | None
    W_O: torch.Tensor = field(repr=False)  # the model's, to compute head_out from z
    post_scale_attn: torch.Tensor | None = None
    mlp_post: torch.Tensor | None = None
    interventions: Interventions | None = None

    def __post_init__(self):
        self._W_O_version = self.W_O._version

    @cached_property
    def head_out(self) -> torch.Tensor:
        """What each head wrote to the residual stream, ``z @ W_O``: ``[batch, n_layers, n_heads, pos, d_model]``
        (a mean-ablated head: its mean output). Computed on first use, from this run's ``W_O``."""
        if self.W_O._version != self._W_O_version:  # head_out must be what this run's heads wrote
            raise RuntimeError("ActivationCache.head_out: the model's W_O was modified in place after this run; "
                               "run the model again to get head outputs for the new weights")
        # (a forward stopped early, run_with_cache(layers=k), holds the first k layers' z)
        out = torch.einsum("blhpe,lhed->blhpd", self.z, self.W_O[: self.z.shape[1]])
        for (layer, head), replacement in (self.interventions.heads if self.interventions else {}).items():
            if replacement is not None:  # a mean-ablated head wrote its mean (its z is zero)
                out[:, layer, head] = torch.as_tensor(replacement, dtype=out.dtype, device=out.device)
        return out

    def repeated(self, n: int, layers: int) -> ActivationCache:
        """The clean run's cache for its batch repeated ``n`` times: every entry ``[n * b, ...]``, block-major
        (rows ``i * b`` to ``(i + 1) * b - 1`` are the batch again), as ``run_with_cache`` of
        ``tokens.repeat(n, 1)`` records it, holding only the first ``layers`` layers (``resid [n * b, layers +
        1, ...]``, the other per-layer entries ``[n * b, layers, ...]``, no final norm: a forward stopped
        there) and no neurons' activations (``mlp_post`` None). What a forward of the repeated batch resumed
        at layer ``layers - 1`` reads (``run_with_cache(resume=)``), at a fraction of the whole cache's
        copy: one patched run per block (``analysis.patching``)."""
        if self.interventions:
            raise ValueError("ActivationCache.repeated: the cache of a run with interventions is no run to resume; "
                             "repeat a clean run's")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"ActivationCache.repeated: n must be an int >= 1 (the copies of the batch), got {n!r}")
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= self.z.shape[1]:
            raise ValueError(f"ActivationCache.repeated: layers must be an int in 1..{self.z.shape[1]}, got {layers!r}")

        def rep(x: torch.Tensor | None, upto: int | None = layers) -> torch.Tensor | None:
            if x is None:
                return None
            x = x if upto is None else x[:, :upto]
            return x.repeat(n, *[1] * (x.ndim - 1))

        out = ActivationCache(tokens=rep(self.tokens, None), embed=rep(self.embed, None),
                              resid=rep(self.resid, layers + 1), patterns=rep(self.patterns), z=rep(self.z),
                              mlp_out=rep(self.mlp_out), ln_scale=rep(self.ln_scale), ln_scale_mlp=rep(self.ln_scale_mlp),
                              W_O=self.W_O, post_scale_attn=rep(self.post_scale_attn))
        out._W_O_version = self._W_O_version  # (weights modified since this run: refused on resuming, as this run is)
        return out
