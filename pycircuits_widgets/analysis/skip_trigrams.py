"""Skip-trigrams ``[source] ... [destination] -> [out]`` of one attention head.

A one-layer attention-only model is exactly the direct path plus, per head, a full QK
circuit ``W_E W_Q W_K^T W_E^T [dest, src]`` (where to attend) and a full OV circuit
``W_E W_V W_O W_U [src, out]`` (what attending does to the logits) (paper: one-layer section).

Scoring (ours; the paper reads the two tables side by side):

* ``qk = QK[dest, src] - mean_s QK[dest, s]``: the attention logit of ``src`` from ``dest``
  relative to the average source (softmax over sources ignores a per-row shift);
* ``ov = OV[src, out] - mean_o OV[src, o]``: the logit ``src`` adds to ``out`` relative to the
  average token (softmax over the vocabulary ignores a per-row shift);
* ``score = qk * ov`` over triples with ``qk > 0`` and ``ov > 0`` (``dest`` attends to ``src``
  more than average AND attending raises ``out``). The top-k triples by ``score`` are exact.

``W_E`` is ``circuits.embedding(model, layer)``: for a one-layer model (and layer 0 of any
model whose positions stay out of the residual stream) each token's embedding divided by its
layer-norm scale, exactly what the head reads, as in the paper; raw ``W_E`` for later layers.

Both centrings are rank-preserving factor edits (subtract the mean key / mean unembedding
column), so the circuits stay factored. Nothing ``d_vocab x d_vocab`` is ever formed.

Exact top-k at GPT-2 scale (``d_vocab`` 50257) in bounded memory: a triple from source ``s``
scores at most ``maxQK(s) * maxOV(s)``. Sources are visited in order of the norm bound
``||k_s|| max_d ||q_d|| * ||v_s|| max_o ||u_o||`` (stopping once it falls below the running k-th
score), their row maxima are first estimated with a low-precision GEMM (``screen.ProductScreen``
on the route its per-machine probe found exact: int8, int8 with 7-bit weights on AVX2-only CPUs,
bfloat16 or float32) plus a rigorous error margin (an upper bound), and only sources whose upper bound beats the k-th score are recomputed in
full precision. Row blocks keep memory at ``block_bytes`` per block.

For deeper models only the direct-path (one-layer) terms of a head are read this way: it
ignores composition, so ``skip_trigrams`` refuses unless ``approximate=True``.

Rotary models (``rotary``): the QK circuit at query - key offset ``o`` is
``W_E W_Q R(o) W_K^T W_E^T``, i.e. the query factor ``q R(o)``. At one offset the table is exact as
above. Over a window, ``reduce="max"`` scores each triple at its strongest offset (reported per
triple). Since the OV factor does not depend on the offset and is positive in every scored triple,
``max_o qk_o * ov = (max_o qk_o) * ov``: the table is the exact top-k of one circuit whose QK entry
is ``QKmax[dest, src] = max_o q_dest R(o) . k_src``, searched once: the OV screen once, one screen of
a bound on the whole window (``window_bound``: the mean rotation plus, per frequency pair, how far
the window turns it), and the keys ``k R(o)^T`` of every offset against one quantised query set
only for the sources that bound leaves, and only on the tiles of destinations where it leaves room.
``reduce="mean"`` reads the QK circuit averaged over the window, ``q mean_o R(o)``, one exact table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..linalg import spectral_norm
from ..progress import steps
from ..screen import ProductScreen
from .cache import FACTORS, RESULT, cached, holds, keeper, stored
from .circuits import check_head, check_index, embedding, model_name
from .effective_embedding import EffectiveEmbedding, effective_embedding
from .finite import NonFiniteError, naming_non_finite, non_finite_error
from .pieces import drained, whole
from .rotary import check_reduce, offset_window, rotations

WEIGHTS = ("W_E", "W_Q", "W_K", "W_V", "W_O", "W_U")
"""The weights a head's skip-trigrams read (named when a result is not finite)."""

BLOCK_BYTES = 8 << 20
"""Bytes of one full-precision row block. Under glibc's mmap threshold cap (32 MiB), so the
allocator reuses one block's pages for the next instead of faulting in fresh ones per block:
8 MiB blocks cut the exact recompute 0.40 -> 0.20 s CPU at d_vocab 50257 (1 thread)."""
MODES = ("attends_to", "attended_by", "copies_to")
SEED_SOURCES = 256


@dataclass(frozen=True)
class SkipTrigram:
    """One ``[source] ... [destination] -> [out]`` triple of a head; see module docstring for scores."""

    source: int
    destination: int
    out: int
    source_str: str
    destination_str: str
    out_str: str
    qk: float
    ov: float
    score: float
    offset: int | None = None
    """Rotary models: the query - key offset ``qk`` and ``score`` are read at (None: not rotary, or
    ``reduce="mean"`` over a window)."""


