"""Bounded busy processes: load the machine by a known amount while a benchmark measures.

    .venv/bin/python benchmarks/busy.py [N] [--seconds S] [--smoke]

Each busy process spins one pure-Python loop, so it asks for exactly one core, never more, and
holds no lock the measured process needs. Other benchmarks import ``busy(n)`` (a context manager
that starts ``n`` of them and kills them on exit) and ``expected_slowdown`` (what fair CPU sharing
alone costs a job of ``threads`` threads beside them), and report their slowdown against it. Run
as a script, it loads this machine for ``S`` seconds (default: until Ctrl-C), e.g. to try the live
explorer on a busy machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time

SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def busy(n: int):
    """Run ``n`` single-core busy processes for the duration of the ``with`` block."""
    if n < 0:
        raise ValueError(f"the number of busy processes must be >= 0, got {n}")
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def expected_slowdown(threads: int, n_busy: int, cores: int | None = None) -> float:
    """Slowdown of a job of ``threads`` compute threads beside ``n_busy`` busy processes under fair
    sharing: each of the ``threads + n_busy`` runnable threads gets ``cores / (threads + n_busy)`` of
    a core (at most one), so the job keeps that share of the ``min(threads, cores)`` cores it had."""
    cores = os.cpu_count() if cores is None else cores
    per_thread = min(1.0, cores / (threads + n_busy))
    return min(threads, cores) / (threads * per_thread)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=1, help="busy processes (default 1)")
    parser.add_argument("--seconds", type=float, default=None, help="how long (default: until Ctrl-C)")
    parser.add_argument("--smoke", action="store_true", help="1 process for 0.5 s: checks that the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.n, args.seconds = 1, 0.5
    with busy(args.n) as procs:
        print(f"{len(procs)} busy processes on {os.cpu_count()} CPUs; a 2-thread job beside them is expected "
              f"{expected_slowdown(2, args.n):.2f}x slower, a 1-thread job {expected_slowdown(1, args.n):.2f}x", flush=True)
        try:
            time.sleep(float("inf") if args.seconds is None else args.seconds)
        except KeyboardInterrupt:
            pass
        print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    sys.exit(main())
