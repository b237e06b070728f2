"""Low-precision screens of a product ``a @ b``: rigorous upper bounds from cheap GEMMs.

Exact top-k routines (``FactoredMatrix.topk``, the skip-trigram search) spend most of their
time deciding which entries of ``a [m, r] @ b [r, n]`` can matter. ``ProductScreen`` answers
that with one low-precision GEMM per tile and an error bound proven below, so an entry is
discarded only when it provably cannot beat the level; survivors are recomputed exactly by
the caller. Which low-precision route is exact depends on the CPU, so ``exact_route()`` decides
per machine, at first use, from a probe (below); the fastest exact route wins.

**Routes.** ``"int8"``: oneDNN's quantised linear (``torch.ops.onednn.qlinear_*``) on int8
factors quantised to ±127, int8 output. Exact where the kernel's int32 products are exact: VNNI
(``vpdpbusd``) and AMX (``tdpbssd``) accumulate every product in int32. ``"int8-narrow"``: the
same kernel with the columns of ``b`` (the kernel's weights) quantised to ±64. Without VNNI (AVX2
only: AMD Zen 1-3, Intel before Cascade Lake) oneDNN shifts the signed activations by 128 to
``[1, 255]`` and multiplies with ``vpmaddubsw``, which sums *pairs* of u8 x s8 products in
saturating 16-bit arithmetic: exact only while ``2 * 255 * max|w| <= 32767``, i.e. ``|w| <= 64``
(measured: at ±65 an all-maximum product already comes back low). ``"int_mm"`` and
``"int_mm-narrow"``: ``torch._int_mm`` (oneDNN's s8 x s8 -> s32 GEMM) on the same factors at ±127
and ±64, with int32 output: no output rounding and no saturation, at 4 bytes a product (a
``[1024, 1024]`` tile). On AVX2 it saturates like the quantised linear, hence its narrow twin.
``"bfloat16"``: a bf16 GEMM with fp32 accumulation (exact bound on every device; fast only with
native bf16: AVX512-BF16, AMX, GPUs). ``"float32"``: the fp32 GEMM itself with its rounding bound
(no saving in the GEMM, 4-byte tiles).

**Choosing a route by measurement** (``describe``). Which kernel oneDNN runs is not what the CPU's
flags suggest: on an AVX-512 VNNI host without AMX the quantised linear falls to its *reference*
implementation (``ref_int8``, ~1000x slower than float32) while ``torch._int_mm`` there runs at
several times float32. So once per process, on first use, every route whose probe passes is timed
on one compute worker (one thread, CPU time) on a tile of its own shape at inner dimension 64, a
small tile first: a route that oneDNN's verbose log shows running a reference kernel, or that is
``REFERENCE_SLOWDOWN`` times slower than float32 there, is refused without timing more. The
fastest of the rest wins, float32 always among them: the screen is never slower than float32's.

**int8 bound** (both int8 routes; ``Q = 127`` or ``64`` for the columns of ``b``). Rows
``a_i = alpha_i ã_i + e_i`` with ``alpha_i = max|a_i| / 127``, ``ã_i`` int8; columns
``b_j = beta_j b̃_j + f_j`` with ``beta_j = max|b_j| / Q``. The int32 products ``ã_i . b̃_j``
are exact (the probe's guarantee); oneDNN scales them by ``beta_j / S`` and rounds to an int8
``o_ij`` (error <= 1/2 plus float32 rounding; we allow 1, which holds for any rounding mode). Then

    a_i . b_j = alpha_i beta_j ã_i . b̃_j + alpha_i ã_i . f_j + e_i . b_j
             <= alpha_i S (o_ij + 1) + alpha_i ||ã_i|| max_j ||f_j|| + ||e_i|| max_j ||b_j||,

unless ``o_ij`` saturated at 127, in which case the bound is +inf (the entry stays a
candidate). One byte per product keeps the ``[rows, cols]`` tile in cache, so the row max
costs a pass over bytes, not over a stored int32 block. ``S`` is half the Cauchy-Schwarz bound
``max ||ã_i|| max ||beta_j b̃_j|| / 127``: row maxima of inner products in ``r`` dimensions are
well below it, and the rare saturated entry is detected.

**int_mm bound** (``Q = 127`` or ``64``). Rows as above; the columns of ``b`` share one scale
``beta = max|b| / Q``: ``b_j = beta b̃_j + f_j``. The int32 products ``p_ij = ã_i . b̃_j`` are exact
(the probe's guarantee), so

    a_i . b_j = alpha_i beta p_ij + alpha_i ã_i . f_j + e_i . b_j
             <= alpha_i beta p_ij + alpha_i ||ã_i|| max_j ||f_j|| + ||e_i|| max_j ||b_j||,

the int8 routes' margin without their output step. One scale for every column is what lets a row's
maximum be taken on the integers (the int8 routes' margin also takes the largest ``||f_j||``, so
per-column scales would tighten nothing). ``|p_ij| <= 127^2 r`` fits int32 for ``r`` up to 133,000.

**bfloat16 bound.** With unit roundoff ``u = 2^-8`` (8 significand bits), fp32
accumulation (oneDNN, cuBLAS and torch's CPU fallback accumulate bf16 products in fp32; the
products of two bf16 numbers are exact in fp32) and ``γ_r = r 2^-24 / (1 - r 2^-24)``:
inputs rounded ``(2u + u^2) Σ|a_k b_k|``, accumulation ``γ_r (1 + u)^2 Σ|a_k b_k|``, output
rounded ``u |ŝ|``, so

    |bf16(a . b) - a . b| <= ρ_r Σ_k |a_k b_k| <= ρ_r ||a|| ||b||,
    ρ_r = 3u + 3u^2 + u^3 + γ_r (1 + u)^3        (ρ_64 = 0.01176, ρ_4096 = 0.01201 < 2^-6).

**float32 bound.** The inputs are already float32; any summation order (blocked, FMA) gives
``|fl(a . b) - a . b| <= γ_r Σ|a_k b_k| <= γ_r ||a|| ||b||``.

Levels are compared in float32 (no rounding of the level to bf16).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import logging
import os
import re
import sys
import tempfile
import threading
import time

import torch

from . import compute_pool

U_BF16 = 2.0**-8
"""Unit roundoff of bfloat16 (8 significand bits, 7 stored)."""
U_FP32 = 2.0**-24
"""Unit roundoff of float32."""
TILE_COLS = 1024
"""Columns per screening tile: an int8 ``[rows, 1024]`` output (4 MiB at 4096 rows) is reduced to its
row maxima right after the GEMM that wrote it, while it is still in cache."""
INNER_MULTIPLE = 32
"""The int8 factors' inner dimension is zero-padded to a multiple of this (see ``ProductScreen``)."""
QLINEAR = ("int8", "int8-narrow")
"""The routes on oneDNN's quantised linear (int8 output, per-column scales)."""
INT_MM = ("int_mm", "int_mm-narrow")
"""The routes on ``torch._int_mm`` (int32 output, one scale for the columns)."""
INT8_WEIGHT_MAX = {"int8": 127, "int8-narrow": 64, "int_mm": 127, "int_mm-narrow": 64}
"""Largest |quantised value| of the columns of ``b`` per int8 route (module docstring, "Routes")."""
SCREEN_ROWS = {"int8": 4096, "int8-narrow": 4096, "int_mm": 1024, "int_mm-narrow": 1024, "bfloat16": 256,
               "float32": 1024}
