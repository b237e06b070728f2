"""The paper's circuits as factored matrices (Elhage et al., 2021, "Path expansion" sections).

Row-vector convention (README, "Notation: paper → code"): ``OV = W_V @ W_O`` and ``QK = W_Q @ W_K^T``,
both ``[d_model, d_model]``; a circuit over tokens reads ``[input token, output token]``
(OV: ``[src, out]``, QK: ``[dest, src]``). The paper writes the transposes.

Every token-level circuit is returned as a ``FactoredMatrix`` split at ``d_head`` (or the
smallest inner dim), never as a dense ``d_vocab x d_vocab`` matrix: a GPT-2 one is 10 GB.
Heads are ``(layer, head)`` pairs. Layer norm is folded into the weights by the model;
what remains is the division by the norm, one scalar per position and read.

**Which embedding a circuit reads** (``embedding``): where a layer reads a stream that holds the
token embedding alone, that division is a fixed per-token scale and is applied, as the paper
does in its one-layer analysis: row ``t`` is ``W_E[t] / sigma(W_E[t])``. That is the first
read (layer 0, or the unembedding of a 0-layer model) of any model whose positions stay out of
the residual stream (Shortformer, rotary, none). Everywhere else (later layers, learned
positions) the stream also holds position or earlier heads' outputs, the division depends on
the context, and the raw ``W_E`` is used, as is the unembedding's division on the output side.
So: the full OV/QK circuits, skip-trigrams and eigenvalues of a one-layer model are exact;
those of layer-1+ heads read the raw ``W_E`` (``embedding_note`` says which, for views).
Circuits through two heads or an MLP (composition, virtual heads, MLP paths) keep the raw
``W_E`` throughout, as ``composition_detail`` and ``induction`` do for their spectra.

Paper symbol -> code:  ``W_E`` -> ``W_E [d_vocab, d_model]``;  ``W_U`` -> ``W_U [d_model, d_vocab]``;
``W_OV^h = W_O^h W_V^h`` -> ``W_V[l, h] @ W_O[l, h]``;  ``W_QK^h = W_Q^{hT} W_K^h`` ->
``W_Q[l, h] @ W_K[l, h].T``;  full OV ``W_U W_OV W_E`` -> ``W_E W_V W_O W_U``;  full QK
``W_E^T W_QK W_E`` -> ``W_E W_Q W_K^T W_E^T``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..factored import FactoredMatrix, chain_matmul, linalg_dtype
from ..models.config import short_name
from ..models.indices import check_index, check_pair
from .finite import NonFiniteError, require_finite
from .rotary import offset_window, rotations

Head = tuple[int, int]


def model_name(model) -> str:
    """How notices and errors name ``model``: ``short_name`` of its config name, else its class."""
    return short_name(getattr(getattr(model, "cfg", None), "name", "")) or type(model).__name__


def check_head(model, head: Head, name: str = "head") -> tuple[int, int]:
    """``head`` as a ``(layer, head)`` pair of ints within ``model.cfg``, or the error naming ``name``
    (``models.indices.check_pair``)."""
    if model.cfg.n_layers == 0:
        raise ValueError(f"{name}: model {model_name(model)!r} has no layers, so no heads")
    return check_pair(head, (model.cfg.n_layers, model.cfg.n_heads), where="" if name == "head" else name)


def check_earlier(model, h1: Head, h2: Head) -> tuple[tuple[int, int], tuple[int, int]]:
    """Validate a composing pair: ``h1`` must sit in an earlier layer than ``h2``."""
    h1, h2 = check_head(model, h1, "h1"), check_head(model, h2, "h2")
    if h1[0] >= h2[0]:
        raise ValueError(
            f"composition needs h1 in an earlier layer than h2, got h1={h1} and h2={h2}"
        )
    return h1, h2


def refuse_rotary_qk(model, what: str) -> None:
    """Rotary QK circuits depend on the relative position: a token x token matrix would lie."""
    if model.cfg.positional == "rotary":
        raise ValueError(
            f"{what} is not defined for rotary models: the query-key product depends on the "
            "relative position of the tokens, so there is no single token x token QK circuit"
        )


def query_rotation(model, offset, what: str, layer: int | None) -> torch.Tensor | None:
    """What a rotary QK circuit's query side in ``layer`` is multiplied by, ``[d_head, d_head]``
    (``layer=None``: every layer's, ``[n_layers, 1, d_head, d_head]``, to broadcast over heads; None when
    the model is not rotary): ``R(offset)`` for an int, the mean of ``R`` over a window (the circuit
    averaged over those offsets; default ``rotary.DEFAULT_OFFSETS``), in the weights' dtype."""
    offsets = offset_window(model, offset, what)
    if offsets is None:
        return None
    R = rotations(model.cfg, offsets, layer=layer).mean(0)
    return (R if layer is not None else R[:, None]).to(dtype=model.W_Q.dtype, device=model.W_Q.device)


