"""The machine's measured GEMM peaks (fp32, fp64, bf16, int8), the yardstick of every "% of peak".

    .venv/bin/python benchmarks/peaks.py [--threads 2] [--size 4096] [--smoke]

Each peak is the best of a few large square matmuls (``size`` x ``size``; int8 via
``torch._int_mm``, exact int32 products), in GOP/s (a multiply-add counts 2). ``screen-thin`` is
the roofline of the skip-trigram screen: its own step on the route this process measured fastest
(``screen.describe()``, printed first: ``int8`` is oneDNN's quantised GEMM with int8 output,
``int_mm`` the int8 GEMM with int32 output), inner dimension ``d_head`` = 64, then the row max, on
one tile of the route's rows x 1024 called over and over, the best that kernel does here; with only
64 products per output the per-output work (scaling, rounding, the store and the max) bounds it.
(``int8-thin`` in older tables: the same on the int8 routes, before the route was chosen by timing.)
The other benchmarks import ``measure_peaks_apart`` and print these beside their own figures, measured
in the same run, with the load average: on a shared machine both move together.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def best_seconds(fn, repeats: int, *, warmup: bool = True) -> float:
    """Fastest of ``repeats`` timed calls of ``fn``, after one untimed call when ``warmup``."""
    if warmup:
        fn()  # first call: allocation and library set-up are not the peak
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _sized_rate(name: str, run, size: int, repeats: int) -> tuple[str, float]:
    """``(key, GOP/s)`` of ``run(n)`` (prepares and returns a call of an ``n``-cube GEMM) at ``size``, or
    at the largest power-of-two side from 512 whose call stays under ~2 s, keyed ``name@n`` then: a
    precision with no fast path here (bf16 and ``torch._int_mm`` on AVX2-only CPUs, ~1 GOP/s) would
    take minutes at 4096^2, and its rate is flat in the size anyway."""
    n = min(size, 512)
    while True:
        call = run(n)
        t = best_seconds(call, 1)
        if n >= size or t * 8 > 2:
            break
        n *= 2
    return (name if n == size else f"{name}@{n}"), 2 * n**3 / best_seconds(call, repeats, warmup=False) / 1e9


def measure_peaks(size: int = 4096, repeats: int = 3) -> dict[str, float]:
    """``{dtype: GOP/s}`` of square GEMMs of side ``size`` at the current torch thread count (a precision
    too slow for that size here is measured smaller and keyed ``dtype@side``: ``_sized_rate``)."""
    g = torch.Generator().manual_seed(0)
    peaks = {}

    def matmul(dtype):
        def run(n):
            a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
            out = torch.empty(n, n, dtype=dtype)
            return lambda: torch.matmul(a, b, out=out)
        return run

    def int_mm(n):
        a, b = (torch.randint(-127, 128, (n, n), dtype=torch.int8, generator=g) for _ in range(2))
        return lambda: torch._int_mm(a, b)

    for name, run in (("fp32", matmul(torch.float32)), ("fp64", matmul(torch.float64)),
                      ("bf16", matmul(torch.bfloat16)), ("int8", int_mm)):
        key, rate = _sized_rate(name, run, size, repeats)
        peaks[key] = rate
    peaks["screen-thin"] = thin_screen_peak(repeats=repeats)
    return peaks


def measure_peaks_apart() -> dict[str, float]:
    """:func:`measure_peaks` in a fresh process. A benchmark that times its cases in child
    processes calls this: on Linux a child's ``ru_maxrss`` starts at its parent's peak, so the
    4096² operands measured here would otherwise show up in every child's peak memory."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--json"], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def thin_screen_peak(cols: int = 1024, inner: int = 64, repeats: int = 3) -> float:
    """GOP/s of one screening step (GEMM + row max) on a hot ``[rows, inner] @ [inner, cols]`` tile
    (``rows``: the route's ``SCREEN_ROWS``), on the route this process chose (``screen.exact_route``)."""
    from pycircuits_widgets.screen import SCREEN_ROWS, ProductScreen, exact_route

    route = exact_route()
    rows = SCREEN_ROWS[route]
    g = torch.Generator().manual_seed(0)
    s = ProductScreen(torch.randn(rows, inner, generator=g), torch.randn(inner, cols, generator=g), route,
                      tile_cols=cols)
    idx = torch.arange(rows)
    return 2 * rows * cols * inner / best_seconds(lambda: s.row_max_upper(idx), repeats * 10) / 1e9


def format_peaks(peaks: dict[str, float]) -> str:
    """``fp32 400 GOP/s | fp64 200 GOP/s | ...``: how every benchmark prints the peaks."""
    return " | ".join(f"{k} {v:,.0f} GOP/s" for k, v in peaks.items())


def screen_route() -> str:
    """This process's screen route and every route's measured rate (``screen.describe()``), as a table:
    every benchmark that screens prints it, since the route decides its speed."""
    from pycircuits_widgets import screen

    return str(screen.describe())


def load_average() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--json", action="store_true", help="print only the peaks, as JSON")
    ap.add_argument("--smoke", action="store_true", help="256^2 GEMMs, one call each: checks that the script runs "
                    "(its numbers are not peaks)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    before = load_average()
    if a.smoke:
        a.size = 256
    peaks = measure_peaks(a.size, repeats=1 if a.smoke else 3)
    if a.json:  # for measure_peaks_apart
        print(json.dumps(peaks))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.size}^2 GEMMs; "
          f"{before} (before), {load_average()} (after)")
    print(screen_route())
    print(format_peaks(peaks))


if __name__ == "__main__":
    main()
