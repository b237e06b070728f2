"""The ordinary state of a researcher's kernel (issue 51): the explorer's fill running, a section the
reader asked for, clicks on new heads every few seconds, with 0 and 1 busy neighbour processes; in
seconds and in forwards of the same Hugging Face model measured in the same run.

Run:  .venv/bin/python benchmarks/bench_busy_kernel.py [--shape llama-135m] [--tokens 92] [--every 2]
      [--clicks 6] [--busy 0 1] [--fill-timeout 600] [--smoke]

``--smoke``: ``bench_build``'s ``tiny`` shape (2 x 4 heads) on 20 tokens, 2 clicks: checks that the script
runs end to end.

The model is ``bench_build``'s (random weights, nothing downloaded; ``llama-135m`` is SmolLM2-135M's
shape: 30 x 9 heads, 3 key-value heads, vocabulary 49,152). The views work as under a kernel
(``KernelLoop``: the scheduler's workers compute, this thread applies results as the IO loop would).

For each count of busy neighbours (``busy.py``), in one process:

* **alone**: the yardsticks, nothing else running: one forward; the exact skip-trigram table of a head
  never shown, clicked in an explorer whose fill is stopped (every view final); and
  ``pcw.measured_composition(model, text, "K")`` called as from a notebook cell.
* **busy**: a new explorer; its fill starts (the head-loss table, then every head), the composition
  section is switched to "measured" (K: asked-for work) and ``--clicks`` heads never shown are clicked,
  the next one ``--every`` s after the last, or once the last one's exact table is final if that takes
  longer (a reader clicks, then reads the table). Rows: each click's first visit (every view final,
  the exact table included), the measured composition's completion, and then, clicks over, the fill's
  rate (heads a minute) and whether it reached every head within ``--fill-timeout`` s.
* **settled CPU**: CPU seconds the process's threads used over 5 s once every view is settled and the
  fill stopped (nothing to compute), as a share of one core. (``tests/test_busy_kernel.py`` checks the
  same, and with work waiting behind a held piece; this thread's own loop here polls, as a benchmark
  does, where a kernel's IO loop sleeps until a result is posted.)

Targets (issue 51, 2 cores): waiting costs nothing (<= 1% of a core); with 1 busy neighbour a clicked
head's exact table within 2x its time alone, the measured composition within 2x its time from a cell,
the fill reaching every head.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

import bench_build
import pycircuits_widgets as pcw
from bench_build import KernelLoop, model_and_forward, tokenizer, until_shown
from bench_click import SHAPES, click
from busy import busy, expected_slowdown
from peaks import best_seconds, screen_route
from pycircuits_widgets.analysis import cache
from pycircuits_widgets.widgets.core import scheduler

SETTLED_SPAN = 5.0
"""Seconds the settled explorer's CPU is measured over."""


def fresh(model, heads) -> None:
    """Drop ``heads``' per-head and per-pair cache entries: their next click is a first visit."""
    cache.discard(model, lambda key: any(head in key or key[1:3] == head for head in heads))


def apply(explorer) -> None:
    """What the kernel's IO loop does: apply every view's results so far."""
    for view in [explorer, *explorer.views().values()]:
        view._runner._drain()


def filled_heads(model) -> int:
    """Heads whose exact skip-trigram table is cached (the fill's, or a click's)."""
    return len({key[1:3] for key in cache.keys(model) if key[0] == "skip_trigram_table"})


def alone(model, text, head) -> dict:
    """The yardsticks, nothing else running (module docstring)."""
    explorer = pcw.CircuitExplorer(model, text)
    explorer.stop_background()
    explorer.wait(None)
    fresh(model, [head])
    table = click(explorer, *head)["all"]
    explorer.close()
    t = time.perf_counter()
    pcw.measured_composition(model, text, "K")
    return {"table": table, "measured": time.perf_counter() - t}