"""Rows per screening call that callers should use. int8: the fastest of 1024-16384 rows x 256-2048
columns on an AMX host at d_vocab 50257 (full row-max passes, CPU time: 4096 x 1024 ~400 GOP/s per
core, 1024 x 1024 ~330); int_mm and float32: a ``[1024, 1024]`` 4-byte tile is the int8 tile's 4 MiB;
bfloat16: measured earlier on 2 cores at d_vocab 50257."""
BACKENDS = tuple(SCREEN_ROWS)
MEASURE_INNER = 64
"""Inner dimension of the timed tiles (``describe``): d_head 64, the commonest (GPT-2, Pythia, SmolLM2)."""
SMALL_TILE = (128, 256)
"""``[rows, cols]`` of the first timed tile of each route: ~2 M products, under 0.1 s on a reference
kernel (~0.05-0.1 GOP/s), so a route that falls to one costs little before it is refused."""
REFERENCE_SLOWDOWN = 10
"""A route this many times slower than float32 on the small tile is refused as a reference kernel
(measured: ~1000x for oneDNN's ``ref_int8``; a real kernel is within a few x of float32)."""
FLOAT_SLACK = 1e-5
"""Relative slack, in units of ``||a_i|| max ||b_j||``, for float32 rounding in the norms and scales."""
PROBE_INNER = (32, 64, 96, 128, 256)
"""Inner dimensions the int8 probe runs at: the padded sizes of real heads (d_head 16-256)."""


