"""A click on another head while a long job computes (issue 43 item 1): each long job's time alone,
and the click's time with the job running beside it, in one run.

Run:  .venv/bin/python benchmarks/bench_give_way.py [--shape llama-135m] [--tokens 100] [--threads 2]
      [--jobs trigrams positional neurons paths] [--smoke]

``--smoke``: ``bench_build``'s ``tiny`` shape on 20 tokens: checks that the script runs.

Model: ``bench_click``'s shapes with random weights (nothing downloaded; default ``llama-135m``,
SmolLM2-135M's shape: 30 x 9 heads, vocabulary 49,152, rotary). The views' runners work as under a
Jupyter kernel (``bench_build.KernelLoop``) and the background fill is stopped.

Rows:

* ``trigrams``: a head's first visit alone (every click view but the table final, "others", then
  its exact skip-trigram table), then a first visit of another head made while the previous head's
  exact table is computing (one block of sources in): "others" and the new head's exact table. A
  search that cannot stop midway makes the new head's table wait for the old one's rest.
* ``positional``, ``neurons``, ``paths`` (the on-demand sections): the section alone (from its
  "compute" to its result), then a first visit of a new head made while it computes again (one
  piece in, or 1.5 s in for a job with no count): the click's "others" and exact table, and the
  section's own time with the click beside it.

Each click is a head never shown (its per-head cache entries dropped). A job done before its
midpoint could be reached says so in the note.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import bench_build  # (benchmarks/ is on sys.path when run as a script)
import pycircuits_widgets as pcw
from bench_build import KernelLoop, model_and_forward, tokenizer
from bench_click import SHAPES
from pycircuits_widgets.analysis import cache

POLL = 0.005
"""Seconds between two looks at the views (a benchmark polls; the kernel's loop would apply results)."""
CLICK_VIEWS = ("trigrams", "eigen", "composition", "attention", "bigrams")
SECTIONS = ("positional", "neurons", "paths")
NO_COUNT_MIDWAY = 1.5
"""Seconds into a job with no count (one piece) at which the click is made."""


def drain(explorer) -> None:
    for runner in [explorer._runner] + [v._runner for v in explorer.views().values()]:
        runner._drain()


def until(explorer, condition) -> float:
    t0 = time.perf_counter()
    while not condition():
        drain(explorer)
        time.sleep(POLL)
    return time.perf_counter() - t0


def select(explorer, layer: int, head: int) -> float:
    """Drop the head's cached results and select it; the time it was selected."""
    cache.discard(explorer.model, lambda key: (layer, head) in key or key[1:3] == (layer, head))
    t0 = time.perf_counter()
    with explorer.hold_trait_notifications():
        explorer.layer, explorer.head = layer, head
    return t0


def exact_shown(table, layer: int, head: int) -> bool:
    t = table.trigrams or {}
    return not table.busy and (t.get("layer"), t.get("head"), t.get("exact")) == (layer, head, True)


def click(explorer, layer: int, head: int) -> tuple[float, float]:
    """A first visit of ``(layer, head)``: seconds until every click view but the table is final, and
    until its exact table is shown."""
    views = {n: v for n, v in explorer.views().items() if n in CLICK_VIEWS}
    t0 = select(explorer, layer, head)
    others = None
    while True:
        drain(explorer)
        t = time.perf_counter() - t0
        if others is None and not any(v.busy for n, v in views.items() if n != "trigrams"):
            others = t
        if others is not None and exact_shown(views["trigrams"], layer, head):
            return others, t
        time.sleep(POLL)


def midway(view, t0: float, done) -> bool:
    """A piece of the job is done (its count says so), or ``NO_COUNT_MIDWAY`` s passed, or it is done."""
    p = view.progress or {}
    counted = p.get("done", 0) >= 1 and "state" not in p
    return counted or time.perf_counter() - t0 > NO_COUNT_MIDWAY or done()


def count(view) -> str:
    p = view.progress or {}
    return f"{p['text']} {p['done']}/{p['total']} {p.get('unit', '')}".rstrip() if "total" in p else "no count"


def row(name: str, *cells) -> None:
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def seconds(value) -> str:
    return f"{value:.2f}"


def measure(shape: str, n_tokens: int, jobs: list[str]) -> None:
    _, model, text, ids, forward = model_and_forward(SHAPES[shape](), tokenizer(), n_tokens)
    cfg = model.cfg
    print(f"\n{shape} ({cfg.n_layers}x{cfg.n_heads} heads, vocabulary {cfg.d_vocab}, {ids.shape[1]} tokens): "
          f"forward {forward:.3f} s; load {os.getloadavg()[0]:.1f} at the start")
    explorer = pcw.CircuitExplorer(model, text)
    explorer.stop_background()
    explorer.wait(None)
    heads = iter([(l, h) for l in reversed(range(cfg.n_layers)) for h in range(cfg.n_heads)
                  if (l, h) != (explorer.layer, explorer.head)])
    print("| job | alone (s) | click while it computes: others (s) | its exact table (s) | "
          "job with the click (s) | note |")
    print("|---|---|---|---|---|---|", flush=True)
    table = explorer.trigrams
    if "trigrams" in jobs:
        others, alone = click(explorer, *next(heads))
        before = next(heads)
        t0 = select(explorer, *before)
        until(explorer, lambda: midway(table, t0, lambda: exact_shown(table, *before)))
        at = count(table) if not exact_shown(table, *before) else "done before the click"
        new_others, new_table = click(explorer, *next(heads))
        row("trigrams (a head's exact table)", seconds(alone), seconds(new_others), seconds(new_table), "",
            f"alone: others {others:.2f} s; the click at {at}")
        explorer.wait(None)
    for name in SECTIONS:
        if name in jobs and explorer.views().get(name) is not None:
            section(explorer, name, heads)
    explorer.close()
    print(f"load avg (1 min) at the end: {os.getloadavg()[0]:.1f}", flush=True)


def section(explorer, name: str, heads) -> None:
    """An on-demand section's row: alone, then again with a first visit of a new head made midway."""
    view = explorer.views()[name]

    def done() -> bool:
        return view._ready() and not view.busy

    explorer.compute(name)
    alone = until(explorer, done)
    view.cancel()
    explorer.wait(None)
    if name == "neurons":
        view._norms = None  # (kept by the view) the same work again
    t0 = time.perf_counter()
    view.active = True
    until(explorer, lambda: midway(view, t0, done))
    at = count(view) if view.busy else "done before the click"
    others, new_table = click(explorer, *next(heads))
    until(explorer, done)
    row(name, seconds(alone), seconds(others), seconds(new_table), seconds(time.perf_counter() - t0),
        f"the click at {at}")
    view.cancel()
    explorer.wait(None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-135m")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--jobs", nargs="+", choices=("trigrams", *SECTIONS), default=["trigrams", *SECTIONS])
    parser.add_argument("--smoke", action="store_true", help=f"{bench_build.SMOKE_SHAPE!r} shape, "
                        f"{bench_build.SMOKE_TOKENS} tokens: checks that the script runs end to end")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.tokens = bench_build.SMOKE_SHAPE, bench_build.SMOKE_TOKENS
    torch.set_num_threads(args.threads)
    from pycircuits_widgets.widgets.core import runner  # the widget layer

    runner._kernel_loop = lambda: KernelLoop()  # the views' runners work as under a kernel
    measure(args.shape, args.tokens, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