def busy_phase(model, text, heads, every: float, fill_timeout: float) -> dict:
    """The explorer's fill, the measured composition and the clicks at once (module docstring)."""
    explorer = pcw.CircuitExplorer(model, text)
    explorer.stop_background()
    until_shown(explorer)
    fresh(model, heads)
    t0 = time.perf_counter()
    explorer.start_background()
    composition = explorer.composition
    composition.source = "measured"
    measured_at = None
    firsts = []
    for layer, head in heads:
        started = time.perf_counter()
        with explorer.hold_trait_notifications():
            explorer.layer, explorer.head = layer, head
        followers = [v for v in explorer.views().values() if v is not composition]  # (busy with "measured")
        done = None
        while done is None or time.perf_counter() - started < every:
            apply(explorer)
            if done is None and not any(v.busy for v in followers):
                done = time.perf_counter() - started
            if measured_at is None and "K" in composition.measured:
                measured_at = time.perf_counter() - t0
            time.sleep(0.01)  # a benchmark polls (the kernel's loop would be woken by the results)
        firsts.append(done)
    while measured_at is None:
        apply(explorer)
        if "K" in composition.measured:
            measured_at = time.perf_counter() - t0
        time.sleep(0.01)
    cfg = model.cfg
    total = cfg.n_layers * cfg.n_heads
    during = filled_heads(model)
    fill_start = time.perf_counter()
    reached = explorer.wait_background(fill_timeout)
    fill_s = time.perf_counter() - fill_start
    filled = filled_heads(model)
    explorer.stop_background()
    explorer.wait(None)
    explorer.wait_background(None)
    before = time.process_time()
    threading.Event().wait(SETTLED_SPAN)
    settled = (time.process_time() - before) / SETTLED_SPAN
    explorer.close()
    return {"firsts": firsts, "measured": measured_at, "fill_s": fill_s, "filled": filled, "during": during,
            "total": total, "reached": reached, "settled": settled}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-135m")
    parser.add_argument("--tokens", type=int, default=92)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between clicks (default 2)")
    parser.add_argument("--clicks", type=int, default=6, help="heads clicked (default 6)")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="busy neighbour counts (default 0 1)")
    parser.add_argument("--fill-timeout", type=float, default=600.0, help="seconds the fill may run after the clicks")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape, 20 tokens, 2 clicks")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.tokens, args.clicks, args.busy, args.fill_timeout = (bench_build.SMOKE_SHAPE,
                                                                              bench_build.SMOKE_TOKENS, 2, [0], 60.0)
    if args.clicks < 1 or min(args.busy) < 0:
        parser.error("--clicks must be >= 1 and --busy counts >= 0")
    torch.set_num_threads(args.threads)
    from pycircuits_widgets.widgets.core import runner

    runner._kernel_loop = KernelLoop
    tok = tokenizer()
    hf, model, text, ids, _ = model_and_forward(SHAPES[args.shape](), tok, args.tokens)
    cfg = model.cfg
    every_head = [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    # heads never shown, spread over the layers (a layer with writers before it)
    step = max(1, len(every_head) // (args.clicks + 2))
    heads = [every_head[i] for i in range(step, len(every_head), step)][:args.clicks + 1]
    yardstick, clicked = heads[0], heads[1:]
    print(f"The busy kernel: {args.shape} ({cfg.n_layers} x {cfg.n_heads} heads, vocabulary {cfg.d_vocab}), "
          f"{ids.shape[1]} tokens, random weights; a click every {args.every} s on {len(clicked)} new heads; "
          f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, "
          f"scheduler workers {scheduler.worker_count()}")
    print(screen_route())
    print("| busy neighbours (fair sharing alone) | forward (s) | exact table alone (s / fwd) "
          "| first visits under load (s / fwd each; x alone at worst) | measured K alone, from a cell (s / fwd) "
          "| measured K under load (s; x alone) | fill: heads with their exact table "
          "| settled CPU (share of a core) | load avg (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for n in args.busy:
        with busy(n):
            with torch.no_grad():  # the yardstick beside the same neighbours
                f = best_seconds(lambda: hf(ids, output_attentions=True), 3)
            fresh(model, heads)
            base = alone(model, text, yardstick)
            r = busy_phase(model, text, clicked, args.every, args.fill_timeout)
        worst = max(r["firsts"]) / base["table"]
        firsts = ", ".join(f"{s:.1f} ({s / f:.0f})" for s in r["firsts"])
        rest = r["filled"] - r["during"]
        fill = (f"{r['during']}/{r['total']} by the clicks' end, {rest} more in {r['fill_s']:.0f} s"
                + (f" ({rest / r['fill_s'] * 60:.1f}/min)" if rest else "")
                + ("" if r["reached"] else ", timed out"))
        print(f"| {n} ({expected_slowdown(args.threads, n):.2f}x) | {f:.3f} "
              f"| {base['table']:.2f} ({base['table'] / f:.1f}) | {firsts}; {worst:.2f}x "
              f"| {base['measured']:.1f} ({base['measured'] / f:.0f}) "
              f"| {r['measured']:.1f}; {r['measured'] / base['measured']:.2f}x "
              f"| {fill} "
              f"| {r['settled']:.2%} | {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