def _rotated(query: torch.Tensor, R: torch.Tensor | None) -> torch.Tensor:
    return query if R is None else query @ R


def _head_slice(W: torch.Tensor, layer, head) -> torch.Tensor:
    """``W[layer, head]`` with ``None`` meaning all layers / heads (leading dims kept); ``W`` is
    ``[n_layers, n_heads, ...]`` and the indices are checked against it."""
    W = W if layer is None else W[check_index(layer, "layer", W.shape[0])]
    if head is None:
        return W
    return W[..., check_index(head, "head", W.shape[-3]), :, :]


def ov(model, layer: int | None = None, head: int | None = None) -> FactoredMatrix:
    """``W_OV = W_V W_O`` ``[..., d_model, d_model]``; ``None`` keeps all layers / heads."""
    return FactoredMatrix(_head_slice(model.W_V, layer, head), _head_slice(model.W_O, layer, head))


def qk(model, layer: int | None = None, head: int | None = None) -> FactoredMatrix:
    """``W_QK = W_Q W_K^T`` ``[..., d_model (query side), d_model (key side)]``."""
    return FactoredMatrix(_head_slice(model.W_Q, layer, head), _head_slice(model.W_K, layer, head).mT)


def embedding_is_normalized(model, layer: int) -> bool:
    """Whether ``embedding(model, layer)`` applies the per-token norm division (exact there)."""
    cfg = model.cfg
    # pre_norm False (post-norm models): layers read the stream undivided, only the unembedding divides
    reads_normalized = cfg.pre_norm or layer == cfg.n_layers
    return layer == 0 and reads_normalized and cfg.normalization is not None and cfg.positional != "learned"


def embedding(model, layer: int, dtype: torch.dtype | None = None, rows: slice | None = None) -> torch.Tensor:
    """The token embedding as the heads of ``layer`` read it, ``[d_vocab, d_model]``
    (``layer == n_layers``: as the unembedding reads it; ``rows``: only that block of token ids,
    ``model.token_rows``).

    Where that is exact (``embedding_is_normalized``: the first read, positions outside the
    residual stream) each row is normalised as the model's forward normalises it,
    ``W_E[t] / sigma(W_E[t])`` (centred first for layer norm; the same ``eps``): the per-token
    scale the paper applies. Elsewhere the raw ``W_E`` (module docstring). Returned in ``dtype``
    (default: ``W_E``'s); the division of 16-bit weights runs in float32 (``linalg_dtype``).
    Refuses a division that overflows (``finite.NonFiniteError``): ``x / inf`` reads as a zero row
    (NaN/inf in ``W_E`` itself passes through, for the caller's check to name the circuit).
    """
    if not 0 <= layer <= model.cfg.n_layers:
        raise ValueError(f"layer must be in 0..{model.cfg.n_layers} (n_layers: the unembedding), got {layer}")
    W_E = model.W_E if rows is None else model.token_rows("W_E", rows)  # once: a checkpoint view reads it
    dtype = dtype or W_E.dtype
    if not embedding_is_normalized(model, layer):
        return W_E.to(dtype)
    work = linalg_dtype(W_E.dtype)
    normed, scale = model.read(W_E.to(work), work)
    if not bool(torch.isfinite(scale).all()) and bool(torch.isfinite(W_E).all()):
        raise NonFiniteError(
            f"the normalised embedding is not finite: the norm of W_E's rows overflows {scale.dtype} "
            f"(largest |W_E| entry {float(W_E.abs().max()):.3g}; squares above "
            f"{torch.finfo(scale.dtype).max:.3g} overflow). Rescale W_E, or convert the model to float64")
    return normed.to(dtype)