def bf16_relative_error(r: int) -> float:
    """``ρ_r``: ``|bf16 GEMM - exact| <= ρ_r Σ|a_k b_k|`` for inner dimension ``r`` (module docstring)."""
    u = U_BF16
    gamma = r * U_FP32 / (1 - r * U_FP32)
    return 3 * u + 3 * u**2 + u**3 + gamma * (1 + u) ** 3


def fp32_relative_error(r: int) -> float:
    """``γ_r``: ``|fp32 GEMM - exact| <= γ_r Σ|a_k b_k|`` for float32 inputs, inner dimension ``r``."""
    return r * U_FP32 / (1 - r * U_FP32)


def _qlinear(x: torch.Tensor, packed, col_scale: torch.Tensor, out_scale: float) -> torch.Tensor:
    """oneDNN's int8 x int8 -> int8 linear: ``round(x @ w.T * col_scale / out_scale)`` saturated to int8."""
    zero = torch.zeros(col_scale.numel(), dtype=torch.long)
    return torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, packed, col_scale, zero, None, out_scale, 0,
                                              torch.int8, "none", [], "")


def _probe_rows(r: int, q: int, gen: torch.Generator) -> torch.Tensor:
    """``[14, r]`` int32 rows of magnitude ``q`` whose products saturate 16-bit pair sums first: constant
    signs, equal-sign pairs with alternating pairs, alternating signs, and random integers in ``[-q, q]``."""
    k = torch.arange(r)
    patterns = [torch.ones(r), torch.where(k % 4 < 2, 1, -1), torch.where(k % 2 == 0, 1, -1),
                torch.where(k < r // 2, 1, -1)]
    signs = torch.stack([s for p in patterns for s in (p, -p)]).to(torch.int32)
    return torch.cat([q * signs, torch.randint(-q, q + 1, (6, r), generator=gen, dtype=torch.int32)])


@functools.cache
def _qlinear_is_exact(weight_max: int) -> bool:
    """Whether oneDNN's int8 linear gives the float64 truth on the probe (module docstring, "The probe").

    Entries with ``|x . w| <= 120`` are compared at output scale 1, where any error shows (an integer
    scaled by 1 rounds exactly); every entry again with per-column scales mapping each column's largest
    product to 100, within the 1 the screen's bound allows."""
    gen = torch.Generator().manual_seed(0)
    try:
        for r in PROBE_INNER:
            x, w = _probe_rows(r, 127, gen), _probe_rows(r, weight_max, gen)
            truth = x.double() @ w.double().T
            packed = torch.ops.onednn.qlinear_prepack(w.to(torch.int8), [x.shape[0], r])
            x8, ones = x.to(torch.int8), torch.ones(w.shape[0])
            small = truth.abs() <= 120
            if not torch.equal(_qlinear(x8, packed, ones, 1.0).double()[small], truth[small]):
                return False
            col = (truth.abs().amax(0) / 100).clamp_min(1)
            if ((_qlinear(x8, packed, 1 / col.float(), 1.0).double() - truth / col).abs() > 1).any():
                return False
        return True
    except (AttributeError, RuntimeError, NotImplementedError):  # no oneDNN int8 in this build
        return False


@functools.cache
def _int_mm_is_exact(weight_max: int) -> bool:
    """Whether ``torch._int_mm`` returns the exact int32 products on the probe rows times columns at
    ``±weight_max``: the probe's ``[14, r]`` rows against themselves, then repeated to 70 rows against
    1037 columns (a screen's width, with a tail a kernel's column blocking does not divide)."""
    gen = torch.Generator().manual_seed(0)
    try:
        for r in PROBE_INNER:
            x, w = _probe_rows(r, 127, gen), _probe_rows(r, weight_max, gen)
            wide = torch.cat([w.repeat(74, 1), torch.randint(-weight_max, weight_max + 1, (1037 - 14 * 74, r),
                                                             generator=gen, dtype=torch.int32)])
            for rows, cols in ((x, w), (x.repeat(5, 1), wide)):
                got = torch._int_mm(rows.to(torch.int8), cols.to(torch.int8).T.contiguous())
                if not torch.equal(got.double(), rows.double() @ cols.double().T):
                    return False
        return True
    except (AttributeError, RuntimeError, NotImplementedError):  # no CPU _int_mm in this build
        return False


def _int8_route_is_exact(route: str) -> bool:
    """The probe's verdict on one int8 route (module docstring, "The probe")."""
    probe = _qlinear_is_exact if route in QLINEAR else _int_mm_is_exact
    return probe(INT8_WEIGHT_MAX[route])


def exact_routes(device_type: str = "cpu") -> tuple[str, ...]:
    """Every route whose bound holds here: the int8 routes the probe passes, bfloat16 and float32."""
    int8 = [r for r in INT8_WEIGHT_MAX if device_type == "cpu" and _int8_route_is_exact(r)]
    return (*int8, "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class RouteReport:
    """What ``describe`` found of one route: ``rate`` in GOP/s (a multiply-add counts 2) of one thread
    screening the route's own tile (GEMM and row maxima, CPU time), None where it was not timed;
    ``refused`` says why it was not chosen ("" for the chosen route and for slower exact ones)."""

    route: str
    exact: bool
    rate: float | None = None
    reference: str = ""  # the reference kernel oneDNN reported, or "" ("timing" where only the timing said so)
    refused: str = ""


@dataclasses.dataclass(frozen=True)
class RouteChoice:
    """The screen route of a device and how it was chosen (``describe``); ``str()`` is a table."""

    device_type: str
    route: str
    reports: tuple[RouteReport, ...]

    def usable(self) -> tuple[str, ...]:
        """The routes timed and not refused: the chosen one and the exact ones slower than it."""
        return tuple(r.route for r in self.reports if r.exact and not r.refused)

    def __str__(self) -> str:
        rows = [f"screen route on {self.device_type}: {self.route}"]
        for r in self.reports:
            rate = "not timed" if r.rate is None else f"{r.rate:,.1f} GOP/s"
            verdict = "chosen" if r.route == self.route else (r.refused or "exact, slower")
            rows.append(f"  {r.route:<14} {rate:>14}  {verdict}")
        return "\n".join(rows)


def choose(reports: list[RouteReport]) -> str:
    """The fastest exact route of ``reports`` that is not a reference kernel; float32 (always exact)
    wherever no other was timed faster. Pure: tested with injected timings."""
    floor = next(r for r in reports if r.route == "float32")
    fast = [r for r in reports if r.exact and not r.reference and r.rate is not None]
    return max(fast, key=lambda r: r.rate, default=floor).route


_log = logging.getLogger(__name__)


def _onednn_implementations(fn) -> list[str]:
    """Names of the implementations oneDNN's verbose log reports for the primitives ``fn()`` executes
    (``ref_int8:any``, ``brg_matmul:avx512_core_amx``, ...), read from file descriptor 1 while it runs:
    anything else written there in those milliseconds is lost. Empty without oneDNN's verbose mode."""
    if not torch.backends.mkldnn.is_available():
        fn()
        return []
    libc = ctypes.CDLL(None) if os.name == "posix" else None
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as log:
        try:
            os.dup2(log.fileno(), 1)
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                fn()
            if libc is not None:
                libc.fflush(None)  # oneDNN prints through C's buffered stdout
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        lines = log.read().decode(errors="replace").splitlines()
    names = []
    for line in lines:
        fields = line.split(",")
        if fields[0] == "onednn_verbose" and "exec" in fields:
            at = fields.index("exec")
            names += fields[at + 3:at + 4]  # exec, engine, primitive kind, implementation
    return names


def _screen_rate(route: str, rows: int, cols: int, repeats: int) -> float:
    """GOP/s of one ``row_max_upper`` pass of ``route`` over a random ``[rows, MEASURE_INNER] @
    [MEASURE_INNER, cols]`` tile (one column tile), best of ``repeats`` after a warm-up, in the calling
    thread's CPU time where it runs torch at one thread (``describe``'s timing thread, pinned as a compute
    worker is), else in wall time."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, MEASURE_INNER, generator=g), torch.randn(MEASURE_INNER, cols, generator=g)
    s = ProductScreen(a, b, route, tile_cols=cols, workers=0)
    idx = torch.arange(rows)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    s.row_max_upper(idx)
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        s.row_max_upper(idx)
        best = min(best, clock() - t)
    return 2 * rows * cols * MEASURE_INNER / max(best, 1e-9) / 1e9


def _measure(route: str, floor_small: float) -> RouteReport:
    """Time ``route`` (module docstring, "Choosing a route by measurement"): its small tile under
    oneDNN's verbose log, then, unless that shows a reference kernel, its own screening tile."""
    small = []
    kernels = _onednn_implementations(lambda: small.append(_screen_rate(route, *SMALL_TILE, repeats=1)))
    reference = next((k for k in kernels if re.search(r"(^|:)ref", k)), "")
    if not reference and small[0] * REFERENCE_SLOWDOWN < floor_small:
        reference = "timing"
    if reference:
        why = (f"oneDNN runs it on its reference kernel ({reference})" if reference != "timing" else
               f"a reference kernel's speed (over {REFERENCE_SLOWDOWN}x slower than float32)")
        return RouteReport(route, True, small[0], reference, f"refused: {why}")
    return RouteReport(route, True, _screen_rate(route, SCREEN_ROWS[route], TILE_COLS, repeats=3))


_choices: dict[str, RouteChoice] = {}
_choosing = threading.Lock()  # one measurement per device, however many threads ask at once


def describe(device_type: str = "cpu") -> RouteChoice:
    """The screen route of ``device_type``, chosen once per process by measurement (module docstring):
    each route's exactness, its measured rate and why it was or was not chosen. ``str()`` of the result
    is a table; the benchmarks print it. Devices other than the CPU: bfloat16 (not timed)."""
    with _choosing:
        if device_type not in _choices:
            _choices[device_type] = _choose_route(device_type)
        return _choices[device_type]


def _choose_route(device_type: str) -> RouteChoice:
    """``describe``'s measurement, run every time it is called."""
    if device_type != "cpu":
        reports = (RouteReport("bfloat16", True), RouteReport("float32", True, refused="not timed off the CPU"))
        return RouteChoice(device_type, "bfloat16", reports)

    def measure_all():
        compute_pool.pin_to_one_thread()  # the thread count the screen's tiles run at (compute_pool)
        exact = exact_routes()
        floor = _screen_rate("float32", *SMALL_TILE, repeats=3)
        reports = [RouteReport("float32", True, _screen_rate("float32", SCREEN_ROWS["float32"], TILE_COLS, 3))]
        for route in BACKENDS:
            if route == "float32":
                continue
            if route not in exact:
                reports.append(RouteReport(route, False, refused="refused: inexact here (its probe failed)"))
            elif route.endswith("-narrow") and route.removesuffix("-narrow") in exact:
                # the same kernel, exact at full range too: the wider weights give the tighter bound
                reports.append(RouteReport(route, True, refused=f"not timed: {route.removesuffix('-narrow')}, "
                                                                f"the same kernel, is exact at full range"))
            else:
                reports.append(_measure(route, floor))
        return reports

    # on a thread of its own, pinned like a compute worker, ended after: never waiting on the pool, whose
    # workers may be running tasks that are themselves waiting for this choice
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pcw-screen-timing") as timer:
        reports = timer.submit(measure_all).result()
    reports.sort(key=lambda r: BACKENDS.index(r.route))
    choice = RouteChoice(device_type, choose(reports), tuple(reports))
    _log.info("%s", choice)
    return choice


def exact_route(device_type: str = "cpu") -> str:
    """The fastest screen route that is exact on this machine, measured once per process (``describe``):
    never slower than float32 there."""
    return describe(device_type).route


def _quantise_rows(x: torch.Tensor, qmax: int = 127, shared: bool = False):
    """Per-row int8 quantisation ``x_i = s_i x̃_i + e_i`` of ``x [n, r]`` (float32, ``s_i = max|x_i| / qmax``;
    ``shared``: every ``s_i`` the largest, one scale for all rows).

    Returns ``(x̃ [n, r] int8, s [n], ||x̃_i|| [n], ||e_i|| [n])``: the terms of the int8 bound
    (module docstring), for the rows of ``a`` and the columns of ``b`` alike.
    """
    lo, hi = torch.aminmax(x, dim=1)  # (no |x| temporary)
    s = torch.maximum(-lo, hi).clamp_min(torch.finfo(torch.float32).tiny) / qmax
    if shared:
        s = s.max().expand_as(s)
    xq = torch.div(x, s[:, None]).round_()
    err = torch.linalg.vector_norm(torch.addcmul(x, xq, s[:, None], value=-1), dim=1)
    return xq.to(torch.int8), s, torch.linalg.vector_norm(xq, dim=1), err


class ProductScreen:
    """Upper bounds on entries of ``a [m, r] @ b [r, n]`` (float32) from a low-precision GEMM.

    ``row_max_upper(rows)``: ``[len(rows)]`` bounds ``>= max_j (a @ b)[i, j]``; ``tile_max_upper``
    the same per column tile (optionally only the tiles a row needs).
    ``candidates(rows, level)``: every ``(i, j)`` with ``(a @ b)[rows[i], j] > level`` is returned
    (and some that are not). ``backend``: one of ``BACKENDS``; default ``exact_route()`` of the
    factors' device. A route this machine's probe found inexact is refused (``ValueError``).
    ``row_maps [n_maps, r, r]`` (optional): screen the rows of every ``a @ M.T`` instead, stacked:
    row ``i`` of map ``t`` is row ``t * m + i`` (a rotary key at each query - key offset, against one
    set of queries: the columns are quantised once). Memory: the quantised factors (rows: ``n_maps``
    times) plus one ``[rows, TILE_COLS]`` tile per worker.

    **Threads.** On CPU each call's tiles are independent tasks on the process's single-thread compute
    workers (``compute_pool``; the caller waits and assembles them in tile order): never one short
    parallel region per tile, which collapses on a loaded host (module docstring there), and never
    more threads than cores however many screens run at once (their tiles are served by each
    calling thread's ``compute_pool.priority``: a click's before the background fill's). The tiles are the same GEMMs on the same
    inputs as a serial loop, so the int8 routes' results are identical to it. ``workers``: tasks one
    call runs at once (default ``compute_pool.worker_count()``); ``0``: the serial loop in the calling
    thread at its torch thread count (the path before the pool, kept for ``bench_contention``'s
    comparison). Other devices: always that loop.
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, backend: str | None = None, tile_cols: int | None = None,
                 row_maps: torch.Tensor | None = None, workers: int | None = None):
        tile_cols = TILE_COLS if tile_cols is None else tile_cols  # (read at call time: tests narrow it)
        if backend is None:
            backend = exact_route(a.device.type)
        if backend not in SCREEN_ROWS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend in INT8_WEIGHT_MAX and backend not in exact_routes(a.device.type):
            raise ValueError(f"the {backend!r} screen is not exact on this machine (its int8 probe failed: "
                             f"the kernel here does not return exact int32 products at that range); "
                             f"exact routes here: {exact_routes(a.device.type)}")
        compute_pool.check_workers(workers)  # (refused here, not at the first screen)
        self.workers = workers if a.device.type == "cpu" else 0
        # rows of bt are the columns of b: every reduction below runs along contiguous rows
        a, bt = a.float(), b.float().T.contiguous()
        int8 = backend in INT8_WEIGHT_MAX
        low = torch.bfloat16 if backend == "bfloat16" else torch.float32
        # one map's float rows at a time (int8: only their quantisation is kept)
        norms, rows = [], []
        for x in (a,) if row_maps is None else (a @ M.float().T for M in row_maps):
            norms.append(torch.linalg.vector_norm(x, dim=1))
            rows.append(_quantise_rows(x) if int8 else x.to(low))
        self.backend = backend
        self.block_rows = SCREEN_ROWS[backend]
        self.n = bt.shape[0]
        cols = range(0, self.n, tile_cols)
        self._starts = list(cols)
        a_norm = torch.cat(norms)
        b_norm_max = torch.linalg.vector_norm(bt, dim=1).max()
        slack = FLOAT_SLACK * a_norm * b_norm_max
        if int8:
            self._x, alpha, aq_norm, e_norm = (torch.cat(parts) for parts in zip(*rows))
            qlinear = backend in QLINEAR
            # w [n, r]: a linear layer's weight; int_mm: one scale for every column (module docstring)
            w, beta, bq_norm, f_norm = _quantise_rows(bt, INT8_WEIGHT_MAX[backend], shared=not qlinear)
            self._margin = alpha * aq_norm * f_norm.max() + e_norm * b_norm_max + slack
            self._scale = max(float(aq_norm.max() * (beta * bq_norm).max()) / 254, torch.finfo(torch.float32).tiny)
            self._alpha_s = alpha * (self._scale if qlinear else beta[0])
            # oneDNN's int8 kernel falls to a path ~1000x slower for an inner dimension under 32
            # (d_head 16: 7.8 s for a 4096^2 tile against 5 ms at 32); zero columns change no
            # product and no norm of the bound
            pad = -a.shape[1] % INNER_MULTIPLE
            self._x, w = (torch.nn.functional.pad(t, (0, pad)) for t in (self._x, w))
            if qlinear:
                rows_hint = [self.block_rows, w.shape[1]]
                self._tiles = [(torch.ops.onednn.qlinear_prepack(w[c:c + tile_cols], rows_hint), beta[c:c + tile_cols])
                               for c in cols]
            else:
                self._tiles = [w[c:c + tile_cols].T.contiguous() for c in cols]
        else:
            relative = (bf16_relative_error if backend == "bfloat16" else fp32_relative_error)(a.shape[1])
            self._margin = relative * a_norm * b_norm_max + slack
            self._x = torch.cat(rows)
            self._tiles = [bt[c:c + tile_cols].T.to(low).contiguous() for c in cols]

    def _tile(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """Low-precision product of quantised rows ``x`` with column tile ``t``: int8, int32, bf16 or fp32 ``[R, C]``."""
        if self.backend in QLINEAR:
            w, beta = self._tiles[t]
            return _qlinear(x, w, beta, self._scale)
        if self.backend in INT_MM:
            return torch._int_mm(x, self._tiles[t])
        return x @ self._tiles[t]

    def _map(self, task, n: int) -> list:
        """``[task(0), ..., task(n - 1)]``: on the compute workers, or serially (``workers``, class docstring)."""
        return compute_pool.map_tasks(task, n, self.workers)

    @property
    def n_tiles(self) -> int:
        """How many column tiles of ``tile_cols`` (default ``TILE_COLS``; the last may be shorter)."""
        return len(self._tiles)

    def row_max_upper(self, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows)]`` float32 upper bounds of ``max_j (a @ b)[rows, j]`` (never below the truth)."""
        return self.tile_max_upper(rows).amax(1)

    def tile_max_upper(self, rows: torch.Tensor, need: torch.Tensor | None = None) -> torch.Tensor:
        """``[len(rows), n_tiles]`` float32 upper bounds of each row's maximum over each column tile.

        ``need [len(rows), n_tiles]`` (bool, optional): compute only these (row, tile) entries, the
        rest are ``-inf``; the rows a tile needs go through its GEMM together, ``block_rows`` at a time.
        """
        if need is None:
            x = self._x[rows]
            # each tile is reduced while still in cache; its [R] maxima are stacked (a strided out= is slower)
            best = torch.stack(self._map(lambda t: torch.amax(self._tile(x, t), 1), self.n_tiles), 1).float()
        else:
            best = torch.full((rows.numel(), self.n_tiles), -torch.inf, device=self._x.device)
            parts = []  # (tile, rows of it): a tile's rows go through its GEMM block_rows at a time
            for t in range(self.n_tiles):
                at = need[:, t].nonzero().flatten()
                parts += [(t, at[start : start + self.block_rows]) for start in range(0, at.numel(), self.block_rows)]
            found = self._map(lambda p: torch.amax(self._tile(self._x[rows[parts[p][1]]], parts[p][0]), 1), len(parts))
            for (t, part), tile_max in zip(parts, found):
                best[part, t] = tile_max.float()
        if self.backend in QLINEAR:
            upper = self._alpha_s[rows, None] * (best + 1) + self._margin[rows, None]
            upper = torch.where(best >= 127, torch.inf, upper)  # saturated: no bound
        elif self.backend in INT_MM:
            upper = self._alpha_s[rows, None] * best + self._margin[rows, None]
        else:
            upper = best + self._margin[rows, None]
        return upper if need is None else upper.masked_fill_(~need, -torch.inf)

    def candidates(self, rows: torch.Tensor, level: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(i, j)`` index tensors: a superset of the entries with ``(a @ b)[rows[i], j] > level``."""
        x = self._x[rows]
        floor = level - self._margin[rows]
        int8 = self.backend in INT8_WEIGHT_MAX
        keep_all = None
        if self.backend in QLINEAR:
            # o + 1 > floor / (alpha S) is needed; o <= t with t < that - 1 rules an entry out.
            # A saturated o = 127 always passes (t <= 126). Where t < -128 no int8 o is <= t (a level
            # far below what the row's scale can express): such a row keeps every entry.
            t = torch.floor(floor.double() / self._alpha_s[rows].double() - 1 - 1e-3)
            cut = t.clamp(-128, 126).to(torch.int8)[:, None]
            below = t < -128
            if bool(below.any()):
                keep_all = below[:, None]
        elif int8:
            # int_mm: p > floor / (alpha beta) is needed; p <= t with t below that rules an entry out
            # (a t under every possible p keeps the whole row by itself)
            t = torch.floor(floor.double() / self._alpha_s[rows].double() - 1e-3)
            cut = t.clamp(-2**31, 2**31 - 1).to(torch.int32)[:, None]
        else:
            cut = floor[:, None]

        def passed(t: int):
            tile = self._tile(x, t)
            keep = tile > cut if int8 else tile.float() > cut
            if keep_all is not None:
                keep |= keep_all
            i, j = torch.nonzero(keep, as_tuple=True)
            return i, j + self._starts[t]

        found = self._map(passed, self.n_tiles)
        return torch.cat([f[0] for f in found]), torch.cat([f[1] for f in found])