@dataclass(frozen=True)
class HeadTable:
    """One head's top skip-trigrams as columns, best first (``head_table``): each column ``[n]``, ``n <= k``
    (fewer when fewer triples have both factors positive). Kept in the analysis cache: do not modify
    the tensors in place."""

    layer: int
    head: int
    source: torch.Tensor
    """int64 [n]: token id of each triple's source (the attended-to token)."""
    destination: torch.Tensor
    """int64 [n]: token id of the destination (the attending token)."""
    out: torch.Tensor
    """int64 [n]: token id of the out token whose logit attending raises."""
    qk: torch.Tensor
    """float32 [n]: the centred QK entry ``QKc[dest, src]`` (rotary: at ``offset``, or window-averaged)."""
    ov: torch.Tensor
    """float32 [n]: the centred OV entry ``OVc[src, out]``."""
    score: torch.Tensor
    """float32 [n]: ``qk * ov``, descending."""
    offset: torch.Tensor | None
    """int64 [n]: rotary models read over a window with ``reduce="max"``: the query - key offset of each
    triple's ``qk``; None otherwise."""
    offsets: tuple[int, ...] | None
    """The window the QK circuit was read over (None: not rotary)."""
    progress: float
    """Fraction of the sources searched: 1.0 for the exact table; less for a partial one (``sources``)."""

    @property
    def exact(self) -> bool:
        """Whether this is the exact top-k (every source searched)."""
        return self.progress >= 1.0


def _check_embedding(model, layer: int, embedding) -> EffectiveEmbedding | None:
    """``embedding`` (``skip_trigrams``) as an ``EffectiveEmbedding`` of ``layer``, or None for ``W_E``."""
    if embedding is None or embedding == "raw":
        return None
    if isinstance(embedding, str):
        if embedding == "corpus":
            raise ValueError("embedding='corpus' reads a sweep: pass embedding=pcw.effective_embedding(model, layer, "
                             "'corpus', sweep=...)")
        if embedding != "mlp0":
            raise ValueError(f"embedding must be None, 'raw', 'mlp0' or an EffectiveEmbedding, got {embedding!r}")
        return effective_embedding(model, layer, "mlp0")
    if not isinstance(embedding, EffectiveEmbedding):
        raise TypeError(f"embedding must be None, 'raw', 'mlp0' or an EffectiveEmbedding, got {type(embedding).__name__}")
    if embedding.layer != layer or embedding.vectors.shape[-1] != model.cfg.d_model:
        raise ValueError(f"embedding: an effective embedding of layer {embedding.layer} (d_model "
                         f"{embedding.vectors.shape[-1]}) for a head of layer {layer} of this model (d_model "
                         f"{model.cfg.d_model}): compute it with effective_embedding(model, {layer}, ...)")
    return None if embedding.kind == "raw" else embedding


def _check_exact(model, layer: int, head: int, approximate: bool) -> tuple[int, int]:
    """The checked ``(layer, head)``; refused where the table is not exact unless ``approximate``."""
    layer, head = check_head(model, (layer, head))
    cfg = model.cfg
    exact = cfg.n_layers == 1 and cfg.attn_only
    if not exact and not approximate:
        raise ValueError(
            f"skip-trigrams are exact only for one-layer attention-only models; {model_name(model)!r} has "
            f"{cfg.n_layers} layers{'' if cfg.attn_only else ' and MLPs'}. Pass approximate=True "
            "to read this head's direct-path circuits (W_E ... W_U), which ignore composition"
        )
    return layer, head


def centred_factors(model, layer: int, head: int, vocab: torch.Tensor | None = None,
                    reads: torch.Tensor | None = None):
    """Factors of the centred circuits, float32: ``(q [V, d_head], k [V, d_head], v [V, d_head], u [d_head, V])``.

    ``QKc = q @ k.T`` ``[dest, src]`` and ``OVc = v @ u`` ``[src, out]`` (see module docstring).
    ``vocab`` (token ids) restricts all three roles to a sub-vocabulary, ``V = len(vocab)``,
    and the centring means run over it. ``reads [V, d_model]`` (with ``vocab``): what the head reads for
    each of those tokens instead of the embedding (an effective embedding's vectors). The whole
    vocabulary's factors are kept per model and head (``cache``; 51 MB a head at GPT-2 shapes): do not
    modify them in place.
    """
    if vocab is not None:
        return (*_qk_factors(model, layer, head, vocab, reads), *_ov_factors(model, layer, head, vocab, reads))
    layer, head = check_head(model, (layer, head))
    ov = _kept_ov_factors(model, layer, head)  # first: what copied_tokens, on another thread, waits for
    qk = cached(model, ("qk_factors", layer, head), lambda: _qk_factors(model, layer, head, None), tier=FACTORS)
    return (*qk, *ov)


def _kept_ov_factors(model, layer: int, head: int):
    """``(v, u)`` of the whole vocabulary, kept per model and head (``cache``)."""
    layer, head = check_head(model, (layer, head))
    return cached(model, ("ov_factors", layer, head), lambda: _ov_factors(model, layer, head, None), tier=FACTORS)


