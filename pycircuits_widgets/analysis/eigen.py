"""Eigenvalue (copying) analysis of every head's full OV and full QK circuit.

Positivity of a square circuit ``M``: ``sum(lambda) / sum(|lambda|)`` in ``[-1, 1]``; near +1
the circuit maps a token to itself (OV: copying; QK: attending to the same token).

The full circuits are ``d_vocab x d_vocab`` but rank ``<= d_head``; their nonzero spectrum is
that of a ``d_head x d_head`` matrix (``eig(XY) = eig(YX)`` off zero). The vocab-sized part is
shared by all heads and multiplied once:

* OV: ``eig(W_E W_V W_O W_U) = eig(W_O (W_U W_E) W_V)``, ``W_U W_E [d_model, d_model]``;
* QK: ``eig(W_E W_Q W_K^T W_E^T) = eig(W_K^T (W_E^T W_E) W_Q)``, the Gram matrix computed
  as its upper block triangle (``factored.gram``: 58% of the full product's work).

``W_E`` is the embedding each head reads (``circuits.embedding``): normalised per token for
layer 0 where that is exact (the paper's choice), raw elsewhere.

Precision: the products run in float32 (float64 weights stay float64) and only the
``d_head x d_head`` eigenproblems in float64. By the standard GEMM bound (unit roundoff
``u = 2^-24``, ``γ_n = n u / (1 - n u)``) the spectrum computed is exactly that of ``M + E``
with ``|E| <= γ_{V + 2 d_model} |W_K|^T |W_E|^T |W_E| |W_Q|`` entrywise (OV alike with
``|W_O| |W_U| |W_E| |W_V|``): at most ``3e-3`` of the absolute product for GPT-2's
``V = 50257`` and, for the random-sign sums of real weights, about ``sqrt(V + 2 d_model) u``
(``1.4e-5``). Positivity is a ratio of two such sums; a test holds a float32 model's positivity to ``1e-6``
of the same model's in float64 at d_vocab 20000.

Read through an effective embedding (``embedding="mlp0"`` or ``"corpus"``: ``effective_embedding``), a
head of layer ``l >= 1`` reads ``E`` (``[n, d_model]``, one row per token it holds, after the layer's norm)
instead of ``W_E``: its full OV circuit is ``E W_V W_O W_U[:, tokens]`` (each token's effect on the logits
of the same tokens: square, ``n x n``) and its QK circuit ``E W_Q W_K^T E^T``; the shared middles are
``W_U[:, tokens] E`` and ``E^T E`` per layer. Layer 0 reads the embedding itself, as above.

Rotary models (``rotary``): the QK circuit at query - key offset ``o`` is ``W_E W_Q R(o) W_K^T W_E^T``,
so its spectrum is that of ``W_K^T (W_E^T W_E) W_Q R(o)``: one more ``d_head x d_head`` factor per
offset. QK spectra and positivity are read at a stated offset or over a window (``eigenvalues``,
``eigenvalue_positivity``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..factored import gram
from ..linalg import eigvals
from ..progress import steps
from .cache import MODEL, cached
from .circuits import embedding, embedding_is_normalized
from .effective_embedding import corpus_means, effective_embedding
from .finite import non_finite_error
from .rotary import matmul_rotation, offset_window, reduce_offsets, rotation_parts

KINDS = ("OV", "QK")


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind


def _compute_dtype(model) -> torch.dtype:
    """float64 for float64 weights, else float32 (half-precision weights are widened)."""
    return torch.float64 if model.dtype == torch.float64 else torch.float32


@torch.no_grad()
def token_gram(model, kind: str, layer: int | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The shared vocab-sized middle of the full circuit, ``[d_model, d_model]`` in ``dtype``.

    OV: ``W_U W_E`` (out side back to src side); QK: ``W_E^T W_E`` (key side to query side),
    symmetric, so only its upper block triangle is multiplied. ``layer``: ``W_E`` as that
    layer's heads read it (``circuits.embedding``); None: the raw ``W_E``. The vocab-sized
    contraction runs in float32 (float64 weights: float64); see the module docstring for its error.
    It runs over ``model.vocab_blocks()``, summed: one block for a ``CircuitModel``; a checkpoint view
    reads ``VOCAB_BLOCK`` tokens of ``W_E``/``W_U`` at a time, never the whole embeddings. Computed
    once per model in the working dtype (``cache``; 2.4 MB in float32 at GPT-2 shapes) and cast to
    ``dtype``: do not modify it in place.
    """
    _check_kind(kind)

    def compute():
        work, G = _compute_dtype(model), None
        for rows in model.vocab_blocks():
            W_E = model.token_rows("W_E", rows).to(work) if layer is None else embedding(model, layer, work, rows)
            part = model.token_rows("W_U", rows).to(work) @ W_E if kind == "OV" else gram(W_E)
            G = part if G is None else G.add_(part)
        return G

    return cached(model, ("token_gram", kind, layer), compute, tier=MODEL).to(dtype)