def embedding_note(model) -> str:
    """One sentence for views: which embedding the token circuits of ``model`` read."""
    cfg = model.cfg
    if cfg.normalization is None:
        return "Token circuits read W_E as is (this model has no normalization)."
    if cfg.positional == "learned":
        return ("Token circuits read the raw W_E: learned positions share the residual stream, so the "
                "layer norm's division depends on the position and is left out.")
    if cfg.n_layers <= 1:
        return ("Token circuits read W_E divided by its layer norm's per-token scale, as the paper does: exact, "
                "since the stream this model's layer reads holds the token embedding alone.")
    return ("Layer 0 circuits read W_E divided by its layer norm's per-token scale (exact: the stream there is the "
            "embedding alone); later layers read the raw W_E (their division depends on the context).")


def _embed(model, W: torch.Tensor, layer, head) -> torch.Tensor:
    """``embedding(model, l) @ W[l, h]`` for one head, or for every layer/head (``None``) without
    stacking a ``[L, d_vocab, d_model]`` embedding: raw for all, then layer 0 redone."""
    W = _head_slice(W, layer, head)
    if layer is not None:
        return embedding(model, check_index(layer, "layer", model.cfg.n_layers)) @ W
    out = model.W_E @ W
    if embedding_is_normalized(model, 0):
        out[0] = embedding(model, 0) @ W[0]
    return out


def direct_path(model) -> FactoredMatrix:
    """Direct path / bigram table ``embedding W_U`` ``[token, next-token logit]`` (exact for a
    0-layer model: the unembedding reads the normalised embedding, see ``embedding``)."""
    return FactoredMatrix(embedding(model, model.cfg.n_layers), model.W_U)


def full_ov_circuit(model, layer: int | None = None, head: int | None = None) -> FactoredMatrix:
    """Full OV circuit ``W_E W_V W_O W_U`` ``[..., src token, out token]``, split at d_head.

    Paper: ``W_U W_OV^h W_E``. How attending to ``src`` changes the logit of ``out``.
    ``W_E`` is ``embedding(model, layer)`` (normalised per token where exact).
    With ``layer``/``head`` ``None`` the factors carry ``[L, H]`` leading dims (each factor is
    ``[L, H, d_vocab, d_head]``: mind the memory at GPT-2 scale). Refuses factors that overflow
    or read NaN/inf weights (``finite.NonFiniteError``, naming which).
    """
    W_O = _head_slice(model.W_O, layer, head)
    weights = ("W_E", "W_V", "W_O", "W_U")
    return FactoredMatrix(*(require_finite(f, "the full OV circuit's factors", model, weights)
                            for f in (_embed(model, model.W_V, layer, head), W_O @ model.W_U)))


def full_qk_circuit(model, layer: int | None = None, head: int | None = None, offset=None) -> FactoredMatrix:
    """Full QK circuit ``W_E W_Q W_K^T W_E^T`` ``[..., dest token, src token]``, split at d_head.

    Paper: ``W_E^T W_QK^h W_E``. The token-token part of the attention score (before the
    ``1/attn_scale``); positional terms are separate (``positional_qk_circuit``). ``W_E`` is
    ``embedding(model, layer)`` on both sides. Rotary models: ``W_E W_Q R W_K^T W_E^T`` with ``R``
    from ``query_rotation`` (``offset``: an int, or a window averaged; default ``rotary.DEFAULT_OFFSETS``).
    """
    R = query_rotation(model, offset, "the full QK circuit", layer)
    weights = ("W_E", "W_Q", "W_K")
    return FactoredMatrix(*(require_finite(f, "the full QK circuit's factors", model, weights)
                            for f in (_rotated(_embed(model, model.W_Q, layer, head), R),
                                      _embed(model, model.W_K, layer, head).mT)))