def _read_embedding(model, layer: int, vocab: torch.Tensor | None, reads: torch.Tensor | None = None) -> torch.Tensor:
    if reads is not None:
        return reads.float()
    W_E = embedding(model, layer, torch.float32)  # per-token scale where exact
    return W_E if vocab is None else W_E[vocab]


def _qk_factors(model, layer: int, head: int, vocab: torch.Tensor | None, reads: torch.Tensor | None = None):
    """``(q, k)`` of the centred QK circuit (``centred_factors``)."""
    weights = [model.W_Q[layer, head], model.W_K[layer, head]]
    # one GEMM for both reads (a wider product runs faster than two thin ones)
    q, k = (_read_embedding(model, layer, vocab, reads) @ torch.cat(weights, 1).float()).split(
        [w.shape[-1] for w in weights], 1)
    return _finite(model, layer, head, q.contiguous(), k - k.mean(0, keepdim=True))


def _ov_factors(model, layer: int, head: int, vocab: torch.Tensor | None, reads: torch.Tensor | None = None):
    """``(v, u)`` of the centred OV circuit (``centred_factors``)."""
    W_U = model.W_U.float() if vocab is None else model.W_U.float()[:, vocab]
    v = _read_embedding(model, layer, vocab, reads) @ model.W_V[layer, head].float()
    u = model.W_O[layer, head].float() @ W_U
    return _finite(model, layer, head, v, u - u.mean(1, keepdim=True))


def _finite(model, layer: int, head: int, *factors: torch.Tensor) -> tuple:
    """``factors``, refused if any entry is not finite."""
    # min and max propagate NaN and show +-inf: one cheap pass instead of a bool tensor per factor
    if not bool(torch.isfinite(torch.stack([torch.stack(torch.aminmax(f)) for f in factors])).all()):
        # NaN compares false everywhere: the top-k would silently come back empty
        raise non_finite_error(f"the circuits of L{layer}.H{head}", model, WEIGHTS, factors[0].dtype)
    return factors


class _TopTriples:
    """Running exact top-k of ``(score, src, dest, out, at)``; ``threshold`` is the k-th score (0 until
    there are k)."""

    def __init__(self, k: int, device: torch.device):
        self.k = k
        self.score = torch.empty(0, device=device)
        self.idx = torch.empty(0, 4, dtype=torch.long, device=device)

    @property
    def threshold(self) -> float:
        return float(self.score.min()) if self.score.numel() >= self.k else 0.0

    def add(self, score: torch.Tensor, idx: torch.Tensor) -> None:
        self.score = torch.cat([self.score, score])
        self.idx = torch.cat([self.idx, idx])
        if self.score.numel() > self.k:
            self.score, keep = torch.topk(self.score, self.k)
            self.idx = self.idx[keep]


