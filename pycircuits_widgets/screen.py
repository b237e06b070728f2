"""Low-precision screens of a product ``a @ b``: rigorous upper bounds from cheap GEMMs.

Exact top-k routines (``FactoredMatrix.topk``, the skip-trigram search) spend most of their
time deciding which entries of ``a [m, r] @ b [r, n]`` can matter. ``ProductScreen`` answers
that with one low-precision GEMM per tile and an error bound proven below, so an entry is
discarded only when it provably cannot beat the level; survivors are recomputed exactly by
the caller. Two backends, the bound of each stated where it is used (int8 is the default where it
runs, also on AMX hosts whose bf16 GEMM is as fast at inner dimension 64: the row max over its
2-byte outputs costs twice that over int8 ones, measured 1 thread: GEMM + row max ~240-440 GOP/s
for bf16 against ~350-550 for int8):

**int8** (CPUs where torch has oneDNN's quantised linear, ``torch.ops.onednn.qlinear_*``, with
signed int8 activations: no zero point, so no compensation term in the kernel).
Rows ``a_i = alpha_i ã_i + e_i`` with ``alpha_i = max|a_i| / 127``, ``ã_i`` int8; columns
``b_j = beta_j b̃_j + f_j`` with ``beta_j = max|b_j| / 127``. The int32 products ``ã_i . b̃_j``
are exact; oneDNN scales them by ``beta_j / S`` and rounds to an int8 ``o_ij`` (error <= 1/2
plus float32 rounding; we allow 1, which holds for any rounding mode). Then

    a_i . b_j = alpha_i beta_j ã_i . b̃_j + alpha_i ã_i . f_j + e_i . b_j
             <= alpha_i S (o_ij + 1) + alpha_i ||ã_i|| max_j ||f_j|| + ||e_i|| max_j ||b_j||,

unless ``o_ij`` saturated at 127, in which case the bound is +inf (the entry stays a
candidate). One byte per product keeps the ``[rows, cols]`` tile in cache, so the row max
costs a pass over bytes, not over a stored int32 block. ``S`` is half the Cauchy-Schwarz bound
``max ||ã_i|| max ||beta_j b̃_j|| / 127``: row maxima of inner products in ``r`` dimensions are
well below it, and the rare saturated entry is detected.

**bfloat16** (everywhere else). With unit roundoff ``u = 2^-8`` (8 significand bits), fp32
accumulation (oneDNN, cuBLAS and torch's CPU fallback accumulate bf16 products in fp32; the
products of two bf16 numbers are exact in fp32) and ``γ_r = r 2^-24 / (1 - r 2^-24)``:
inputs rounded ``(2u + u^2) Σ|a_k b_k|``, accumulation ``γ_r (1 + u)^2 Σ|a_k b_k|``, output
rounded ``u |ŝ|``, so

    |bf16(a . b) - a . b| <= ρ_r Σ_k |a_k b_k| <= ρ_r ||a|| ||b||,
    ρ_r = 3u + 3u^2 + u^3 + γ_r (1 + u)^3        (ρ_64 = 0.01176, ρ_4096 = 0.01201 < 2^-6).

Levels are compared in float32 (no rounding of the level to bf16).
"""

from __future__ import annotations

import functools

import torch

U_BF16 = 2.0**-8
"""Unit roundoff of bfloat16 (8 significand bits, 7 stored)."""
U_FP32 = 2.0**-24
"""Unit roundoff of float32."""
TILE_COLS = 1024
"""Columns per screening tile: an int8 ``[rows, 1024]`` output (4 MiB at 4096 rows) is reduced to its
row maxima right after the GEMM that wrote it, while it is still in cache."""
INNER_MULTIPLE = 32
"""The int8 factors' inner dimension is zero-padded to a multiple of this (see ``ProductScreen``)."""
SCREEN_ROWS = {"int8": 4096, "bfloat16": 256}
"""Rows per screening call that callers should use. int8: the fastest of 1024-16384 rows x 256-2048
columns on an AMX host at d_vocab 50257 (full row-max passes, CPU time: 4096 x 1024 ~400 GOP/s per
core, 1024 x 1024 ~330); bfloat16: measured earlier on 2 cores at d_vocab 50257."""
FLOAT_SLACK = 1e-5
"""Relative slack, in units of ``||a_i|| max ||b_j||``, for float32 rounding in the norms and scales."""


def bf16_relative_error(r: int) -> float:
    """``ρ_r``: ``|bf16 GEMM - exact| <= ρ_r Σ|a_k b_k|`` for inner dimension ``r`` (module docstring)."""
    u = U_BF16
    gamma = r * U_FP32 / (1 - r * U_FP32)
    return 3 * u + 3 * u**2 + u**3 + gamma * (1 + u) ** 3


@functools.cache
def int8_available() -> bool:
    """oneDNN's quantised linear (int8 x int8 -> int8, per-column scales) runs and is exact here."""
    try:
        w = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(w, [1, 2])
        x = torch.tensor([[1, -2]], dtype=torch.int8)
        o = torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, packed, torch.ones(2), torch.zeros(2, dtype=torch.long),
                                               None, 1.0, 0, torch.int8, "none", [], "")
        return o.tolist() == [[5, -5]]
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _quantise_rows(x: torch.Tensor):
    """Per-row int8 quantisation ``x_i = s_i x̃_i + e_i`` of ``x [n, r]`` (float32, ``s_i = max|x_i| / 127``).

    Returns ``(x̃ [n, r] int8, s [n], ||x̃_i|| [n], ||e_i|| [n])``: the terms of the int8 bound
    (module docstring), for the rows of ``a`` and the columns of ``b`` alike.
    """
    lo, hi = torch.aminmax(x, dim=1)  # (no |x| temporary)
    s = torch.maximum(-lo, hi).clamp_min(torch.finfo(torch.float32).tiny) / 127
    xq = torch.div(x, s[:, None]).round_()
    err = torch.linalg.vector_norm(torch.addcmul(x, xq, s[:, None], value=-1), dim=1)
    return xq.to(torch.int8), s, torch.linalg.vector_norm(xq, dim=1), err