def _effective_grams(model, kind: str, embedding, sweep, work: torch.dtype) -> dict:
    """``{layer: G [d_model, d_model]}`` for layers ``1..L-1`` read through ``embedding`` ("mlp0" or "corpus":
    module docstring), in ``work``; {} for None or "raw"."""
    if embedding in (None, "raw"):
        if sweep is not None:
            raise ValueError("eigenvalues: sweep= is read by embedding='corpus' only")
        return {}
    if embedding not in ("mlp0", "corpus"):
        raise ValueError(f"eigenvalues: embedding must be None, 'raw', 'mlp0' or 'corpus', got {embedding!r}")
    grams = {}
    if embedding == "corpus" and sweep is not None:  # every layer's means in as few passes as fit (then kept)
        corpus_means(model, sweep, list(range(1, model.cfg.n_layers)))
    for layer in range(1, model.cfg.n_layers):
        found = effective_embedding(model, layer, embedding, sweep=sweep)
        E = found.vectors.to(work)
        grams[layer] = model.W_U[:, found.tokens].to(work) @ E if kind == "OV" else gram(E)
    return grams


@torch.no_grad()
def eigenvalues(model, kind: str, offset=None, embedding=None, sweep=None) -> torch.Tensor:
    """Nonzero spectrum of every head's full circuit: complex128 ``[L, H, d_head]``.

    OV: eigenvalues of ``W_E W_V W_O W_U``; QK: of ``W_E W_Q W_K^T W_E^T`` (paper:
    ``W_U W_OV W_E`` and ``W_E^T W_QK W_E``). The remaining ``d_vocab - d_head`` eigenvalues are 0.
    Rotary QK: at query - key ``offset``, ``W_E W_Q R(offset) W_K^T W_E^T``; an int gives
    ``[L, H, d_head]``, a window (default ``rotary.DEFAULT_OFFSETS``) ``[n_offsets, L, H, d_head]``.
    ``embedding``: what the heads of layers ``1..`` read (None or "raw": ``W_E``; "mlp0"; "corpus" with
    ``sweep``: module docstring). Computed once per model, window and embedding (``cache``; a corpus
    reading once per sweep): do not modify the result in place.
    """
    offsets = offset_window(model, offset, "the QK spectrum") if _check_kind(kind) == "QK" else None
    if kind == "OV" and offset is not None:
        raise ValueError("offset only applies to the QK circuit: the OV circuit does not depend on position")
    window = hasattr(offset, "__iter__") or offset is None
    work = _compute_dtype(model)
    key = ("eigenvalues", kind, None if offsets is None else tuple(offsets), window, *_reading(embedding, sweep))
    return cached(model, key, lambda: _eigenvalues(model, kind, offsets, window,
                                                   _effective_grams(model, kind, embedding, sweep, work)), tier=MODEL)


def _reading(embedding, sweep) -> tuple:
    """What a cache key names of an embedding read through: nothing for ``W_E`` (the keys of before), the
    kind, and a corpus reading's sweep (its folder and digest: a finished sweep never changes)."""
    if embedding in (None, "raw"):
        return ()
    return (embedding,) if sweep is None else (embedding, str(sweep.path), sweep.manifest["digest"])