def k_composition_circuit(model, h1: Head, h2: Head, offset=None) -> FactoredMatrix:
    """QK term of ``h2`` whose key side reads ``h1``'s output: ``[dest token, token h1 moved]``.

    ``W_E W_Q^{h2} W_K^{h2 T} (W_E W_V^{h1} W_O^{h1})^T`` (paper: ``W_E^T W_QK^{h2} W_OV^{h1} W_E``
    with the key side through ``h1``). Entry ``[t, s]``: score from a query on token ``t`` to a
    key position whose ``h1`` attended to a token ``s``. With ``h1`` a previous-token head this
    is the induction mechanism, and a large positive diagonal (dest token == previous token of
    the key) means "attend to the token after an earlier copy of me". Rotary models: ``h2``'s query
    side times ``query_rotation(model, offset)`` (the offset between ``h2``'s query and key).
    """
    (l1, i1), (l2, i2) = check_earlier(model, h1, h2)
    R = query_rotation(model, offset, "the K-composition QK circuit", l2)
    query = _rotated(model.W_E @ model.W_Q[l2, i2], R)
    key = chain_matmul(model.W_E, model.W_V[l1, i1], model.W_O[l1, i1], model.W_K[l2, i2])
    return FactoredMatrix(query, key.mT)


def q_composition_circuit(model, h1: Head, h2: Head, offset=None) -> FactoredMatrix:
    """QK term of ``h2`` whose query side reads ``h1``'s output: ``[token h1 moved, src token]``.

    ``(W_E W_V^{h1} W_O^{h1}) W_Q^{h2} W_K^{h2 T} W_E^T``. Rotary models: ``h2``'s query side times
    ``query_rotation(model, offset)``.
    """
    (l1, i1), (l2, i2) = check_earlier(model, h1, h2)
    R = query_rotation(model, offset, "the Q-composition QK circuit", l2)
    query = _rotated(chain_matmul(model.W_E, model.W_V[l1, i1], model.W_O[l1, i1], model.W_Q[l2, i2]), R)
    return FactoredMatrix(query, (model.W_E @ model.W_K[l2, i2]).mT)


def virtual_head_ov(model, h1: Head, h2: Head) -> FactoredMatrix:
    """Virtual attention head (V-composition) ``W_OV^{h1} W_OV^{h2}`` ``[d_model, d_model]``.

    Paper: ``W_OV^{h2} W_OV^{h1}``; its attention pattern is ``A^{h2} A^{h1}``.
    """
    (l1, i1), (l2, i2) = check_earlier(model, h1, h2)
    return FactoredMatrix(model.W_V[l1, i1], chain_matmul(model.W_O[l1, i1], model.W_V[l2, i2], model.W_O[l2, i2]))


def full_virtual_ov_circuit(model, h1: Head, h2: Head) -> FactoredMatrix:
    """Full OV circuit of a virtual head ``W_E W_OV^{h1} W_OV^{h2} W_U`` ``[src token, out token]``."""
    (l1, i1), (l2, i2) = check_earlier(model, h1, h2)
    left = model.W_E @ model.W_V[l1, i1]
    right = chain_matmul(model.W_O[l1, i1], model.W_V[l2, i2], model.W_O[l2, i2], model.W_U)
    return FactoredMatrix(left, right)


def require_mlp(model, layer: int) -> None:
    """Refuse an attention-only model (it has no MLP paths) or a layer outside ``0..n_layers-1``."""
    cfg = model.cfg
    if cfg.attn_only or getattr(model, "W_in", None) is None:
        raise ValueError(f"model {model_name(model)!r} is attention-only: it has no MLP paths")
    check_index(layer, "mlp layer", cfg.n_layers)


def mlp_reader(model, layer: int, gate: bool) -> torch.Tensor:
    """``W_in[layer]`` or, with ``gate``, ``W_gate[layer]`` ``[d_model, d_mlp]`` (gated MLPs read the
    stream twice: ``act(x W_gate) * (x W_in)``)."""
    if not gate:
        return model.W_in[layer]
    if model.W_gate is None:
        raise ValueError(f"model {model_name(model)!r} has no gated MLP: there is no W_gate (use gate=False)")
    return model.W_gate[layer]


def mlp_in_circuit(model, layer: int, gate: bool = False) -> FactoredMatrix:
    """Token -> neuron pre-activation ``W_E W_in`` ``[token, neuron]`` (paper appendix; ``gate``: the
    gate's ``W_E W_gate`` of a gated MLP)."""
    require_mlp(model, layer)
    return FactoredMatrix(model.W_E, mlp_reader(model, layer, gate))


