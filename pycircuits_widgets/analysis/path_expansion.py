"""Path expansion of a model's logits (paper: "Path expansion of logits"), exact for any model.

With the attention patterns ``A^h [batch, dest, src]`` and the layer-norm divisions frozen
from a forward pass, every attention layer is linear in the residual stream, and the logits
expand exactly into a sum over paths through heads in strictly increasing layers:

* order 0, the direct path: ``D_final ⊗ W_E W_U``;
* order 1, one head: ``D_final A^h D_l ⊗ W_E W_OV^h W_U``;
* order 2, a virtual head (V-composition): ``D_final A^{h2} D_{l2} A^{h1} D_{l1} ⊗ W_E W_OV^{h1} W_OV^{h2} W_U``;
* ... up to order ``n_layers``,

where ``D_l = diag(1 / ln_scale)`` of the layer that reads (and a layer norm's centering is
kept as a projection on the reading weight, so the sum is exact even for unfolded writers), and each term is a
``TensorProductTerm`` (positions ⊗ residual) applied to what its path starts from.

**Features of other families** (``cfg.nonlinear_features``), each made linear or refused (``LINEARISED``):
post-norms (Gemma 2/3, OLMo 2/3, EXAONE 4) have their divisions frozen from the run like the pre-norms'
(a head of layer ``l`` writes ``P_l A^h D_l ⊗ W_OV^h C w_post``, ``P_l = diag(1 / post_scale_attn)``);
QK-norm and the attention soft-cap only shape the patterns, which are frozen; a final soft-cap
(``cap * tanh(logits / cap)``) is applied after the sum, so the terms sum to the logits *before* it
(``PathExpansion.logits``) and the losses cap each partial sum; a mixture of experts is inside the
MLP outputs, which are sources. ``clip_qkv`` clamps the values a head moves: exact where no value
reaches the clamp on the text, refused with :class:`NonlinearFeatureError` where one does.

**Sources.** A path starts from something written into the residual stream that no head wrote:
the embeddings ``x0 [batch, pos, d_model]`` (token embeddings, plus positions for models that add
them to the residual); each MLP layer's output as the forward pass computed it (an MLP is not
linear, so its output is a source, not expanded through its input: the term "MLP1 → L2.H0" is
what head L2.H0 moved of MLP 1's output); each attention layer's constant bias ``b_O + sum_h b_V^h
W_O^h`` (a pattern's rows sum to 1, so ``b_V`` passes through as a constant); and ``b_U``.
A source enters the stream before the first layer whose heads read it (MLP ``l`` and the bias of
attention layer ``l``: layers ``> l``).

**Order.** A term's order counts the heads and MLPs on it (the biases count 0). ``max_order``
truncates the expansion without losing exactness: a path with ``max_order`` heads reads, at its
first head, the *whole* residual stream there (everything that head reads, as cached), so with
``max_order=1`` the terms are the direct path, each head's whole output, each MLP layer's output
and the biases: the model's residual decomposition by the component that wrote it. The default
expands fully (``max_order = n_layers``): ``prod_l (1 + n_heads)`` embedding paths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..factored import FactoredMatrix
from ..models.forward import next_token_loss
from .activations import RunResult
from .circuits import TensorProductTerm
from .pieces import drained

LINEARISED = {
    "qk_norm": "QK-norm only shapes the attention patterns, which are frozen",
    "attn_softcap": "the attention soft-cap only shapes the attention patterns, which are frozen",
    "post_norms": "the post-norms' divisions are frozen from the forward pass like the pre-norms'",
    "final_softcap": "the terms sum to the logits before the final soft-cap, which is applied to each sum",
    "moe": "the experts' routing is inside the MLP outputs, which are sources",
    "clip_qkv": "exact where no value reaches the clamp on the text (refused where one does)",
}
"""How ``path_expansion`` keeps each of ``ModelConfig.nonlinear_features`` exact; a feature missing
here is refused (``NonlinearFeatureError``)."""


class NonlinearFeatureError(ValueError):
    """``path_expansion`` cannot write a model's logits as an exact sum of paths: a step of its forward
    (``feature``, one of ``ModelConfig.nonlinear_features``) is not linear on this run."""

    def __init__(self, feature: str, message: str):
        super().__init__(f"path expansion refused: {feature}: {message}")
        self.feature = feature


def check_path_features(cfg) -> None:
    """Refuse (``NonlinearFeatureError``) a model with a feature ``path_expansion`` cannot make linear
    whatever the text (``LINEARISED`` lists those it can)."""
    for feature in cfg.nonlinear_features:
        if feature not in LINEARISED:
            raise NonlinearFeatureError(feature, "this step of the forward is not linear in the residual stream, "
                                                 "and path expansion has no exact way through it")


@dataclass(frozen=True)
class PathTerm:
    """One path: what it starts from (``source``), the ``heads`` it goes through in layer order
    (``()`` for a source read by the unembedding alone), and its ``A ⊗ W`` term.

    ``source``: ``"embed"`` (the embeddings), ``"mlp{l}"`` (MLP layer ``l``'s output), ``"bias{l}"``
    (attention layer ``l``'s constant bias), ``"b_U"``, or ``"stream{l}"`` (the whole residual
    stream before layer ``l``: a path truncated at ``max_order``, module docstring)."""

    heads: tuple[tuple[int, int], ...]
    term: TensorProductTerm
    source: str = "embed"

    @property
    def order(self) -> int:
        return len(self.heads) + self.source.startswith("mlp")

    @property
    def name(self) -> str:
        start = None if self.source == "embed" else _source_name(self.source)
        if not self.heads:
            return "direct" if start is None else start
        path = " → ".join(f"L{l}.H{h}" for l, h in self.heads)
        return path if start is None or self.source.startswith("stream") else f"{start} → {path}"


def _source_name(source: str) -> str:
    if source == "b_U":
        return source
    for prefix, label in (("mlp", "MLP{}"), ("bias", "bias L{}"), ("stream", "stream L{}")):
        if source.startswith(prefix):
            return label.format(source[len(prefix):])
    raise ValueError(f"unknown path source {source!r}")


@dataclass(frozen=True)
class Readout:
    """What one pass over the terms of a ``PathExpansion`` keeps (``PathExpansion.readout_steps``).

    ``by_order [top + 1, batch, pos, d_vocab]``: the sum of the terms of each order ``0..top``;
    ``contributions [n_terms, batch, pos - 1]``: ``PathExpansion.next_token_contributions``."""

    by_order: torch.Tensor
    contributions: torch.Tensor


@dataclass(frozen=True)
class PathExpansion:
    """All path terms of one batch; ``logits [batch, pos, d_vocab]`` is the model's own linear readout
    for comparison: its logits, or, for a model with a final soft-cap (``final_softcap`` not None),
    its logits before the cap (``capped(logits)`` is its output).

    ``x0 [batch, pos, d_model]`` embeddings; ``sources``: what each term's ``source`` names, as
    ``[batch, pos, d_in]`` (``d_in`` 1 for ``b_U``); ``term_logits(i)`` -> ``[batch, pos, d_vocab]``.

    **Memory.** Every term's logits at once would be ``n_terms x batch x pos x d_vocab`` floats: 42 MB for the shipped 2-layer model on a full context, but 5.9 GB for SmolLM2-135M's 301
    terms on 100 tokens. So the sums, the loss ladder, the importances and the contributions are
    computed term by term (``readout_steps``, then ``term_importance_steps``, each term's logits
    computed again: twice the GEMMs, a ``[batch, pos, d_vocab]`` table per order in memory).
    """

    tokens: torch.Tensor
    x0: torch.Tensor
    terms: list[PathTerm]
    logits: torch.Tensor
    sources: dict
    final_softcap: float | None = None

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)`` for a model with a final soft-cap, else ``logits``: what the
        model outputs for a sum of terms."""
        cap = self.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def term_logits(self, i: int) -> torch.Tensor:
        """Term ``i``'s logits ``[batch, pos, d_vocab]``, computed on each call (nothing kept)."""
        t = self.terms[i]
        return t.term(self.sources[t.source])

    @functools.cached_property
    def readout(self) -> Readout:
        """The sums by order and the next-token contributions (``readout_steps`` run through, kept)."""
        return drained(self.readout_steps())

    @torch.no_grad()
    def readout_steps(self):
        """``readout`` in pieces (``analysis.pieces``): one term's logits each, added to its order's
        sum and read at the next tokens, then dropped; yields ``(done, n_terms)``; returns the
        ``Readout`` and keeps it (``readout`` then answers at once)."""
        if "readout" in self.__dict__:  # (cached_property's own slot)
            return self.__dict__["readout"]
        n = len(self.terms)
        top = max(t.order for t in self.terms)
        by_order = contributions = None
        nxt = self.tokens[:, 1:, None]
        yield 0, n
        for i, t in enumerate(self.terms):
            logits = self.term_logits(i)
            if by_order is None:
                by_order = logits.new_zeros((top + 1, *logits.shape))
                contributions = logits.new_empty((n, *nxt.shape[:2]))
            by_order[t.order] += logits
            head = logits[:, :-1]
            contributions[i] = head.gather(-1, nxt)[..., 0] - head.mean(-1)
            yield i + 1, n
        out = Readout(by_order=by_order, contributions=contributions)
        self.__dict__["readout"] = out
        return out

    def logits_up_to_order(self, order: int) -> torch.Tensor:
        """Sum of the terms of order ``<= order`` ``[batch, pos, d_vocab]``."""
        return self.readout.by_order[:order + 1].sum(0)

    def total(self) -> torch.Tensor:
        """Sum of all terms; equals ``logits`` (before any final soft-cap) up to rounding."""
        return self.readout.by_order.sum(0)

    def loss_by_order(self) -> torch.Tensor:
        """Mean next-token loss using only terms of order ``<= n``, for ``n = 0..max order`` ``[n + 1]``.

        The paper's marginal effect of the ``n``-th order terms is ``loss[n - 1] - loss[n]``. A final
        soft-cap is applied to each partial sum, as the model applies it to its logits.
        """
        top = self.readout.by_order.shape[0] - 1
        return torch.stack([next_token_loss(self.capped(self.logits_up_to_order(n)), self.tokens).mean()
                            for n in range(top + 1)])

    def next_token_contributions(self) -> torch.Tensor:
        """Each term's centred logit for the token that actually came next: ``[n_terms, batch, pos - 1]``.

        Entry ``[i, b, p]`` is ``T_i[b, p, t] - mean_v T_i[b, p, v]`` with ``t = tokens[b, p + 1]`` and
        ``T_i = term_logits(i)``: how much term ``i`` raises the next token's logit above the average
        token's (the softmax ignores a shift shared by every token, so the raw logit would mislead).
        With a final soft-cap these are contributions to the logits before the cap.
        """
        return self.readout.contributions

    def term_importance(self) -> torch.Tensor:
        """Loss increase when one term is removed from the full sum: ``[n_terms]`` (ablation; a final
        soft-cap applied to each sum; ``term_importance_steps`` run through)."""
        return drained(self.term_importance_steps())

    @torch.no_grad()
    def term_importance_steps(self):
        """``term_importance`` in pieces (``analysis.pieces``): one term's ablated loss each (its logits
        computed again), yielding ``(done, n_terms)`` (after ``readout``, computed at once here if not yet)."""
        full = self.total()
        base = next_token_loss(self.capped(full), self.tokens).mean()
        losses = []
        yield 0, len(self.terms)
        for i in range(len(self.terms)):
            losses.append(next_token_loss(self.capped(full - self.term_logits(i)), self.tokens).mean() - base)
            yield i + 1, len(self.terms)
        return torch.stack(losses)


def path_specs(cfg, max_order: int | None = None) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """The ``(source, heads)`` of every term of ``path_expansion`` for a model of config ``cfg``,
    in its order, without computing anything (e.g. to count terms before choosing ``max_order``).
    Bias sources are listed for every layer; ``path_expansion`` drops those the model lacks."""
    L, H = cfg.n_layers, cfg.n_heads
    top = L if max_order is None else max_order
    if isinstance(top, bool) or not isinstance(top, int) or not min(1, L) <= top <= L:
        raise ValueError(f"max_order must be an int in {min(1, L)}..{L} (the most heads on a path; None: {L}, "
                         f"the full expansion), got {max_order!r}")
    entering = [("embed", 0)] + [(f"bias{l}", l + 1) for l in range(L)]  # a source and the first layer reading it
    if not cfg.attn_only:
        entering += [(f"mlp{l}", l + 1) for l in range(L)]
    paths = [()]  # head paths in increasing layers, in the order the terms are listed
    for layer in range(L):
        paths += [p + ((layer, h),) for p in paths if len(p) < top for h in range(H)]
    specs = []
    for path in paths:
        first = path[0][0] if path else L
        if len(path) == top and first > 0:  # truncated: the first head reads the whole stream
            specs.append((f"stream{first}", path))
        else:  # (at layer 0 the whole stream is the embedding alone)
            specs += [(source, path) for source, enters in entering if enters <= first]
    return specs + [("b_U", ())]


def path_expansion(model, text_or_tokens, max_order: int | None = None) -> PathExpansion:
    """Exact path expansion of ``model``'s logits on ``text_or_tokens`` (module docstring).

    ``text_or_tokens``: text, token ids, or the ``RunResult`` of ``pcw.run(model, ...)``, whose
    forward pass (logits and activation cache) is then reused instead of run again.
    ``max_order``: the most heads on a path (default: ``n_layers``, the full expansion); a path
    with that many heads reads the whole stream at its first head, so the terms always sum to the
    logits (before a final soft-cap). Terms of sources a model lacks (biases, MLPs) are left out.
    Raises ``NonlinearFeatureError`` naming a feature of the model that is not linear on this run
    (``LINEARISED``). ``path_expansion_steps`` run through.
    """
    return drained(path_expansion_steps(model, text_or_tokens, max_order))


@torch.no_grad()
def path_expansion_steps(model, text_or_tokens, max_order: int | None = None):
    """``path_expansion`` in pieces (``analysis.pieces``): the forward (unless given a ``RunResult``)
    and the sources before the first piece, then one term each (its positions factor: the product of
    its heads' patterns), yielding ``(done, n_terms)``; returns the ``PathExpansion``. Each term's
    logits are ``PathExpansion.readout_steps``' pieces."""
    cfg = model.cfg
    check_path_features(cfg)
    if isinstance(text_or_tokens, RunResult):
        logits, cache = text_or_tokens.logits, text_or_tokens.cache
    else:
        logits, cache = model.run_with_cache(text_or_tokens)
    if cfg.clip_qkv is not None:
        _check_values_unclamped(model, cache)
    if cfg.final_softcap is not None:  # the linear readout the cap was applied to
        logits = model.read(cache.resid[:, -1])[0] @ model.W_U + (model.b_U if model.b_U is not None else 0)
    tokens = cache.tokens
    dtype = logits.dtype
    inv = 1.0 / ln_scales(model, cache)  # [batch, L + 1, pos]
    b, pos = tokens.shape
    eye = torch.eye(pos, dtype=dtype, device=logits.device)
    # a layer norm reads (x - mean(x)) / scale: the centering is the projection C on d_model
    # (the identity when, as after folding, every writer is already mean-zero)
    d = cfg.d_model
    C = torch.eye(d, dtype=dtype, device=logits.device) - 1.0 / d if cfg.normalization == "layernorm" else None
    center = (lambda W: W) if C is None else (lambda W: C @ W)
    read_layer = center if cfg.pre_norm else (lambda W: W)  # without pre-norms layers read the stream as is

    def post_norm(layer: int, W: torch.Tensor) -> torch.Tensor:
        """``W [.., d_model]`` as layer ``layer``'s post-attention norm passes it on (its division,
        per position, is in the positions factor): centred (layernorm), times ``w_post_attn``."""
        return W if not cfg.post_norms else (W if C is None else W @ C) * model.w_post_attn[layer]

    inv_post = 1.0 / cache.post_scale_attn if cfg.post_norms else None  # [batch, L, pos]
    sources = {"embed": cache.resid[:, 0]}
    for layer in range(cfg.n_layers):
        sources[f"stream{layer}"] = cache.resid[:, layer]
        bias = _attention_bias(model, layer)
        if bias is not None:
            bias = post_norm(layer, bias.to(dtype)).expand(b, pos, d)
            sources[f"bias{layer}"] = bias * inv_post[:, layer, :, None] if cfg.post_norms else bias
        if cache.mlp_out is not None:
            sources[f"mlp{layer}"] = cache.mlp_out[:, layer]
    if model.b_U is not None:
        sources["b_U"] = torch.ones(b, pos, 1, dtype=dtype)
    W_U = center(model.W_U)
    ov = {}  # (layer, head) -> W_OV as its layer reads it and passes it on

    def head_term(path):
        A, W = eye[None], None
        for layer, h in path:
            # the head reads the stream divided by this layer's norm: A^h D_layer A (then divided
            # by the post-norm's, per destination: P_layer A^h D_layer A)
            A = (cache.patterns[:, layer, h] * inv[:, layer, None, :]) @ A
            if cfg.post_norms:
                A = inv_post[:, layer, :, None] * A
            if (layer, h) not in ov:
                ov[layer, h] = post_norm(layer, read_layer(model.W_V[layer, h]) @ model.W_O[layer, h])
            W = ov[layer, h] if W is None else W @ ov[layer, h]
        return A, W

    terms = []
    specs = [(source, path) for source, path in path_specs(cfg, max_order) if source in sources]
    yield 0, len(specs)
    for source, path in specs:
        if source == "b_U":
            terms.append(PathTerm((), TensorProductTerm(eye[None], model.b_U[None].to(dtype)), "b_U"))
        else:
            A, W = head_term(path)
            terms.append(PathTerm(path, TensorProductTerm(inv[:, -1, :, None] * A,
                                                          W_U if W is None else FactoredMatrix(W, W_U)), source))
        yield len(terms), len(specs)
    return PathExpansion(tokens=tokens, x0=cache.resid[:, 0], terms=terms, logits=logits, sources=sources,
                         final_softcap=cfg.final_softcap)


def _check_values_unclamped(model, cache) -> None:
    """``clip_qkv``: refuse (``NonlinearFeatureError``) a run where a head's value reached the clamp
    (what the head moves is then not linear in what it reads); below it the clamp is the identity.
    The values are recomputed from the cached stream as the forward computes them."""
    cfg = model.cfg
    for layer in range(cfg.n_layers):
        x = cache.resid[:, layer]
        xn = model.read(x)[0] if cfg.pre_norm else x
        v = xn[:, None] @ model.W_V[layer]
        if model.b_V is not None:
            v = v + model.b_V[layer][:, None]
        clamped = v.abs() > cfg.clip_qkv
        if bool(clamped.any()):
            heads = sorted(set(clamped.any(-1).any(-1).nonzero()[:, 1].tolist()))
            raise NonlinearFeatureError(
                "clip_qkv", f"on this text {int(clamped.sum())} values of layer {layer} (heads {heads}) reach the "
                f"clamp at ±{cfg.clip_qkv:g}, so what those heads move is not linear in what they read and no "
                "sum of paths equals the logits; a text whose values stay inside the clamp is expanded exactly")


def _attention_bias(model, layer: int) -> torch.Tensor | None:
    """``b_O + sum_h b_V^h W_O^h`` ``[d_model]`` of one attention layer (None without biases): what the
    layer adds at every position whatever it attends to (each pattern row sums to 1)."""
    parts = []
    if model.b_O is not None:
        parts.append(model.b_O[layer])
    if model.b_V is not None:
        parts.append(torch.einsum("he,hed->d", model.b_V[layer], model.W_O[layer]))
    return sum(parts) if parts else None


def ln_scales(model, cache) -> torch.Tensor:
    """Layer-norm divisions ``[batch, n_layers + 1, pos]`` (one per attention layer, then final).

    Models without normalization divide by 1.
    """
    scale = getattr(cache, "ln_scale", None)
    if scale is None or model.cfg.normalization is None:
        b, _, pos, _ = cache.resid.shape
        return torch.ones(b, model.cfg.n_layers + 1, pos, dtype=cache.resid.dtype, device=cache.resid.device)
    return scale