def _eigenvalues(model, kind: str, offsets: list[int] | None, window: bool, effective: dict) -> torch.Tensor:
    """``eigenvalues`` at the validated ``offsets`` (``window``: keep the offset dimension), the layers in
    ``effective`` read through their Gram (``_effective_grams``)."""
    small = _head_circuits(model, kind, _compute_dtype(model), effective)
    if not bool(torch.isfinite(small).all()):
        # LAPACK would return NaN (printing DGEBAL to stderr) and positivity would read it as 0.0
        weights = ("W_E", "W_V", "W_O", "W_U") if kind == "OV" else ("W_E", "W_Q", "W_K")
        raise non_finite_error(f"the {kind} circuits", model, weights, small.dtype)
    if offsets is None:
        return eigvals(small.double(), f"the {kind} circuits")
    per_layer = []
    for layer in steps(range(model.cfg.n_layers), f"eigenvalues: QK over {len(offsets)} offsets", unit="layer"):
        diagonal, paired, partner = (t.to(small.device) for t in rotation_parts(model.cfg, offsets, layer=layer))
        # each head's circuit at each offset, [n_offsets, H, d_head, d_head]: one layer at a time (every
        # layer's at once is 1 GB in float64 at the LLaMA-135M shape with 100 offsets)
        rotated = matmul_rotation(small[layer].double(), (diagonal[:, None], paired[:, None], partner))
        per_layer.append(eigvals(rotated, f"the {kind} circuits of layer {layer} over {len(offsets)} offsets"))
    L, H, d_head = small.shape[:3]
    eigs = torch.stack(per_layer, 1) if per_layer else torch.empty(  # [n_offsets, L, H, d_head]
        len(offsets), L, H, d_head, dtype=torch.complex128, device=small.device)  # (a zero-layer model: none)
    return eigs if window else eigs[0]


def _head_circuits(model, kind: str, work: torch.dtype, effective: dict | None = None) -> torch.Tensor:
    """Every head's ``d_head x d_head`` rotation of its full circuit, ``[L, H, d_head, d_head]`` in ``work``:
    ``W_O G W_V`` (OV) or ``W_K^T G W_Q`` (QK), ``G`` the ``token_gram`` of the embedding the layer
    reads, or ``effective[layer]`` (an effective embedding's). Of ``W_E``, only layer 0 can read a
    different one (``circuits.embedding``), so at most two vocab-sized products. One layer at a time, all its heads in one GEMM (a batched matmul against
    ``G`` would broadcast it into one ``d_model x d_model`` copy per head): besides the two Grams
    this holds one layer's weights, which is all a checkpoint view (``from_safetensors``) reads."""
    L, H, d_head = model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_head
    out = torch.empty(L, H, d_head, d_head, dtype=work, device=model.W_V.device)
    normalized = L and embedding_is_normalized(model, 0)
    grams = {}
    for layer in range(L):
        first = normalized and layer == 0
        if layer in (effective or {}):
            G = effective[layer]
        else:
            if first not in grams:
                grams = {first: token_gram(model, kind, 0 if first else None, work)}  # layer 0's is dropped after
            G = grams[first]
        if kind == "OV":
            left, right = model.W_O[layer].to(work), model.W_V[layer].to(work)
        else:
            left, right = model.W_K[layer].to(work).mT, model.W_Q[layer].to(work)
        d_model = left.shape[-1]
        torch.matmul((left.reshape(-1, d_model) @ G).view(H, d_head, d_model), right, out=out[layer])
    return out


def positivity(eigs: torch.Tensor) -> torch.Tensor:
    """``sum(lambda) / sum(|lambda|)`` over the last dim (real; 0 for an all-zero spectrum)."""
    total = eigs.abs().sum(-1)
    return torch.where(total > 0, eigs.sum(-1).real / total.clamp_min(torch.finfo(total.dtype).tiny), 0.0)