def head_mlp_circuit(model, head: Head, mlp_layer: int, gate: bool = False) -> FactoredMatrix:
    """Token -> neuron through a head's OV: ``W_E W_V W_O W_in`` ``[src token, neuron]`` (``gate``: into
    ``W_gate``)."""
    layer, h = check_head(model, head)
    require_mlp(model, mlp_layer)
    if mlp_layer < layer:
        raise ValueError(f"MLP layer {mlp_layer} reads before head {head} writes; need mlp_layer >= {layer}")
    return FactoredMatrix(model.W_E @ model.W_V[layer, h], model.W_O[layer, h] @ mlp_reader(model, mlp_layer, gate))


def mlp_out_circuit(model, layer: int) -> FactoredMatrix:
    """Neuron -> logits ``W_out W_U`` ``[neuron, out token]`` (paper appendix)."""
    require_mlp(model, layer)
    return FactoredMatrix(model.W_out[layer], model.W_U)


def positional_qk_circuit(model, layer: int | None = None, head: int | None = None) -> FactoredMatrix:
    """Position -> position QK circuit ``W_pos W_Q W_K^T W_pos^T`` ``[..., dest pos, src pos]``.

    For Shortformer models (``W_pos`` added to the inputs of ``W_Q``/``W_K`` only) and
    learned absolute positions. A previous-token head shows a large sub-diagonal
    (``[p, p - 1]``). Refuses rotary models and models without ``W_pos``.
    """
    refuse_rotary_qk(model, "the positional QK circuit")
    if getattr(model, "W_pos", None) is None:
        raise ValueError(f"model {model_name(model)!r} has no positional table W_pos (positional={model.cfg.positional!r})")
    W_Q, W_K = _head_slice(model.W_Q, layer, head), _head_slice(model.W_K, layer, head)
    return FactoredMatrix(model.W_pos @ W_Q, (model.W_pos @ W_K).mT)


@dataclass(frozen=True)
class TensorProductTerm:
    """A path-expansion term ``A ⊗ W`` in the paper's tensor-product notation.

    ``A [..., dest, src]`` mixes positions (an attention pattern or a product of them);
    ``W [d_in, d_out]`` acts on the residual dimension, a tensor or a ``FactoredMatrix`` (a path's
    ``W_OV ... W_U`` kept as ``(W_OV ...) @ W_U``: at GPT-2 size a dense ``[d_model, d_vocab]`` per
    term is 154 MB, 26 GB for its 170 terms). On row-convention activations
    ``x [..., src, d_in]``: ``(A ⊗ W) x = A @ x @ W`` ``[..., dest, d_out]``. Read as one
    linear map on ``x`` flattened row-major, it is the Kronecker product ``kron(A, W^T)``.
    """

    A: torch.Tensor
    W: torch.Tensor | FactoredMatrix

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``A @ x @ W``: ``x [..., src, d_in]`` -> ``[..., dest, d_out]``."""
        if x.shape[-2] != self.A.shape[-1] or x.shape[-1] != self.W.shape[0]:
            raise ValueError(
                f"TensorProductTerm with A {tuple(self.A.shape)} and W {tuple(self.W.shape)} needs "
                f"x [..., {self.A.shape[-1]}, {self.W.shape[0]}], got {tuple(x.shape)}"
            )
        W = self.W
        if isinstance(W, FactoredMatrix):  # through its inner dimension: [d_in, d_out] is never formed
            return (self.A @ (x @ W.A)) @ W.B
        # multiply the cheaper side first; both orders are the same map
        return self.A @ (x @ W) if W.shape[1] <= W.shape[0] else (self.A @ x) @ W

    def then(self, other: TensorProductTerm) -> TensorProductTerm:
        """``other ∘ self = (A_o A_s) ⊗ (W_s W_o)``: the path that goes through self, then other."""
        return TensorProductTerm(other.A @ self.A, self.W @ other.W)

    def kron(self) -> torch.Tensor:
        """Dense ``[dest * d_out, src * d_in]`` matrix of the map on row-major-flattened ``x``."""
        if self.A.ndim != 2:
            raise ValueError(f"kron() needs a single 2-D A, got A of shape {tuple(self.A.shape)}")
        W = self.W.AB if isinstance(self.W, FactoredMatrix) else self.W
        return torch.kron(self.A, W.T.contiguous())
