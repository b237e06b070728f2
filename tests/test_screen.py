"""ProductScreen: its bounds never fall below the truth (dense float64), on adversarial inputs."""

import platform
import threading

import pytest
import torch

from pycircuits_widgets import compute_pool, screen
from pycircuits_widgets.screen import ProductScreen, bf16_relative_error, fp32_relative_error

BACKENDS = screen.describe().usable()
"""The routes measured here and not refused: the ones a screen can run on this machine (a route oneDNN runs
on its reference kernel would take minutes for these tests, and is never chosen)."""
INT8 = [b for b in BACKENDS if b in screen.INT8_WEIGHT_MAX]
QLINEAR = [b for b in screen.exact_routes() if b in screen.QLINEAR]
"""The quantised-linear routes exact here, measured fast or not: their saturation test is small enough
for a reference kernel."""


def _spread(rows, cols, log_spread, dim, gen):
    """Gaussian [rows, cols] with norms along ``dim`` spread over exp(±log_spread)."""
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    shape = (rows, 1) if dim == 0 else (1, cols)
    return x * torch.exp((torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * log_spread)


def _check(a, b, backend, level_rank=200, tile_cols=300):
    """row_max_upper >= true row max, and candidates contain every entry above a level."""
    s = ProductScreen(a.float(), b.float(), backend, tile_cols=tile_cols)
    exact = a.float().double() @ b.float().double()  # the screened matrix is the float32 factors' product
    rows = torch.randperm(a.shape[0], generator=torch.Generator().manual_seed(0))[: min(700, a.shape[0])]
    upper = s.row_max_upper(rows).double()
    true_max = exact[rows].amax(1)
    assert (upper >= true_max).all(), f"{backend}: bound below the truth by {(true_max - upper).max():.3g}"
    level = float(exact[rows].flatten().kthvalue(exact[rows].numel() - level_rank).values)
    i, j = s.candidates(rows, level)
    truth = torch.nonzero(exact[rows] > level)
    found = set(zip(i.tolist(), j.tolist()))
    missing = [(int(x), int(y)) for x, y in truth if (int(x), int(y)) not in found]
    assert not missing, f"{backend}: {len(missing)} entries above the level were screened out"
    return s, upper, true_max, len(found)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_hold_with_row_and_column_norms_spread_over_e9(backend):
    g = torch.Generator().manual_seed(1)
    a, b = _spread(1500, 64, 9.0, 0, g), _spread(64, 2000, 9.0, 1, g)
    _check(a, b, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_level_below_every_entry_keeps_every_entry(backend):
    """Rank-1 factors put every product at +-||a_i|| |b_j|, so the int8 outputs saturate at both ends.
    With the level below every entry (a bottom-k's running k-th value, say) no entry may be screened
    out, however far the level lies below what a row's scale can express."""
    g = torch.Generator().manual_seed(5)
    a, b = _spread(40, 1, 3.0, 0, g), torch.randn(1, 50, generator=g, dtype=torch.float64)
    s = ProductScreen(a.float(), b.float(), backend)
    level = float((a.float().double() @ b.float().double()).min()) - 1.0
    i, j = s.candidates(torch.arange(40), level)
    assert sorted(zip(i.tolist(), j.tolist())) == [(x, y) for x in range(40) for y in range(50)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_hold_at_large_inner_dimension(backend):
    # d_model-sized contractions (a FactoredMatrix [V, 768] @ [768, V]); ρ_r grows with r
    g = torch.Generator().manual_seed(2)
    a, b = _spread(600, 768, 2.0, 0, g), _spread(768, 900, 2.0, 1, g)
    _check(a, b, backend)
    a, b = _spread(100, 4096, 1.0, 0, g), _spread(4096, 300, 1.0, 1, g)
    _check(a, b, backend, level_rank=50)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("r", [16, 24, 33])
def test_bounds_hold_at_thin_inner_dimensions(backend, r):
    # the shipped models' d_head is 16: the int8 factors are zero-padded to a multiple of 32
    g = torch.Generator().manual_seed(r)
    a, b = _spread(1100, r, 3.0, 0, g), _spread(r, 1300, 3.0, 1, g)
    s, *_ = _check(a, b, backend)
    if backend in INT8:
        assert s._x.shape[1] % screen.INNER_MULTIPLE == 0 and s._x.shape[1] - r < screen.INNER_MULTIPLE


@pytest.mark.parametrize("backend", BACKENDS)
def test_near_ties_at_the_level_are_kept(backend):
    # many entries equal the level or sit one float32 ulp above it: all must be candidates
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-3, 4, (800, 8), generator=g).double()
    b = torch.randint(-3, 4, (8, 1200), generator=g).double()
    b[:, :50] *= 1 + 2.0**-23  # a column block a hair above its integer twins
    _, _, _, n_found = _check(a, b, backend, level_rank=3000)
    assert n_found >= 3000


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_hold_when_every_rounding_error_points_the_same_way(backend):
    # positive entries just under a rounding tie, in the units of both backends: bf16 steps of
    # 2^-7 on [1, 2) and int8 steps of max|x| / 127 (the 127 entry fixes the scale at 1). Each
    # input rounds down, so every product is underestimated and Cauchy-Schwarz is nearly tight.
    g = torch.Generator().manual_seed(6)
    def tie_heavy(rows, cols):
        steps = torch.randint(0, 126, (rows, cols), generator=g).double() + 0.499
        steps[:, 0] = 127
        bf16 = 1 + torch.randint(0, 127, (rows, cols), generator=g).double() * 2.0**-7 + 0.499 * 2.0**-7
        return steps if backend in INT8 else bf16
    a, b = tie_heavy(400, 64), tie_heavy(300, 64).T
    _check(a, b, backend, level_rank=500, tile_cols=128)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bound_is_tight_on_gaussian_factors(backend):
    # the margin is a few per cent of the row maximum: tight enough to prune (not the norm bound)
    g = torch.Generator().manual_seed(4)
    a, b = _spread(1000, 64, 0.5, 0, g), _spread(64, 5000, 0.5, 1, g)
    _, upper, true_max, _ = _check(a, b, backend)
    assert ((upper - true_max) / true_max.abs()).median() < 0.1


@pytest.mark.parametrize("backend", INT8)
def test_int8_bound_holds_when_quantisation_errors_align_with_the_column(backend):
    # columns of ±1 (exact in int8); row i = 127 s + integers + 0.499 s for the signs s of column
    # j(i): its rounding error is parallel to that column, so ||e_i|| ||b_j|| is attained
    g = torch.Generator().manual_seed(7)
    b = torch.randint(0, 2, (64, 50), generator=g).double() * 2 - 1
    target = torch.randint(0, 50, (200,), generator=g)
    signs = b[:, target].T
    a = torch.randint(-40, 41, (200, 64), generator=g).double() + 0.499 * signs
    a[:, 0] = 127 * signs[:, 0]
    s = ProductScreen(a.float(), b.float(), backend)
    exact = a @ b
    for i in range(200):
        j = int(target[i])
        _, cols = s.candidates(torch.tensor([i]), float(exact[i, j]) - 1e-6)
        assert (cols == j).any(), f"row {i}: its entry {float(exact[i, j]):.3f} at column {j} was screened out"


def _row_parallel_to_a_column():
    """``a [50, 64]``, ``b [64, 400]`` with row 7 of ``a`` parallel to column 3 of ``b``: their product
    reaches Cauchy-Schwarz, twice the int8 output's range."""
    g = torch.Generator().manual_seed(5)
    b = torch.randn(64, 400, generator=g)
    a = torch.randn(50, 64, generator=g)
    a[7] = b[:, 3] / b[:, 3].abs().max() * b.abs().max()
    return a, b


@pytest.mark.parametrize("backend", QLINEAR)
def test_int8_saturated_rows_get_no_finite_bound(backend):
    a, b = _row_parallel_to_a_column()
    s = ProductScreen(a, b, backend)
    upper = s.row_max_upper(torch.arange(50))
    assert torch.isinf(upper[7]) and torch.isfinite(upper[torch.arange(50) != 7]).all()
    _i, j = s.candidates(torch.tensor([7]), float("1e30"))
    assert (j == 3).any()  # the saturated entry stays a candidate at any level


def test_bf16_gemm_error_stays_within_the_stated_bound():
    # inputs chosen to round badly in bf16 (just under a half-ulp tie), accumulated over r terms
    for r in (64, 768, 4096):
        g = torch.Generator().manual_seed(r)
        x = (1 + (torch.randint(0, 128, (200, r), generator=g) + 0.499) * 2.0**-7).double()
        y = (1 + (torch.randint(0, 128, (r, 150), generator=g) + 0.499) * 2.0**-7).double()
        x = x * torch.sign(torch.randn(200, r, generator=g))
        low = (x.float().bfloat16() @ y.float().bfloat16()).double()
        exact = x.float().double() @ y.float().double()
        err = (low - exact).abs() / (x.float().double().abs() @ y.float().double().abs())
        assert err.max() <= bf16_relative_error(r)
    assert bf16_relative_error(64) < 2.0**-6 and bf16_relative_error(4096) < 2.0**-6
    assert bf16_relative_error(64) > 3 * 2.0**-8  # unit roundoff 2^-8, three roundings


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        ProductScreen(torch.ones(2, 2), torch.ones(2, 2), "fp8")


def test_an_exact_int8_route_exists_on_x86():
    # every x86-64 CPU torch supports has AVX2 at least, where int8-narrow and int_mm-narrow are exact
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert set(screen.exact_routes()) & set(screen.INT8_WEIGHT_MAX), \
            f"no int8 route passed the probe on {platform.processor() or platform.machine()}"


@pytest.mark.parametrize("route", list(screen.INT8_WEIGHT_MAX))
def test_probe_decision_matches_an_independent_check_of_the_kernel(route):
    # the oracle: 600 random rows at full range (a tenth of them at ±127 with random signs) times
    # 500 random weight columns at the route's range, through the kernel the screen calls, against
    # float64 (the quantised linear at per-column scales, within its output step; int_mm exactly);
    # the probe (a handful of structured rows) must agree with it
    q = screen.INT8_WEIGHT_MAX[route]
    g = torch.Generator().manual_seed(21)
    x = torch.randint(-127, 128, (600, 64), generator=g, dtype=torch.int32)
    x[::10] = 127 * (torch.randint(0, 2, (60, 64), generator=g, dtype=torch.int32) * 2 - 1)
    w = torch.randint(-q, q + 1, (500, 64), generator=g, dtype=torch.int32)
    w[::10] = q * (torch.randint(0, 2, (50, 64), generator=g, dtype=torch.int32) * 2 - 1)
    truth = x.double() @ w.double().T
    if route in screen.QLINEAR:
        col = (truth.abs().amax(0) / 100).clamp_min(1)
        packed = torch.ops.onednn.qlinear_prepack(w.to(torch.int8), [600, 64])
        got = screen._qlinear(x.to(torch.int8), packed, 1 / col.float(), 1.0).double()
        kernel_exact = bool(((got - truth / col).abs() <= 1).all())
    else:
        kernel_exact = torch.equal(torch._int_mm(x.to(torch.int8), w.to(torch.int8).T.contiguous()).double(), truth)
    exact = route in screen.exact_routes()
    assert exact == kernel_exact, f"probe says {exact}, the kernel check {kernel_exact}"
    if not exact:
        with pytest.raises(ValueError, match="not exact on this machine"):
            ProductScreen(torch.randn(4, 8), torch.randn(8, 4), route)


def test_float32_bound_holds_on_sums_that_round_badly():
    # the fp32 route's γ_r bound: every product just under a rounding tie, one sign, r up to 4096
    for r in (64, 4096):
        g = torch.Generator().manual_seed(r)
        x = (1 + (torch.randint(0, 2**20, (100, r), generator=g) + 0.499) * 2.0**-20).float()
        y = (1 + (torch.randint(0, 2**20, (r, 80), generator=g) + 0.499) * 2.0**-20).float()
        err = ((x @ y).double() - x.double() @ y.double()).abs() / (x.double().abs() @ y.double().abs())
        assert err.max() <= fp32_relative_error(r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_maps_screen_every_mapped_row_stacked_map_by_map(backend):
    # row t * m + i is row i of a @ M_t^T: bounds hold for each map, and they are that map's (not
    # another map's) rows: a bound far above the truth would hide a mixed-up index
    g = torch.Generator().manual_seed(3)
    a, b = _spread(120, 16, 3, 0, g).float(), _spread(16, 500, 1, 1, g).float()
    maps = torch.linalg.qr(torch.randn(3, 16, 16, generator=g)).Q * torch.tensor([0.5, 1.0, 2.0])[:, None, None]
    s = ProductScreen(a, b, backend, tile_cols=128, row_maps=maps)
    rows = torch.arange(3 * 120)
    upper = s.row_max_upper(rows).double()
    true_max = torch.cat([(a @ M.T).double() @ b.double() for M in maps]).amax(1)
    assert (upper >= true_max).all()
    assert ((upper - true_max) <= 0.1 * true_max.abs().max()).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tile_bounds_hold_per_column_tile_and_only_where_needed(backend):
    # each [row, tile] bound is above that tile's true max (tiles of 128 columns, the last short) and
    # near it (int8's output step leaves up to ~10% of the row's largest |entry|; a bound read from the
    # wrong tile falls below the truth for about half the rows); the needed-only form computes exactly
    # the needed entries: the same bounds there, -inf elsewhere
    g = torch.Generator().manual_seed(4)
    a, b = _spread(300, 32, 3, 0, g).float(), _spread(32, 700, 1, 1, g).float()
    s = ProductScreen(a, b, backend, tile_cols=128)
    exact = a.double() @ b.double()
    rows = torch.randperm(300, generator=g)[:250]
    truth = torch.stack([exact[rows, c:c + 128].amax(1) for c in range(0, 700, 128)], 1)
    tiles = s.tile_max_upper(rows).double()
    assert s.n_tiles == truth.shape[1] == 6
    assert (tiles >= truth).all()
    assert ((tiles - truth) <= 0.25 * exact[rows].abs().amax(1, keepdim=True)).all()
    assert torch.equal(s.row_max_upper(rows), s.tile_max_upper(rows).amax(1))
    need = torch.rand(250, 6, generator=g) < 0.3
    part = s.tile_max_upper(rows, need).double()
    assert torch.equal(part[need], tiles[need])
    assert (part[~need] == -torch.inf).all()


@pytest.mark.parametrize("backend", INT8)
def test_tiles_on_the_compute_workers_give_exactly_the_serial_loops_results(backend):
    # the same int8 GEMM on the same int8 tiles: each output is exact and does not depend on the thread
    # that computes it, so the pool's results equal the serial loop's (workers=0) bit for bit, in order
    g = torch.Generator().manual_seed(6)
    a, b = _spread(600, 48, 3, 0, g).float(), _spread(48, 1100, 1, 1, g).float()
    pooled, serial = (ProductScreen(a, b, backend, tile_cols=128, workers=w) for w in (None, 0))
    rows = torch.randperm(600, generator=g)[:500]
    assert torch.equal(pooled.tile_max_upper(rows), serial.tile_max_upper(rows))
    need = torch.rand(500, pooled.n_tiles, generator=g) < 0.4
    assert torch.equal(pooled.tile_max_upper(rows, need), serial.tile_max_upper(rows, need))
    level = float(serial.row_max_upper(rows).median())
    for got, want in zip(pooled.candidates(rows, level), serial.candidates(rows, level)):
        assert torch.equal(got, want)


def test_concurrent_screens_share_the_process_pool():
    # a click's screen and the fill's at once: every tile runs on the one pool's workers, never more
    # at once than it has; each screen's first tile waits for the other's, so they do overlap
    pool = compute_pool.shared()
    if pool is None or compute_pool.worker_count() < 2 or not INT8:
        pytest.skip("needs a compute pool of 2 workers or more, and an int8 route (results equal by construction)")
    lock, active, seen = threading.Lock(), [0, 0], set()
    first = threading.Barrier(2, timeout=60)

    class Counted(ProductScreen):
        def _tile(self, x, t):
            with lock:
                active[0] += 1
                active[1] = max(active)
                seen.add(threading.current_thread().name)
            try:
                if t == 0:
                    first.wait()
                return super()._tile(x, t)
            finally:
                with lock:
                    active[0] -= 1

    g = torch.Generator().manual_seed(7)
    factors = [(torch.randn(300, 32, generator=g), torch.randn(32, 900, generator=g)) for _ in range(2)]
    screens = [Counted(a, b, INT8[0], tile_cols=100) for a, b in factors]
    rows = torch.arange(300)
    out = [None, None]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, screens[i].row_max_upper(rows))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (a, b), got in zip(factors, out):
        assert torch.equal(got, ProductScreen(a, b, INT8[0], tile_cols=100, workers=0).row_max_upper(rows))
    assert 2 <= active[1] <= pool.size
    assert all(name.startswith(compute_pool.THREAD_PREFIX) for name in seen)


def test_workers_must_be_a_count():
    with pytest.raises(ValueError, match="workers must be an int >= 0"):
        ProductScreen(torch.ones(4, 2), torch.ones(2, 4), workers=-1)


@pytest.mark.parametrize("backend", [b for b in screen.exact_routes() if b in screen.INT_MM])
def test_int_mm_bounds_stay_finite_and_tight_where_int8_output_saturates(backend):
    # the row that saturates the quantised linear's int8 output (above); int32 products have no such
    # ceiling, so its bound is finite, above the truth and near it (any exact int_mm route: a small test)
    a, b = _row_parallel_to_a_column()
    s = ProductScreen(a, b, backend)
    upper = s.row_max_upper(torch.arange(50)).double()
    true_max = (a.double() @ b.double()).amax(1)
    assert torch.isfinite(upper).all() and (upper >= true_max).all()
    assert upper[7] - true_max[7] < 0.05 * true_max[7]


def _report(route, rate, exact=True, reference="", refused=""):
    return screen.RouteReport(route, exact, rate, reference, refused)


def test_choose_takes_the_fastest_exact_route_and_never_a_reference_kernel():
    # injected measurements: the choice is the fastest exact route that is not a reference kernel
    float32 = _report("float32", 30.0)
    assert screen.choose([_report("int8", 0.05, reference="ref_int8:any", refused="refused"),
                          _report("int_mm", 70.0), _report("bfloat16", 45.0), float32]) == "int_mm"
    # a reference kernel is refused however its rate came out (a noisy timing cannot bring it back)
    assert screen.choose([_report("int8", 500.0, reference="ref_int8:any"), _report("bfloat16", 40.0),
                          float32]) == "bfloat16"
    # an inexact route is never taken, however fast
    assert screen.choose([_report("int8", 400.0, exact=False), float32]) == "float32"
    # float32 is the floor: every other route slower, or none timed
    assert screen.choose([_report("int8-narrow", 20.0), _report("bfloat16", 3.0), float32]) == "float32"
    assert screen.choose([_report("int8", None), _report("bfloat16", None), float32]) == "float32"


def test_describe_refuses_what_probe_and_timing_refuse(monkeypatch):
    # the measurement end to end with injected probe verdicts, kernels and rates (describe's cache aside): an
    # inexact route is not timed; a route oneDNN reports as its reference kernel, or timed at a
    # reference kernel's speed on the small tile, is refused before its big tile; a narrow twin of an
    # exact route is not timed; the fastest remaining route is chosen
    small = {"float32": 10.0, "int8": 9.0, "int_mm": 0.5, "bfloat16": 8.0}  # int_mm: 20x below float32
    big = {"float32": 30.0, "int8": 90.0, "bfloat16": 40.0}
    kernels = {"int8": ["ref_int8:any"]}
    timed = []

    def rate(route, rows, cols, repeats):
        timed.append((route, (rows, cols) == screen.SMALL_TILE))
        return (small if (rows, cols) == screen.SMALL_TILE else big)[route]

    def implementations(fn):
        fn()
        return kernels.get(timed[-1][0], ["brg_matmul:avx512_core"])

    monkeypatch.setattr(screen, "exact_routes", lambda device_type="cpu": ("int8", "int8-narrow", "int_mm",
                                                                            "bfloat16", "float32"))
    monkeypatch.setattr(screen, "_screen_rate", rate)
    monkeypatch.setattr(screen, "_onednn_implementations", implementations)
    choice = screen._choose_route("cpu")
    reports = {r.route: r for r in choice.reports}
    assert choice.route == "bfloat16"
    assert reports["int8"].reference == "ref_int8:any" and "reference kernel" in reports["int8"].refused
    assert reports["int_mm"].reference == "timing" and "10x slower than float32" in reports["int_mm"].refused
    assert not reports["int_mm-narrow"].exact and reports["int_mm-narrow"].rate is None
    assert "int8, the same kernel" in reports["int8-narrow"].refused and reports["int8-narrow"].rate is None
    assert ("int8", False) not in timed and ("int_mm", False) not in timed  # refused on the small tile
    assert ("int_mm-narrow", True) not in timed and ("int8-narrow", True) not in timed
    assert choice.usable() == ("bfloat16", "float32")
    text = str(choice)
    assert "bfloat16" in text.splitlines()[0] and "ref_int8:any" in text


def test_the_chosen_route_is_measured_at_least_as_fast_as_float32_here():
    # the real measurement on this CPU (run again under ONEDNN_MAX_CPU_ISA caps by tests/run.sh):
    # the chosen route's own rate is float32's or better, and no refused route is chosen
    choice = screen.describe()
    reports = {r.route: r for r in choice.reports}
    chosen, floor = reports[choice.route], reports["float32"]
    assert chosen.exact and not chosen.refused and not chosen.reference
    assert chosen.rate is not None and floor.rate is not None and chosen.rate >= floor.rate, str(choice)
    assert choice.route in screen.exact_routes() and choice.route == screen.exact_route()


def test_onednn_reports_the_kernel_the_int8_screen_runs():
    # the verbose log is read for real: the quantised linear's primitive is a oneDNN matmul, named
    assert torch.backends.mkldnn.is_available(), "this torch build has no oneDNN (the CPU wheel ships it)"
    x = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(torch.randint(-64, 65, (16, 64), dtype=torch.int8), [8, 64])
    names = screen._onednn_implementations(lambda: screen._qlinear(x, packed, torch.ones(16), 1.0))
    assert names and all(":" in n for n in names), names


def test_threads_asking_at_once_share_one_measurement(monkeypatch):
    # a click's screen and the fill's may both be the first to ask: one measurement, one answer for both
    monkeypatch.setattr(screen, "_choices", {})
    calls, entered, release = [], threading.Event(), threading.Event()

    def measured(device_type):
        calls.append(device_type)
        entered.set()
        assert release.wait(60), "the test never released the measurement"
        return screen.RouteChoice(device_type, "float32", (_report("float32", 1.0),))

    monkeypatch.setattr(screen, "_choose_route", measured)
    got = [None, None]
    first = threading.Thread(target=lambda: got.__setitem__(0, screen.describe()))
    first.start()
    assert entered.wait(60)
    second = threading.Thread(target=lambda: got.__setitem__(1, screen.describe()))
    second.start()
    release.set()
    first.join(60)
    second.join(60)
    assert calls == ["cpu"] and got[0] is got[1] and got[0].route == "float32"