def eigenvalue_positivity(model, kind: str = "OV", offset=None, reduce: str = "max", embedding=None,
                          sweep=None) -> torch.Tensor:
    """Positivity of every head's full OV or QK circuit: float32 ``[L, H]`` in ``[-1, 1]``.

    ``sum(lambda) / sum(|lambda|)`` of ``W_E W_V W_O W_U`` (OV, copying) or
    ``W_E W_Q W_K^T W_E^T`` (QK, same-token attention). One shared ``[d_model, d_model]``
    product, then one batched ``eig`` of ``[L, H, d_head, d_head]``. Rotary QK: at query - key
    ``offset`` (an int) or over a window (default ``rotary.DEFAULT_OFFSETS``) reduced per head by
    ``reduce``: "max" (the most positive offset; ``eigenvalue_positivity_offsets`` says which) or
    "mean" of the per-offset positivities. ``embedding``, ``sweep``: what the heads of layers ``1..`` read
    (``eigenvalues``).
    """
    return eigenvalue_positivity_offsets(model, kind, offset, reduce, embedding, sweep)[0]


def eigenvalue_positivity_offsets(model, kind: str = "OV", offset=None, reduce: str = "max", embedding=None,
                                  sweep=None):
    """``(positivity [L, H], offset [L, H] or None)``: ``eigenvalue_positivity`` and, for a rotary QK
    circuit reduced by "max" over a window, the offset each head's positivity is read at."""
    values = positivity(eigenvalues(model, kind, offset, embedding, sweep)).float()
    if values.ndim == 2:
        return values, None
    offsets = offset_window(model, offset, "the QK spectrum")
    return reduce_offsets(values, offsets, reduce)


@dataclass(frozen=True)
class HeadSpectra:
    """Every head's OV and QK spectrum, the QK side of a rotary model at each head's most positive offset
    (``best_offset_spectra``). Kept in the analysis cache: do not modify the tensors in place."""

    ov: torch.Tensor
    """complex128 [L, H, d_head]: nonzero spectrum of each head's full OV circuit."""
    qk: torch.Tensor
    """complex128 [L, H, d_head]: of each head's full QK circuit (rotary: at ``qk_offset``)."""
    ov_positivity: torch.Tensor
    """[L, H] in [-1, 1]: ``positivity`` of ``ov`` (float64)."""
    qk_positivity: torch.Tensor
    """[L, H]: ``positivity`` of ``qk`` (rotary: the largest over the window)."""
    qk_offset: torch.Tensor | None
    """int64 [L, H]: rotary models: the query - key offset each head's QK spectrum is read at, the one of
    the window where its positivity is largest; None otherwise."""


def best_offset_spectra(model, offset=None, embedding=None, sweep=None) -> HeadSpectra:
    """Every head's OV and QK spectrum and positivity (``HeadSpectra``); a rotary model's QK side over the
    window ``offset`` (default ``rotary.DEFAULT_OFFSETS``; an int: that offset), each head at the offset
    where its QK positivity is largest (``eigenvalue_positivity_offsets`` with "max"), its spectrum there.
    ``embedding``, ``sweep``: what the heads of layers ``1..`` read (``eigenvalues``). Computed once per
    model, window and embedding (``cache``)."""
    offsets = offset_window(model, offset, "the QK spectrum")
    key = ("best_offset_spectra", None if offsets is None else tuple(offsets), *_reading(embedding, sweep))
    return cached(model, key, lambda: _best_offset_spectra(model, offsets, embedding, sweep), tier=MODEL)


def _best_offset_spectra(model, offsets: list[int] | None, embedding, sweep) -> HeadSpectra:
    """``best_offset_spectra`` over the validated window (None: not rotary)."""
    ov, qk, at = eigenvalues(model, "OV", None, embedding, sweep), eigenvalues(model, "QK", offsets, embedding, sweep), None
    if offsets is not None:  # [n_offsets, L, H, d_head]: each head at its best offset
        _, at = reduce_offsets(positivity(qk), offsets, "max")
        index = torch.as_tensor([offsets.index(int(o)) for o in at.flatten()]).view(at.shape)
        qk = qk.gather(0, index[None, ..., None].expand(1, *qk.shape[1:]))[0]
    return HeadSpectra(ov=ov, qk=qk, ov_positivity=positivity(ov), qk_positivity=positivity(qk), qk_offset=at)
