"""Every screen route this CPU can run, on the two exact top-k searches that use it: the chosen route
against float32's and against the dense product.

    .venv/bin/python benchmarks/bench_routes.py [--threads 2] [--vocab 50257] [--sizes 256 1024 2048 8192 16384] [--smoke]

Prints ``screen.describe()`` (each route's measured rate and why it was chosen or refused), then one
row per usable route (``RouteChoice.usable()``: exact, timed, not a reference kernel) and search:

* exact skip-trigram top-100 of one GPT-2-small-shaped head (random weights, ``d_vocab`` ``--vocab``):
  ``pcw.skip_trigrams(model, 0, 0, k=100)``, the analysis cache cleared before each call;
* ``FactoredMatrix(A [n, 64], B [64, n]).topk(100)`` (Gaussian factors) at each ``--sizes`` ``n``,
  beside the dense route to the same values, rows and columns it must never be slower than:
  ``torch.topk((A @ B).flatten(), 100)`` and the flat indices' rows and columns.

Each time is the best of ``--repeats`` calls (the first call of a route is not timed: the screen's
factors are quantised per call, but the route's kernels warm up once), at ``--threads`` torch threads,
with the load average before and after. The targets (issue 50): skip-trigrams within 1.2x of the float32
route's time or faster, ``topk`` never slower than dense. ``--smoke``: d_vocab 2000, sizes 512, one call.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

from bench_analysis import gpt2_like, uncached
from peaks import best_seconds, load_average, screen_route
from pycircuits_widgets import screen
from pycircuits_widgets.analysis import skip_trigrams
from pycircuits_widgets.factored import FactoredMatrix


def dense_topk(A: torch.Tensor, B: torch.Tensor, n: int):
    """The dense route to what ``FactoredMatrix(A, B).topk(100)`` returns: values, rows and columns."""
    values, flat = torch.topk((A @ B).flatten(), 100)
    return values, flat // n, flat % n


def on_route(route: str, call):
    """``call`` with every screen built in it on ``route`` (the searches build theirs with the default,
    ``screen.exact_route()``)."""
    def go():
        chosen, screen.exact_route = screen.exact_route, lambda device_type="cpu": route
        try:
            return call()
        finally:
            screen.exact_route = chosen
    return go


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="d_vocab 2000, size 512, one call: checks that it runs")
    a = ap.parse_args()
    os.environ.setdefault("PCW_PROGRESS", "0")  # no bars between the timings
    if a.smoke:
        a.vocab, a.sizes, a.repeats = 2000, [512], 1
    torch.set_num_threads(a.threads)
    choice = screen.describe()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
          f"{load_average()} (before)")
    print(screen_route())
    print("| search | route | seconds | / float32 route | / dense |")
    print("|---|---|---|---|---|", flush=True)
    model = gpt2_like(n_layers=1, d_vocab=a.vocab)
    searches = [(f"skip-trigram top-100, d_vocab {a.vocab}", uncached(model, lambda: skip_trigrams(model, 0, 0, k=100)),
                 None)]
    g = torch.Generator().manual_seed(0)
    for n in a.sizes:
        A, B = torch.randn(n, 64, generator=g), torch.randn(64, n, generator=g)
        searches.append((f"FactoredMatrix.topk(100), {n} x {n}", lambda A=A, B=B: FactoredMatrix(A, B).topk(100),
                         lambda A=A, B=B, n=n: dense_topk(A, B, n)))
    for label, search, dense in searches:
        dense_s = None if dense is None else best_seconds(dense, a.repeats)
        times = {route: best_seconds(on_route(route, search), a.repeats) for route in choice.usable()}
        for route, seconds in times.items():
            mark = " (chosen)" if route == choice.route else ""
            vs_dense = "" if dense_s is None else f"{seconds / dense_s:.2f}x"
            print(f"| {label} | {route}{mark} | {seconds:.4f} | {seconds / times['float32']:.2f}x | {vs_dense} |",
                  flush=True)
        if dense_s is not None:
            print(f"| {label} | dense product + torch.topk | {dense_s:.4f} | | 1.00x |", flush=True)
    print(f"{load_average()} (after)")


if __name__ == "__main__":
    main()