class ProductScreen:
    """Upper bounds on entries of ``a [m, r] @ b [r, n]`` (float32) from a low-precision GEMM.

    ``row_max_upper(rows)``: ``[len(rows)]`` bounds ``>= max_j (a @ b)[i, j]``.
    ``candidates(rows, level)``: every ``(i, j)`` with ``(a @ b)[rows[i], j] > level`` is returned
    (and some that are not). ``backend``: ``"int8"`` or ``"bfloat16"``; default int8 on CPUs where
    ``int8_available()``. Memory: the quantised factors plus one ``[rows, TILE_COLS]`` tile.
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, backend: str | None = None, tile_cols: int = TILE_COLS):
        if backend is None:
            backend = "int8" if a.device.type == "cpu" and int8_available() else "bfloat16"
        if backend not in SCREEN_ROWS:
            raise ValueError(f"backend must be one of {tuple(SCREEN_ROWS)}, got {backend!r}")
        # rows of bt are the columns of b: every reduction below runs along contiguous rows
        a, bt = a.float(), b.float().T.contiguous()
        self.backend = backend
        self.block_rows = SCREEN_ROWS[backend]
        self.n = bt.shape[0]
        cols = range(0, self.n, tile_cols)
        self._starts = list(cols)
        a_norm = torch.linalg.vector_norm(a, dim=1)
        b_norm_max = torch.linalg.vector_norm(bt, dim=1).max()
        slack = FLOAT_SLACK * a_norm * b_norm_max
        if backend == "int8":
            self._x, alpha, aq_norm, e_norm = _quantise_rows(a)
            w, beta, bq_norm, f_norm = _quantise_rows(bt)  # w [n, r]: a linear layer's weight
            self._margin = alpha * aq_norm * f_norm.max() + e_norm * b_norm_max + slack
            self._scale = max(float(aq_norm.max() * (beta * bq_norm).max()) / 254, torch.finfo(torch.float32).tiny)
            self._alpha_s = alpha * self._scale
            # oneDNN's int8 kernel falls to a path ~1000x slower for an inner dimension under 32
            # (d_head 16: 7.8 s for a 4096^2 tile against 5 ms at 32); zero columns change no
            # product and no norm of the bound
            pad = -a.shape[1] % INNER_MULTIPLE
            self._x, w = (torch.nn.functional.pad(t, (0, pad)) for t in (self._x, w))
            rows_hint = [self.block_rows, w.shape[1]]
            self._tiles = [(torch.ops.onednn.qlinear_prepack(w[c:c + tile_cols], rows_hint), beta[c:c + tile_cols],
                            torch.zeros(min(tile_cols, self.n - c), dtype=torch.long)) for c in cols]
        else:
            self._margin = bf16_relative_error(a.shape[1]) * a_norm * b_norm_max + slack
            self._x = a.bfloat16()
            self._tiles = [bt[c:c + tile_cols].T.bfloat16().contiguous() for c in cols]

    def _tile(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """Low-precision product of quantised rows ``x`` with column tile ``t``: int8 or bf16 ``[R, C]``."""
        if self.backend == "int8":
            w, beta, zero = self._tiles[t]
            return torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, w, beta, zero, None, self._scale, 0,
                                                      torch.int8, "none", [], "")
        return x @ self._tiles[t]

    def row_max_upper(self, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows)]`` float32 upper bounds of ``max_j (a @ b)[rows, j]`` (never below the truth)."""
        x = self._x[rows]
        # each tile is reduced while still in cache; its [R] maxima are stacked (a strided out= is slower)
        best = torch.stack([torch.amax(self._tile(x, t), 1) for t in range(len(self._tiles))], 1).amax(1).float()
        if self.backend == "bfloat16":
            return best + self._margin[rows]
        upper = self._alpha_s[rows] * (best + 1) + self._margin[rows]
        return torch.where(best >= 127, torch.inf, upper)  # saturated: no bound

    def candidates(self, rows: torch.Tensor, level: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(i, j)`` index tensors: a superset of the entries with ``(a @ b)[rows[i], j] > level``."""
        x = self._x[rows]
        floor = level - self._margin[rows]
        if self.backend == "int8":
            # o + 1 > floor / (alpha S) is needed; o <= t with t < that - 1 rules an entry out.
            # A saturated o = 127 always passes (t <= 126).
            t = torch.floor(floor.double() / self._alpha_s[rows].double() - 1 - 1e-3)
            cut = t.clamp(-128, 126).to(torch.int8)[:, None]
        else:
            cut = floor[:, None]
        found = []
        for t, start in enumerate(self._starts):
            tile = self._tile(x, t)
            i, j = torch.nonzero(tile > cut if self.backend == "int8" else tile.float() > cut, as_tuple=True)
            found.append((i, j + start))
        return torch.cat([f[0] for f in found]), torch.cat([f[1] for f in found])