def _staircase(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs ``(i, j)`` of ranks with ``(i + 1) (j + 1) <= n`` (about ``n ln n`` of them).

    In the outer product of two descending non-negative lists, entry ``(i, j)`` is beaten or
    tied by the ``(i + 1) (j + 1)`` entries above-left of it, so only these pairs can be top-n.
    """
    i = torch.arange(n, device=device).repeat_interleave(torch.tensor([n // (a + 1) for a in range(n)], device=device))
    j = torch.cat([torch.arange(n // (a + 1), device=device) for a in range(n)])
    return i, j


def _exact_sources(src, q, k, v, u, R, top: _TopTriples) -> None:
    """Add every triple of sources ``src`` that can enter ``top`` (full-precision rows; ``R``: see
    ``top_skip_trigrams``)."""
    if R is None:
        qk_rows = k[src] @ q.T  # [n, dest]
    else:  # each (src, dest) at its strongest offset: q R k^T = q (k R^T)^T, a running max in place
        keys = k[src]
        qk_rows = (keys @ R[0].T) @ q.T
        for Rt in R[1:]:
            torch.maximum(qk_rows, (keys @ Rt.T) @ q.T, out=qk_rows)
    ov_rows = v[src] @ u  # [n, out]
    mq, mo = qk_rows.amax(1).clamp_min(0), ov_rows.amax(1).clamp_min(0)
    bound = mq * mo  # every score of a source is at most this (NaN if a row holds NaN)
    if not bool(torch.isfinite(bound).all()):
        raise NonFiniteError(f"the skip-trigram scores overflow {bound.dtype} (a QK or OV circuit entry, or "
                             "their product, exceeds its range)")
    tau = top.threshold
    live = bound > tau
    if not live.any():
        return
    if not live.all():  # (a copy of the rows: skip it when every source is live)
        src, qk_rows, ov_rows, mq, mo = src[live], qk_rows[live], ov_rows[live], mq[live], mo[live]
    n = min(top.k, qk_rows.shape[1])
    qv, qi = torch.topk(qk_rows, n, dim=1)  # sorted, so a prefix is each row's top n_q
    ov, oi = torch.topk(ov_rows, n, dim=1)
    n_q = n_o = n
    if tau > 0:  # a (dest, out) pair can only beat tau if each factor beats tau / (the other's max)
        n_q = int((qv * mo[:, None] > tau).sum(1).max().clamp_min(1))
        n_o = int((ov * mq[:, None] > tau).sum(1).max().clamp_min(1))
    qv, qi, ov, oi = qv[:, :n_q], qi[:, :n_q], ov[:, :n_o], oi[:, :n_o]
    i, j = _staircase(top.k, qv.device)
    keep = (i < n_q) & (j < n_o)
    i, j = i[keep], j[keep]
    score = qv[:, i].clamp_min(0) * ov[:, j].clamp_min(0)  # [n, pairs]; 0 unless both positive
    best, flat = torch.topk(score.flatten(), min(top.k, score.numel()))
    ok = best > tau
    s_i, p = flat[ok] // i.numel(), flat[ok] % i.numel()
    source, dest = src[s_i], qi[s_i, i[p]]
    # the offset of each kept (src, dest): its entry at every offset, the largest (a tie within
    # rounding of the running max takes either offset, both at the triple's score)
    at = torch.zeros_like(dest) if R is None else torch.einsum("nr,trs,ns->tn", q[dest], R, k[source]).argmax(0)
    top.add(best[ok], torch.stack([source, dest, oi[s_i, j[p]], at], 1))


def window_bound(q: torch.Tensor, k: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``(qw [V, r + n_b], kw [V', r + n_b])`` of one bound on a whole window of maps:
    ``max_t q_d R[t] . k_s <= qw_d . kw_s`` for every destination ``d`` and source ``s``.

    ``R [n_maps, r, r]`` is block-diagonal (rotary: a 2 x 2 rotation per frequency pair, the identity
    elsewhere); ``Rbar = mean_t R[t]`` and, per block ``b`` (dims ``I_b``), ``rho_b = max_t ||(R[t] -
    Rbar)[I_b, I_b]||_2``. Then ``q R[t] k = q Rbar k + sum_b q_b (R[t] - Rbar)_b k_b
    <= q Rbar k + sum_b rho_b ||q_b|| ||k_b||``: ``qw = [q Rbar, rho_b ||q_b||]``, ``kw = [k, ||k_b||]``
    (blocks with ``rho_b = 0``, which every map moves alike, are left out). Slow pairs rotate little
    over the window, so their ``rho_b`` is small and the bound is close to the window's maximum."""
    pattern = (R != 0).any(0)
    pattern = pattern | pattern.T
    label = torch.arange(R.shape[-1])
    for _ in range(R.shape[-1]):  # connected components: each dim takes the smallest label it touches
        spread = torch.minimum(label, torch.where(pattern, label[None, :], R.shape[-1]).amin(1))
        if torch.equal(spread, label):
            break
        label = spread
    Rbar = R.mean(0)
    q_parts, k_parts = [q @ Rbar], [k]
    for b in label.unique():
        dims = (label == b).nonzero().flatten()
        rho = float(spectral_norm((R - Rbar)[:, dims][:, :, dims], "a rotary block's turn over the window").max())
        if rho > 0:
            q_parts.append(rho * q[:, dims].norm(dim=1, keepdim=True))
            k_parts.append(k[:, dims].norm(dim=1, keepdim=True))
    return torch.cat(q_parts, 1), torch.cat(k_parts, 1)


def top_skip_trigrams(q, k, v, u, n: int, block_bytes: int = BLOCK_BYTES, R: torch.Tensor | None = None):
    """Exact top-``n`` of ``(q_d . k_s) * (v_s . u_o)`` over positive factors.

    ``R [n_offsets, r, r]`` (rotary, optional): the QK factor of a triple is its largest over the window,
    ``max_t q_d R[t] . k_s`` (with ``v_s . u_o > 0`` the score's maximum over offsets is at that
    offset). One search for the whole window: every source is screened once against one bound on the
    whole window (``window_bound``, per tile of destinations) and once on the OV side; only the sources
    that bound leaves are screened at every offset (their keys ``k R[t]^T`` against one quantised query
    set), on the destination tiles where it leaves room (~1 in 8 at the LLaMA-135M shape).

    Returns ``(score [n'], idx [n', 3] = (src, dest, out), at [n'])`` sorted by score, ``n' <= n``
    (fewer if fewer triples have both factors positive); ``at`` indexes ``R`` (zeros without it).
    See module docstring for the method; ``top_skip_trigrams_steps`` run through.
    """
    return drained(top_skip_trigrams_steps(q, k, v, u, n, block_bytes, R))


SEARCH_STAGES = ("screen", "offsets", "exact")
"""The stages of ``top_skip_trigrams_steps``, in order: the screen of every source's bounds, block by
block; (rotary) the per-offset screen of the sources the window bound leaves; the full-precision
recompute of the sources whose bound beats the k-th score."""


def top_skip_trigrams_steps(q, k, v, u, n: int, block_bytes: int = BLOCK_BYTES, R: torch.Tensor | None = None):
    """``top_skip_trigrams`` in pieces (``analysis.pieces``): yields ``(stage, done, total)`` after each
    block of sources (``SEARCH_STAGES``; a stage the bounds end early jumps to its total), and returns
    its result. A caller can stop between blocks (a newer head, a cancel): the search holds no state
    outside the generator."""
    V = k.shape[0]
    n_maps = 1 if R is None else R.shape[0]
    top = _TopTriples(n, k.device)
    # a rotation keeps norms up to the attention scaling R carries
    q_max = q.norm(dim=1).max() * (1 if R is None else spectral_norm(R, "the rotary maps").max())
    u_max = u.norm(dim=0).max()
    k_norm, v_norm = k.norm(dim=1), v.norm(dim=1)
    norm_bound = k_norm * q_max * v_norm * u_max
    order = torch.argsort(norm_bound, descending=True)
    rows = max(1, block_bytes // (V * 4))
    seed = min(rows, SEED_SOURCES)
    _exact_sources(order[:seed], q, k, v, u, R, top)  # the strongest-bounded sources set the threshold
    qw, kw = (q, k) if R is None else window_bound(q, k, R)
    qk_screen, ov_screen = ProductScreen(kw, qw.T), ProductScreen(v, u)
    uq, uo, visited = [], [], []
    blocks = range(seed, V, qk_screen.block_rows)
    yield "screen", 0, len(blocks)
    for done, start in enumerate(steps(blocks, "skip-trigram screen", unit="block"), 1):
        src = order[start : start + qk_screen.block_rows]
        if float(norm_bound[src[0]]) <= top.threshold:
            break  # every later source is bounded below the k-th score
        # rotary: kept per destination tile, for the per-offset screen below
        tiles = qk_screen.tile_max_upper(src).clamp_min(0)
        uq.append(tiles if R is not None else tiles.amax(1))
        uo.append(ov_screen.row_max_upper(src).clamp_min(0))
        visited.append(src)
        if done < len(blocks):
            yield "screen", done, len(blocks)
    yield "screen", len(blocks), len(blocks)
    if not visited:
        return _ranked(top)
    uq, uo, src = torch.cat(uq), torch.cat(uo), torch.cat(visited)
    uq_tiles, uq = (None, uq) if R is None else (uq, uq.amax(1))
    upper = uq * uo
    if R is not None:
        first = torch.argsort(upper, descending=True)[:rows]
        _exact_sources(src[first], q, k, v, u, R, top)  # a k-th score near the last, before the costly screen
        upper[first] = 0  # (done: their triples are in)
        live = (upper > top.threshold).nonzero().flatten()
        if live.numel():  # only the keys the window bound leaves are rotated and quantised
            offset_screen = ProductScreen(k[src[live]], q.T, row_maps=R)  # tiled as qk_screen: both over q
            m, n_tiles = live.numel(), offset_screen.n_tiles
            # a destination tile whose window bound times the source's OV bound is at most the k-th
            # score holds no triple that can enter: its offsets are not screened
            need = uq_tiles[live] * uo[live, None] > top.threshold  # [m, n_tiles]
            # blocks of consecutive sources that give each tile's GEMM about block_rows (offset, source) rows
            tiles_per_source = need.sum(1)
            rows_before = (tiles_per_source.cumsum(0) - tiles_per_source) * n_maps
            _, sizes = torch.unique_consecutive(rows_before // (offset_screen.block_rows * n_tiles), return_counts=True)
            start = 0
            yield "offsets", 0, len(sizes)
            for done, size in enumerate(sizes.tolist(), 1):
                local = torch.arange(start, start + size, device=src.device)
                start += size
                keys = (torch.arange(n_maps, device=src.device)[:, None] * m + local).flatten()
                tiles = offset_screen.tile_max_upper(keys, need[local].repeat(n_maps, 1))
                per_offset = tiles.amax(1).reshape(n_maps, -1).amax(0).clamp_min(0)  # 0: every tile ruled out
                at = live[local]
                upper[at] = torch.minimum(upper[at], per_offset * uo[at])
                yield "offsets", done, len(sizes)
    keep = upper > top.threshold
    upper, src = upper[keep], src[keep]
    ranked = torch.argsort(upper, descending=True)
    chunks = range(0, ranked.numel(), rows)
    yield "exact", 0, len(chunks)
    for done, start in enumerate(chunks, 1):
        chunk = ranked[start : start + rows]
        if float(upper[chunk[0]]) <= top.threshold:
            break
        _exact_sources(src[chunk], q, k, v, u, R, top)
        if done < len(chunks):
            yield "exact", done, len(chunks)
    yield "exact", len(chunks), len(chunks)
    return _ranked(top)


def _ranked(top: _TopTriples):
    """``(score, idx [n, 3], at [n])`` of ``top``, best first."""
    score, order = torch.sort(top.score, descending=True)
    idx = top.idx[order]
    return score, idx[:, :3], idx[:, 3]


def skip_trigrams(model, layer: int, head: int, k: int = 20, approximate: bool = False,
                  vocab=None, block_bytes: int = BLOCK_BYTES, offset=None, reduce: str = "max",
                  embedding=None) -> list[SkipTrigram]:
    """Top-``k`` skip-trigrams ``[source] ... [destination] -> [out]`` of head ``(layer, head)``.

    Score ``qk * ov`` with ``qk`` the row-centred full QK circuit ``W_E W_Q W_K^T W_E^T [dest, src]``
    and ``ov`` the row-centred full OV circuit ``W_E W_V W_O W_U [src, out]`` (module docstring).
    Exact for one-layer attention-only models; deeper models need ``approximate=True`` (direct
    path only). Rotary models: the QK circuit at query - key ``offset`` (an int, or a window of
    offsets reduced by ``reduce``, "max" or "mean"; default ``rotary.DEFAULT_OFFSETS`` with "max":
    each triple at its strongest offset, given as ``SkipTrigram.offset``); other models take no
    offset. ``vocab`` (token ids, optional) restricts source,
    destination and out to tokens that occur in real text: a trained model's never-seen
    tokens keep near-initial embeddings whose circuits are noise. ``embedding``: what the head reads for
    each token, source and destination: None or "raw" (``W_E``, the paper's), "mlp0" (``W_E`` through
    block 0: ``effective_embedding``), or an ``EffectiveEmbedding`` of this layer (a corpus's mean stream:
    its tokens are the vocabulary, intersected with ``vocab``); outs stay ``W_U``'s. Memory: the
    ``[d_vocab, d_head]`` factors plus one row block of ``block_bytes``. Returns a list
    sorted by score, best first: the rows of ``head_table`` with their token strings.
    """
    table = head_table(model, layer, head, k, offset=offset, reduce=reduce, approximate=approximate, vocab=vocab,
                       block_bytes=block_bytes, embedding=embedding)
    strings = model.token_strings
    offsets = [None] * len(table.score) if table.offset is None else table.offset.tolist()
    return [SkipTrigram(source=S, destination=D, out=O, source_str=strings[S], destination_str=strings[D],
                        out_str=strings[O], qk=qk, ov=ov, score=score, offset=at)
            for S, D, O, qk, ov, score, at in zip(table.source.tolist(), table.destination.tolist(),
                                                  table.out.tolist(), table.qk.tolist(), table.ov.tolist(),
                                                  table.score.tolist(), offsets)]


def head_table(model, layer: int, head: int, k: int = 20, *, offset=None, reduce: str = "max",
               approximate: bool = False, vocab=None, block_bytes: int = BLOCK_BYTES,
               sources: int | None = None, embedding=None) -> HeadTable:
    """Head ``(layer, head)``'s top-``k`` skip-trigrams as columns (``HeadTable``: source, destination,
    out ``[n]`` token ids; qk, ov, score ``[n]``; rotary: offset ``[n]``), best first.

    The one search behind ``skip_trigrams`` and the skip-trigram view; arguments as ``skip_trigrams``.
    The whole vocabulary's exact table is computed once per model, head, ``k`` and window
    (``cache``). ``sources``: instead, a quick partial table: the exact top-``k`` among the ``sources``
    sources with the largest factor norms (``partial_skip_trigrams``; ``progress`` says what fraction
    of the sources that is), not kept. ``head_table_steps`` run through.
    """
    return drained(head_table_steps(model, layer, head, k, offset=offset, reduce=reduce, approximate=approximate,
                                    vocab=vocab, block_bytes=block_bytes, sources=sources, embedding=embedding))


def head_table_steps(model, layer: int, head: int, k: int = 20, *, offset=None, reduce: str = "max",
                     approximate: bool = False, vocab=None, block_bytes: int = BLOCK_BYTES,
                     sources: int | None = None, embedding=None):
    """``head_table`` in pieces (``analysis.pieces``): the search's blocks of sources
    (``top_skip_trigrams_steps``: ``(stage, done, total)``, stages ``SEARCH_STAGES``); none for a table
    the cache holds, or a partial one (quick: one piece). Returns the ``HeadTable``; the exact table
    of the whole vocabulary is kept once computed, and one kept meanwhile (the background fill, say,
    finished it) is taken between blocks instead of searching on. The arguments are checked before
    the first piece."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    layer, head = _check_exact(model, layer, head, approximate)
    offsets = offset_window(model, offset, "a skip-trigram table")
    check_reduce(reduce)
    ids = None if vocab is None else _check_vocab(model, vocab)
    effective = _check_embedding(model, layer, embedding)
    if effective is not None:  # read through another embedding: its tokens, not kept
        keep = torch.ones_like(effective.tokens, dtype=torch.bool) if ids is None else torch.isin(effective.tokens, ids)
        return (yield from _head_table_steps(model, layer, head, k, offsets, reduce, effective.tokens[keep], block_bytes,
                                             sources, effective.vectors[keep]))
    if ids is not None or sources is not None:
        return (yield from _head_table_steps(model, layer, head, k, offsets, reduce, ids, block_bytes, sources))
    key = _table_key(layer, head, k, offsets, reduce, block_bytes)
    table = stored(model, key)
    if table is not None:
        return table
    keep = keeper(model, key, tier=RESULT)
    steps = _head_table_steps(model, layer, head, k, offsets, reduce, None, block_bytes, None)
    while True:
        try:
            piece = next(steps)
        except StopIteration as stop:
            table = stop.value
            break
        yield piece
        kept = stored(model, key) if holds(model, key) else None
        if kept is not None:  # kept meanwhile (another thread's search): no need to go on
            steps.close()
            return kept
    return keep(table)


def kept_head_table(model, layer: int, head: int, k: int = 20, *, offset=None, reduce: str = "max",
                    block_bytes: int = BLOCK_BYTES) -> HeadTable | None:
    """The exact ``head_table`` of the whole vocabulary if the cache holds it now, else None (for a
    caller that shows a partial table first while the exact one is computed)."""
    layer, head = check_head(model, (layer, head))
    offsets = offset_window(model, offset, "a skip-trigram table")
    return stored(model, _table_key(layer, head, k, offsets, check_reduce(reduce), block_bytes))


def _table_key(layer: int, head: int, k: int, offsets: list[int] | None, reduce: str, block_bytes: int) -> tuple:
    """The cache key of a head's exact table (``key[1:3]`` is the head, as for every per-head entry)."""
    return ("skip_trigram_table", layer, head, k, tuple(offsets or ()), reduce, block_bytes)


@torch.no_grad()
def _head_table_steps(model, layer: int, head: int, k: int, offsets: list[int] | None, reduce: str,
                      ids: torch.Tensor | None, block_bytes: int, sources: int | None,
                      reads: torch.Tensor | None = None):
    """``head_table_steps`` of the checked arguments (``ids``: the sub-vocabulary, or None for all of it;
    ``reads``: what the head reads for each of ``ids``, or None for the embedding)."""
    q, kk, v, u = centred_factors(model, layer, head, ids, reads)
    R = None if offsets is None else rotations(model.cfg, offsets, q.dtype, q.device, layer=layer)

    def search(qr, Rr):  # the exact search, or the partial one over the strongest sources (one piece)
        if sources is None:
            return top_skip_trigrams_steps(qr, kk, v, u, k, block_bytes, Rr)
        return whole(partial_skip_trigrams, qr, kk, v, u, k, sources, Rr, block_bytes)

    with naming_non_finite(f"the skip-trigram scores of L{layer}.H{head}", model, WEIGHTS, q.dtype):
        score, idx, at = yield from top_over_offsets_steps(search, q, R, reduce)
    qk, ov = triple_entries(q, kk, v, u, idx, R, at)
    tokens = idx if ids is None else ids[idx]
    return HeadTable(
        layer=layer, head=head, source=tokens[:, 0], destination=tokens[:, 1], out=tokens[:, 2],
        qk=qk, ov=ov, score=score, offset=None if at is None else torch.as_tensor(offsets, device=at.device)[at],
        offsets=None if offsets is None else tuple(offsets),
        progress=1.0 if sources is None else min(1.0, sources / kk.shape[0]),
    )


def top_over_offsets_steps(search, q: torch.Tensor, R: torch.Tensor | None, reduce: str = "max"):
    """``search(q', R')`` (an exact top-n search in pieces such as ``top_skip_trigrams_steps``, returning
    ``(score, idx, at)``) on the query factor ``q [V, d_head]`` as the rotary circuit reads it (module
    docstring); its pieces, then ``(score, idx, at)``.

    ``R``: None (not rotary: ``search(q, None)``), or ``[n_offsets, d_head, d_head]`` rotations of a
    window: "max" searches the window at once, each triple at its best offset (``search(q, R)``);
    "mean" searches the window-averaged circuit ``q R.mean(0)``. ``at [n']`` is the index into ``R`` of
    each triple's offset (None unless "max" over ``R``)."""
    if R is None:
        return (*(yield from search(q, None))[:2], None)
    if check_reduce(reduce) == "mean":
        return (*(yield from search(q @ R.mean(0), None))[:2], None)
    return (yield from search(q, R))


def qk_entries(q, k, idx, R=None, at=None) -> torch.Tensor:
    """Entries ``QKc[dest, src]`` of the centred circuit for triples ``idx [n, 3] = (src, dest, out)``:
    ``q[dest] . k[src]`` with the query rotated as ``top_over_offsets`` read it (``R[at]`` per triple,
    or the window's mean rotation)."""
    src, dest = idx[:, 0], idx[:, 1]
    qd = q[dest]
    if R is not None:
        qd = (qd[:, None] @ R[at])[:, 0] if at is not None else qd @ R.mean(0)
    return (qd * k[src]).sum(1)


def ov_entries(v, u, idx) -> torch.Tensor:
    """Entries ``OVc[src, out]`` of the centred circuit for triples ``idx [n, 3] = (src, dest, out)``:
    ``v[src] . u[:, out]`` (``v [d_vocab, r]``, ``u [r, d_vocab]``: ``centred_factors``), ``[n]``."""
    src, out = idx[:, 0], idx[:, 2]
    return (v[src] * u.T[out]).sum(1)


def triple_entries(q, k, v, u, idx, R=None, at=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qk [n], ov [n])``: the two factors of each triple's score, ``qk_entries`` and ``ov_entries``
    of the centred factors ``(q, k, v, u)`` (``centred_factors``) for ``idx [n, 3] = (src, dest, out)``
    (rotary: ``R``/``at`` as ``qk_entries``)."""
    return qk_entries(q, k, idx, R, at), ov_entries(v, u, idx)


def _check_vocab(model, vocab) -> torch.Tensor:
    ids = torch.unique(torch.as_tensor(vocab).flatten())
    V = model.cfg.d_vocab
    if ids.is_floating_point() or ids.numel() < 1 or int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"vocab must be a non-empty collection of token ids in 0..{V - 1}, got {vocab!r}")
    return ids


def circuit_query(model, layer: int, head: int, token: int, mode: str, k: int = 10,
                  approximate: bool = False, factors=None, offset=None,
                  reduce: str = "max") -> list[tuple[int, str, float]]:
    """One token against the whole vocabulary, through head ``(layer, head)``'s centred circuits.

    ``mode``: ``"attends_to"`` (row ``token`` of QK: which sources ``token`` attends to as a
    destination), ``"attended_by"`` (column ``token`` of QK: which destinations attend to it),
    ``"copies_to"`` (row ``token`` of OV: which out logits attending to it raises).
    Rotary models: QK rows at ``offset`` / over a window reduced by ``reduce`` (each entry's max or
    mean over the window; default ``rotary.DEFAULT_OFFSETS``, as ``skip_trigrams``).
    Returns the top ``k`` as ``(token id, token string, centred score)``, best first.
    ``factors``: this head's ``centred_factors`` if already computed (several queries of one head).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check_exact(model, layer, head, approximate)
    offsets = offset_window(model, offset, "a skip-trigram query")
    check_reduce(reduce)
    V = model.cfg.d_vocab
    token = check_index(token, "token (a vocab id)", V)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= V:
        raise ValueError(f"k must be in 1..{V}, got {k!r}")
    with torch.no_grad():
        q, kk, v, u = factors if factors is not None else centred_factors(model, layer, head)
        R = None if offsets is None or mode == "copies_to" else rotations(model.cfg, offsets, q.dtype, q.device,
                                                                          layer=layer)
        if mode == "copies_to":
            row = v[token] @ u
        else:  # one row per offset, [n_offsets, V], then reduced over them
            Rs = torch.eye(q.shape[1], dtype=q.dtype, device=q.device)[None] if R is None else R
            rows = (kk @ (q[token] @ Rs).mT).mT if mode == "attends_to" else (q @ Rs) @ kk[token]
            row = rows.amax(0) if reduce == "max" else rows.mean(0)
        values, ids = torch.topk(row, k)
    strings = model.token_strings
    return [(i, strings[i], val) for i, val in zip(ids.tolist(), values.tolist())]


def partial_skip_trigrams(q, k, v, u, n: int, n_sources: int, R: torch.Tensor | None = None,
                          block_bytes: int = BLOCK_BYTES):
    """A quick first answer for a large vocabulary: the exact top-``n`` skip-trigrams among the
    ``n_sources`` sources with the largest factor norms ``|k[s]| |v[s]|`` (an upper bound on
    every score of source ``s`` up to the query and out factors), which are likely strong.
    Same inputs and output as :func:`top_skip_trigrams`; the few sources are computed in full
    precision directly (a screen would cost more than it saves).
    """
    src = torch.argsort(k.norm(dim=1) * v.norm(dim=1), descending=True)[:n_sources]
    top = _TopTriples(n, k.device)
    rows = max(1, block_bytes // (k.shape[0] * 4))
    for start in range(0, src.numel(), rows):
        _exact_sources(src[start : start + rows], q, k, v, u, R, top)
    return _ranked(top)


def copied_tokens(model, layer: int, head: int, n: int, embedding=None):
    """The ``n`` tokens whose own logit head ``(layer, head)`` raises most when attending to
    them: top of the diagonal of the centred full OV circuit, ``OVc[t, t] = v[t] . u[:, t]``.
    Returns ``(ids [n], values [n])``. The diagonal ``[d_vocab]`` is kept per model and head (``cache``).
    ``embedding`` (an ``EffectiveEmbedding`` of the head's layer, or None: ``W_E``): read through it, over
    its tokens (``n`` at most as many)."""
    layer, head = check_head(model, (layer, head))
    if embedding is not None:
        with torch.no_grad():
            v, u = _ov_factors(model, layer, head, embedding.tokens, embedding.vectors)
            values, at = torch.topk((v * u.mT).sum(1), min(n, len(embedding.tokens)))
        return embedding.tokens[at], values

    def diagonal():
        with torch.no_grad():
            v, u = _kept_ov_factors(model, layer, head)
            return (v * u.mT).sum(1)

    values, ids = torch.topk(cached(model, ("ov_diagonal", layer, head), diagonal), n)
    return ids, values
