"""A head change in the CircuitExplorer (a click) on real model shapes, as multiples of one
forward pass of the same Hugging Face model measured in the same run.

Run:  .venv/bin/python benchmarks/bench_click.py [--shapes gpt2-small] [--tokens 100] [--threads 2]
      [--profile] [--fill-heads N] [--busy N] [--smoke]

``--busy N``: the whole measurement (forward included) runs beside N single-core busy processes
(``busy.py``); the header says what fair CPU sharing alone would cost.

``--smoke``: ``bench_build``'s ``tiny`` shape (2 x 4 heads) on 20 tokens: checks that the script runs end to end.

Models (random weights, nothing downloaded): GPT-2 small (12 x 12 heads, d_model 768, MLPs) with
d_vocab 49152 (the explorer reads the shipped 1024-token tokenizer only for a vocabulary padded to a
multiple of 64, so not 50257), and ``bench_build``'s 135M LLaMA shape; text and the kernel stand-in are
``bench_build``'s.
The explorer is built and ``explorer.wait(None)`` lets every background job finish (the
kernel-less answers included) before any click is timed, so no click shares the CPU with them.
A click sets the explorer's ``(layer, head)`` as the page does; the views' runners compute on
worker threads and the clock stops when every view shows the new head (no view busy):

* forward: ``hf_model(ids, output_attentions=True)``, eager attention, the best of 3 before the
  build and 3 just before the clicks (on a loaded machine a 2-thread forward varies several-fold);
* first visit: a head never computed: its per-head and per-pair entries are dropped from the
  analysis cache (``analysis.cache``) first (the background jobs computed some of them; the
  model-level ones, token Grams, spectra and score tables, stay: they are computed once, for
  the first head shown). "all views" until
  every view is final, the exact skip-trigram table included; "all but the exact table" until
  every other view is final (the table then shows its partial, labelled, answer);
* revisit: back to a head shown before (the explorer's initial head), every view final;
* after the fill: the explorer's background fill (``CircuitExplorer.start_background``, stopped
  for the clicks above so none shares the CPU with it) runs over every head (or the first
  ``--fill-heads``: the selected head, then layer by layer), timed until done; then a click on a
  filled head never shown, every view final. The fill's total time is printed with its heads.

Targets (issue 25): revisit <= 0.3 forwards; first visit <= 8 forwards, all but the exact
table <= 1 forward.

* screen floor: what the exact table's low-precision screens cost for the sources the first visit
  cannot skip, measured in the same run on the clicked head's own factors. The search
  (``analysis.skip_trigrams.top_skip_trigrams``) visits sources in order of their norm bound and
  stops once that bound falls to its running k-th score, which never exceeds the final k-th score;
  so every source whose norm bound beats the final k-th score (read from the head's exact table,
  cached by the first visit) is screened, on the QK side (rotary: against the window's bound,
  ``window_bound``, per destination tile) and on the OV side, by any run of this search. The floor
  is those sources' blocks times one block of each screen (``screen.ProductScreen``, this machine's
  exact route), best of 3; the per-offset screens of the sources the window bound leaves, the exact
  rescoring and the other views come on top. (Before issue 43 the floor screened every source of
  random factors, which the first visit does not: it read above the first visit it bounded.)
``--profile`` prints where the first visit and the revisit spend their time
(cProfile of this thread and the views' worker threads, cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import threading
import time

import torch
import transformers

import bench_build
import pycircuits_widgets as pcw
from bench_build import KernelLoop, model_and_forward, tokenizer, until_shown
from busy import busy, expected_slowdown
from peaks import best_seconds, screen_route
from pycircuits_widgets.analysis import cache
from pycircuits_widgets.analysis.rotary import rotations
from pycircuits_widgets.analysis.skip_trigrams import centred_factors, kept_head_table, window_bound
from pycircuits_widgets.linalg import spectral_norm
from pycircuits_widgets.screen import ProductScreen

SHAPES = {**bench_build.SHAPES, "gpt2-small": lambda: transformers.GPT2Config(vocab_size=49152)}
"""``bench_build``'s shapes, GPT-2 small with a vocabulary the explorer accepts with the shipped
1024-token tokenizer (a multiple of 64)."""
def click(explorer, layer: int, head: int, tick=None) -> dict:
    """Select ``(layer, head)`` and apply the views' results until every view is final; returns
    seconds until every view but the skip-trigram table is final ("others") and until all are.
    ``tick()``, if given, is called after each round of applied results."""
    views = explorer.views()
    runners = [v._runner for v in views.values() if hasattr(v, "_runner")]
    table = views["trigrams"]
    t0 = time.perf_counter()
    with explorer.hold_trait_notifications():
        explorer.layer, explorer.head = layer, head
    others = None
    while True:
        for runner in runners:
            runner._drain()
        if tick is not None:
            tick()
        if others is None and not any(v.busy for name, v in views.items() if name != "trigrams"):
            others = time.perf_counter() - t0
        if others is not None and not table.busy:
            return {"others": others, "all": time.perf_counter() - t0}
        time.sleep(0.002)


def screen_floor(model, layer: int, head: int, k: int, window) -> tuple[float, int]:
    """``(seconds, sources)`` of the screens the first visit of ``(layer, head)`` cannot avoid (module
    docstring, "screen floor"); call it after that visit (it reads the head's cached exact table)."""
    table = kept_head_table(model, layer, head, k, offset=window)
    if table is None:
        raise RuntimeError(f"screen_floor: L{layer}.H{head}'s exact table is not cached: click the head first")
    tau = float(table.score[-1]) if table.score.numel() == k else 0.0  # fewer triples: every source counts
    with torch.no_grad():
        q, kk, v, u = centred_factors(model, layer, head)
        R = None if window is None else rotations(model.cfg, list(window), q.dtype, q.device, layer=layer)
        q_max = q.norm(dim=1).max() * (1 if R is None else spectral_norm(R, "the rotary maps").max())
        bound = kk.norm(dim=1) * q_max * v.norm(dim=1) * u.norm(dim=0).max()  # the search's norm bound
        qw, kw = (q, kk) if R is None else window_bound(q, kk, R)
        qk_screen, ov_screen = ProductScreen(kw, qw.T), ProductScreen(v, u)
        sources = int((bound > tau).sum())
        rows = torch.argsort(bound, descending=True)[:qk_screen.block_rows]
        block = (best_seconds(lambda: qk_screen.tile_max_upper(rows), 3)
                 + best_seconds(lambda: ov_screen.row_max_upper(rows), 3))
    return sources / rows.numel() * block, sources


def profiled(fn):
    """Run ``fn()`` with cProfile on this thread and on every thread started meanwhile."""
    profilers = []

    def trace(*_):
        p = cProfile.Profile()
        profilers.append(p)
        p.enable()

    main = cProfile.Profile()
    profilers.append(main)
    threading.setprofile(trace)
    main.enable()
    try:
        return fn()
    finally:
        main.disable()
        threading.setprofile(None)
        for p in profilers[1:]:
            p.disable()
        stats = pstats.Stats(main)
        for p in profilers[1:]:
            try:
                stats.add(p)
            except TypeError:  # a thread that never ran under its profiler
                pass
        stats.sort_stats("cumulative").print_stats(30)


def fill(explorer, n_heads: int | None) -> tuple[float, int]:
    """Run the background fill over the first ``n_heads`` heads (None: all); (seconds, heads). The
    head-loss table, queued before the fill, is cancelled: this times the fill alone."""
    total = explorer.model.cfg.n_layers * explorer.model.cfg.n_heads
    n_heads = total if n_heads is None else min(n_heads, total)
    t0 = time.perf_counter()
    explorer.start_background()
    explorer.causal.stop_background()
    if n_heads == total:
        explorer.wait_background(None)
    else:
        while explorer.progress.get("done", 0) < n_heads:  # polls (a benchmark): each head's progress
            explorer._runner._drain()
            time.sleep(0.01)
    seconds = time.perf_counter() - t0
    explorer.stop_background()
    explorer.wait_background(None)
    return seconds, n_heads


def measure(shape: str, tok, n_tokens: int, profile: bool, fill_heads: int | None) -> dict:
    hf, model, text, ids, forward = model_and_forward(SHAPES[shape](), tok, n_tokens)
    t0 = time.perf_counter()
    explorer = pcw.CircuitExplorer(model, text)
    explorer.stop_background()  # timed on its own below
    until_shown(explorer)
    shown = time.perf_counter() - t0
    explorer.wait(None)
    complete = time.perf_counter() - t0
    start = (explorer.layer, explorer.head)
    cfg = model.cfg
    target = (cfg.n_layers // 2, cfg.n_heads // 2 + 1)  # not the initial head, a layer with writers before it
    # the target's per-head and per-pair entries (those of heads shown before stay, for the revisit)
    cache.discard(model, lambda key: target in key or key[1:3] == target)
    with torch.no_grad():  # again next to the clicks: the least disturbed of both runs is the yardstick
        forward = min(forward, best_seconds(lambda: hf(ids, output_attentions=True), 3, warmup=False))
    first = profiled(lambda: click(explorer, *target)) if profile else click(explorer, *target)
    table = explorer.views()["trigrams"]
    floor, floor_sources = screen_floor(model, *target, table.k, table._window)
    revisit = profiled(lambda: click(explorer, *start)) if profile else click(explorer, *start)
    filled, n_filled = fill(explorer, fill_heads)
    # a filled head never shown: in the last filled layer (a layer with writers before it when it can)
    order = [start] + [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads) if (l, h) != start]
    after = next(head for head in reversed(order[:n_filled]) if head not in (start, target))
    hits = cache.stats(model)
    after_fill = click(explorer, *after)
    misses = cache.stats(model)["misses"] - hits["misses"]
    return {"shape": shape, "heads": f"{cfg.n_layers}x{cfg.n_heads}", "d_model": cfg.d_model, "vocab": cfg.d_vocab,
                "n": ids.shape[1], "forward": forward, "floor": floor, "floor_sources": floor_sources, "shown": shown, "complete": complete, "first": first, "revisit": revisit,
                "filled": filled, "n_filled": n_filled, "after_fill": after_fill, "after": after, "misses": misses,
                "cached": cache.stored_bytes(model)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["gpt2-small"])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--fill-heads", type=int, default=None, help="heads the background fill runs over "
                        "(default: all)")
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="run beside N single-core busy processes")
    parser.add_argument("--smoke", action="store_true", help=f"{bench_build.SMOKE_SHAPE!r} shape, "
                        f"{bench_build.SMOKE_TOKENS} tokens: checks that the script runs end to end")
    args = parser.parse_args()
    if args.busy < 0:
        parser.error(f"--busy must be >= 0, got {args.busy}")
    if args.smoke:
        args.shapes, args.tokens = [bench_build.SMOKE_SHAPE], bench_build.SMOKE_TOKENS
    if args.fill_heads is not None and args.fill_heads < 2:  # the click after the fill needs a filled head never shown
        parser.error(f"--fill-heads must be at least 2 (the shown head, then one to click), got {args.fill_heads}")
    torch.set_num_threads(args.threads)
    from pycircuits_widgets.widgets.core import runner  # the widget layer

    runner._kernel_loop = KernelLoop  # every Runner: background worker, as in a notebook
    tok = tokenizer()
    print(f"CircuitExplorer head change vs one eager HF forward with attentions, {args.tokens} tokens, random weights; "
          f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, "
          f"cache budget {cache.budget() >> 20} MiB, {args.busy} busy processes (fair sharing alone: "
          f"{expected_slowdown(args.threads, args.busy):.2f}x slower)")
    print(screen_route())
    print("| shape | heads | d_model | vocab | tokens | forward (s) | first visit, all views (s / fwd) "
          "| first visit, all but the exact table (s / fwd) | screen floor (s / fwd; sources it must screen) | revisit (s / fwd) | build shown / complete (s) "
          "| background fill (s, heads) | after the fill: click, all views (s / fwd) "
          "| cached (MiB) | load avg (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    with busy(args.busy):  # (0: none)
        for shape in args.shapes:
            r = measure(shape, tok, args.tokens, args.profile, args.fill_heads)
            f = r["forward"]
            print(f"| {r['shape']} | {r['heads']} | {r['d_model']} | {r['vocab']} | {r['n']} | {f:.3f} "
                  f"| {r['first']['all']:.2f} ({r['first']['all'] / f:.1f}) "
                  f"| {r['first']['others']:.2f} ({r['first']['others'] / f:.1f}) "
                  f"| {r['floor']:.2f} ({r['floor'] / f:.1f}; {r['floor_sources']} of {r['vocab']} sources) "
                  f"| {r['revisit']['all']:.3f} ({r['revisit']['all'] / f:.2f}) "
                  f"| {r['shown']:.1f} / {r['complete']:.1f} "
                  f"| {r['filled']:.0f} ({r['n_filled']} heads, {r['filled'] / r['n_filled']:.1f} s each) "
                  f"| {r['after_fill']['all']:.3f} ({r['after_fill']['all'] / f:.2f}; L{r['after'][0]}.H{r['after'][1]}, "
                  f"{r['misses']} cache misses) "
                  f"| {r['cached'] / 2**20:.0f} "
                  f"| {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
