"""The skip-trigram screen and a CircuitExplorer click beside N busy processes: slowdown against what
fair CPU sharing alone explains (issue 43, "graceful under load").

Run:  .venv/bin/python benchmarks/bench_contention.py [--busy 0 1 2 4] [--repeats 3] [--blocks 2]
      [--threads 2] [--old-click] [--no-click] [--smoke]

``--smoke``: a small screen (4096 x 2048) and ``bench_build``'s ``tiny`` shape, beside 0 and 1 busy
processes, once each: checks that the script runs end to end (its numbers mean nothing).

For each N in ``--busy``, N single-core busy processes (``busy.busy``) run while this measures,
each figure the median of ``--repeats`` runs:

* screen: the exact skip-trigram table's low-precision screen at GPT-2-small shape, as
  ``bench_click``'s screen floor runs it: one OV screen (``screen.ProductScreen`` of random
  ``[49152, 64]`` and ``[64, 49152]`` factors, this machine's exact route), ``row_max_upper`` over
  ``--blocks`` blocks of ``block_rows`` (4096 on the int8 routes) sources against all 49152 columns (48 tiles of 1024
  per block; the whole screen is 12 blocks, the slowdowns are the same).
  "pool": the tiles as tasks on ``compute_pool``'s single-thread workers (the default path);
  "serial": ``ProductScreen(workers=0)``, the loop before the pool: every tile's GEMM and row max
  a parallel region of torch's ``--threads`` intra-op threads in this thread;
* click: ``bench_click``'s first visit of a head (GPT-2 small, 12 x 12 heads, vocabulary 49152,
  random weights, 100 tokens): its cached entries dropped, the click timed until every view is
  final, the exact skip-trigram table included, then back to the first head (not timed). With
  ``--old-click`` also with ``compute_pool.use_pool(False)`` (every screen the serial loop).

Columns: seconds, the slowdown against N = 0, ``busy.expected_slowdown(threads, N)`` (what fair
sharing of this machine's cores alone costs a job of ``--threads`` threads beside N busy ones)
and the ratio slowdown / expected (target <= 1.5: the job keeps its share of the CPU). A loaded
host shows in the N = 0 row: it is the yardstick, and the load average is printed with each row.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch

from busy import busy, expected_slowdown
from peaks import screen_route

SETTLE_S = 1.0
"""Seconds for the busy processes to start spinning before the first timing."""
GPT2_SMALL = {"vocab": 49152, "d_head": 64, "rows": None}  # rows: the route's block_rows
SMOKE = {"vocab": 2048, "d_head": 64, "rows": 4096}


def screen_run(shape: dict, blocks: int, workers: int | None):
    """A call timing ``blocks`` row blocks of one OV screen at ``shape`` (module docstring)."""
    from pycircuits_widgets.screen import ProductScreen

    g = torch.Generator().manual_seed(0)
    V, r = shape["vocab"], shape["d_head"]
    rows = shape["rows"]
    s = ProductScreen(torch.randn(max(V, rows or 0), r, generator=g), torch.randn(r, V, generator=g), workers=workers)
    rows = rows or s.block_rows
    block = [torch.arange(b * rows, (b + 1) * rows) % max(V, rows) for b in range(blocks)]
    s.row_max_upper(block[0])  # warm-up: oneDNN's kernels, the pool's workers

    def run() -> float:
        t0 = time.perf_counter()
        for b in block:
            s.row_max_upper(b)
        return time.perf_counter() - t0

    return run


def click_runs(shape: str, tokens: int):
    """``(new_head, label)``: a call timing one first-visit click (module docstring) and the shape's name."""
    import bench_build
    import pycircuits_widgets as pcw
    from bench_click import SHAPES, click
    from pycircuits_widgets.analysis import cache
    from pycircuits_widgets.widgets.core import runner

    runner._kernel_loop = bench_build.KernelLoop  # every Runner: background worker, as in a notebook
    _, model, text, _, _ = bench_build.model_and_forward(SHAPES[shape](), bench_build.tokenizer(), tokens)
    explorer = pcw.CircuitExplorer(model, text)
    explorer.stop_background()  # no fill beside the clicks: each click alone with the busy processes
    bench_build.until_shown(explorer)
    explorer.wait(None)
    start, cfg = (explorer.layer, explorer.head), model.cfg
    target = (cfg.n_layers // 2, cfg.n_heads // 2 + 1)

    def run() -> float:
        cache.discard(model, lambda key: target in key or key[1:3] == target)
        seconds = click(explorer, *target)["all"]
        click(explorer, *start)  # back (a revisit: cached), so the next run clicks a head not shown
        return seconds

    return run


def row(name: str, n: int, seconds: float, base: float, threads: int) -> str:
    expected = expected_slowdown(threads, n, cores=_cores())
    slowdown = seconds / base
    return (f"| {name} | {n} | {seconds:.3f} | {slowdown:.2f} | {expected:.2f} | {slowdown / expected:.2f} "
            f"| {os.getloadavg()[0]:.1f} |")


def _cores() -> int:
    from pycircuits_widgets.compute_pool import cores

    return cores()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2, 4], help="busy processes beside each "
                        "measurement (default 0 1 2 4; the first is the yardstick, so start with 0)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure, the median is shown (default 3)")
    parser.add_argument("--blocks", type=int, default=2, help="row blocks of the screen timed (default 2 of 12)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--tokens", type=int, default=100, help="tokens of the click's text (default 100)")
    parser.add_argument("--old-click", action="store_true", help="also time the click with every screen serial")
    parser.add_argument("--no-click", action="store_true", help="the screen only")
    parser.add_argument("--smoke", action="store_true", help="a small screen and the tiny shape, beside 0 and 1 busy "
                        "processes, once: checks that the script runs end to end")
    args = parser.parse_args()
    shape, click_shape = GPT2_SMALL, "gpt2-small"
    if args.smoke:
        shape, click_shape, args.busy, args.repeats, args.blocks, args.tokens = SMOKE, "tiny", [0, 1], 1, 1, 20
    if any(n < 0 for n in args.busy) or args.repeats < 1 or args.blocks < 1:
        parser.error("--busy takes counts >= 0; --repeats and --blocks at least 1")
    torch.set_num_threads(args.threads)
    from pycircuits_widgets import compute_pool

    runs = {"screen, pool": screen_run(shape, args.blocks, None), "screen, serial": screen_run(shape, args.blocks, 0)}
    if not args.no_click:
        click_run = click_runs(click_shape, args.tokens)
        runs["click, pool"] = click_run
        if args.old_click:
            def old_click():
                compute_pool.use_pool(False)
                try:
                    return click_run()
                finally:
                    compute_pool.use_pool(True)

            runs["click, serial"] = old_click
    pool = compute_pool.shared()
    print(f"Screen (GPT-2 small OV, {args.blocks} blocks of 4096 sources x {shape['vocab']}) and a first-visit click "
          f"beside N busy processes; torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
          f"{_cores()} cores, compute pool of {0 if pool is None else pool.size} workers; median of {args.repeats}")
    print(f"load average (1 min) before: {os.getloadavg()[0]:.1f}")
    print(screen_route())
    print("| what | busy N | seconds | slowdown vs N=0 | expected (fair share) | slowdown / expected (target <= 1.5) "
          "| load avg |")
    print("|---|---|---|---|---|---|---|", flush=True)
    base = {}
    for n in args.busy:
        with busy(n):
            if n:
                time.sleep(SETTLE_S)
            times = {name: [] for name in runs}
            for _ in range(args.repeats):  # the paths alternate: each sees the same load
                for name, run in runs.items():
                    times[name].append(run())
            for name, ts in times.items():
                seconds = statistics.median(ts)
                base.setdefault(name, seconds)
                print(row(name, n, seconds, base[name], args.threads), flush=True)
    print(f"load average (1 min) after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    sys.exit(main())
