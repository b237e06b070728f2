"""Every section of the CircuitExplorer on a real model shape, as seconds and multiples of one forward
pass of the same Hugging Face model measured in the same run: the build, a head click (first visit,
revisit, each section's own time), each on-demand section asked for as the page asks for it, the
measured composition, both ablations and ``save_html``.

Run:  .venv/bin/python benchmarks/bench_sections.py [--shapes llama-135m gpt2-small] [--tokens 100]
      [--threads 2] [--timeout 45] [--windows 4] [--busy N] [--smoke]

``--smoke``: ``bench_build``'s ``tiny`` shape (2 x 4 heads) on 20 tokens: checks that the script runs.

Models: ``bench_click``'s shapes with random weights (nothing downloaded); the default
``llama-135m`` is SmolLM2-135M's shape (30 x 9 heads, 3 key-value heads, d_model 576, vocabulary
49,152, rotary). The text is ``bench_build``'s (``--tokens`` tokens). The explorer is built with a
tiny corpus sweep (``--windows`` windows of 64 tokens of the Python stdlib corpus, k = 8; setup, not
timed) so that the dataset-examples section and mean ablation exist; ``--windows 0``: no sweep
(those two rows then say so). The views' runners work as under a Jupyter kernel (``KernelLoop``)
and the background fill is stopped: every number is what a user waits for with nothing else running.

Rows (each a time from the request until the section shows something, "first shown", and until
it is final, "complete"):

* build: ``CircuitExplorer(model, text, sweep=...)`` until every view shows the initial head
  (shown), then every background job of the views done (complete: the kernel-less answers of every
  head for a saved page; past ``--timeout`` they are cancelled);
* first visit: a click on a head never shown (its per-head cache entries dropped, as ``bench_click``),
  every click view final ("all views") and every one but the exact skip-trigram table ("all but the
  table"); each click view's own time to final is a row of its own (``click: <view>``);
* revisit: back to the initial head, every view final (the note names the slowest view);
* each on-demand section (``registry.ON_DEMAND``: paths, induction, positional, neurons, virtual
  heads, bigrams; those the model has) asked for as its "compute" button does (``active = True``;
  bigrams: with the text's last token selected, whose row it shows):
  first shown when the view has data to draw for the selection (``_ready()``: an induction section
  showing its strongest pairs while the rest fill in counts), complete when it is no longer busy.
  Work it then does for a saved page (its kernel-less answers) is cancelled before the next row;
* measured composition: the composition section switched to ``source = "measured"`` (K), until the
  matrix is in; ablation zero / mean: ``explorer.causal.ablation`` set, until the ablated run is shown;
* save_html: ``explorer.save_html(path)`` with its default budget (``SAVE_BUDGET``), and the size.

A section not complete within ``--timeout`` seconds is recorded as "> T s" (with how far its count
got) and cancelled, so the run stays bounded; that is a finding, not a failure of the script.
``--busy N`` runs everything beside N single-core busy processes (``busy.py``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import torch

import bench_build
import pycircuits_widgets as pcw
from bench_build import KernelLoop, model_and_forward, tokenizer, until_shown
from bench_click import SHAPES, click
from busy import busy, expected_slowdown
from peaks import best_seconds, screen_route
from pycircuits_widgets.analysis import cache
from pycircuits_widgets.corpus import Corpus
from pycircuits_widgets.widgets.core.bundle import BundleMissing
from pycircuits_widgets.widgets.views.registry import ON_DEMAND

POLL = 0.005
"""Seconds between two looks at the views (a benchmark polls; the kernel's loop would apply results)."""
SWEEP_SEQ, SWEEP_K = 64, 8


class Row:
    """One row's numbers: ``first`` (first shown) and ``complete`` seconds, or ``over`` (the timeout hit), and a note."""

    def __init__(self, first=None, complete=None, over=None, note=""):
        self.first, self.complete, self.over, self.note = first, complete, over, note

    def cells(self, forward: float) -> tuple[str, str]:
        def cell(seconds):
            return "" if seconds is None else f"{seconds:.2f} ({seconds / forward:.1f})"

        done = f"> {self.over:.0f} s (> {self.over / forward:.0f})" if self.over is not None else cell(self.complete)
        return cell(self.first), done


class Rows:
    """The table being printed: a row is printed as soon as it is measured (a long run shows its progress)."""

    def __init__(self, forward: float):
        self.forward = forward

    def add(self, name: str, row: Row) -> None:
        shown, done = row.cells(self.forward)
        print(f"| {name} | {shown} | {done} | {row.note} |", flush=True)


def runners(explorer):
    return [explorer._runner] + [v._runner for v in explorer.views().values()]


def timed(explorer, start, shown, done, timeout: float, stop=None, count=None) -> Row:
    """Call ``start()``, then apply every runner's results until ``done()``; ``shown()`` marks the first
    result. Past ``timeout`` s: ``stop()`` and a row saying how far ``count()`` got."""
    every = runners(explorer)
    t0 = time.perf_counter()
    start()
    first = None
    while True:
        for runner in every:
            runner._drain()
        t = time.perf_counter() - t0
        if first is None and shown():
            first = t
        if done():
            return Row(first, t)
        if t > timeout:
            note = count() if count else ""
            if stop is not None:
                stop()
            return Row(first, over=timeout, note=note)
        time.sleep(POLL)


def settle(explorer, view=None, timeout: float | None = None) -> str:
    """Cancel what ``view`` still does for a saved page (its kernel-less answers: background work)
    and wait until no runner computes, so the next row starts on an idle process; a piece that
    cannot stop midway (one long piece) may hold that up: after ``timeout`` s more, go on and say so."""
    if view is not None:
        view._runner.cancel_all()
    deadline = None if timeout is None else time.monotonic() + timeout
    for runner in runners(explorer):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not runner.wait(left):
            return f"its running piece did not stop within {timeout:.0f} s of the cancel: the rows below share the CPU with it"
    return ""


def count_of(view):
    def count():
        p = view.progress or {}
        return f"at {p['done']}/{p['total']} {p.get('unit', '')}".rstrip() if "total" in p else ""
    return count


def on_demand(explorer, name: str, timeout: float) -> Row:
    view = explorer.views()[name]

    def start():
        if name == "bigrams" and view.token < 0:  # its rows are the selected token's: a token is clicked first
            view.token = explorer.token_ids[-1]
        explorer.compute(name)

    def count():  # how far it got, and which click work it was giving way to
        others = [n for n, v in explorer.views().items() if v is not view and v.busy]
        return "; ".join(filter(None, [count_of(view)(), others and "busy meanwhile: " + ", ".join(others)]))

    row = timed(explorer, start, view._ready, lambda: view._ready() and not view.busy,
                timeout, stop=view.cancel, count=count)
    late = settle(explorer, view, timeout)
    row.note = "; ".join(n for n in (row.note, late) if n)
    return row


def measured(explorer, timeout: float) -> Row:
    view = explorer.composition

    def start():
        view.kind = "K"
        view.source = "measured"

    row = timed(explorer, start, lambda: "K" in view.measured, lambda: "K" in view.measured, timeout,
                stop=lambda: view._runner.cancel("measured"), count=count_of(view))
    view.source = "weights"
    settle(explorer, timeout=timeout)
    return row


def ablation(explorer, kind: str, timeout: float) -> Row:
    why = explorer.causal.ablation_kinds.get(kind, "")
    if why:
        return Row(note=f"n/a: {why}")
    label = f"ablated: L{explorer.layer}.H{explorer.head} ({kind})"

    def start():
        explorer.causal.ablation = kind

    row = timed(explorer, start, lambda: explorer.causal.ablated == label, lambda: explorer.causal.ablated == label, timeout,
                stop=lambda: explorer.causal._runner.cancel("ablate"))
    explorer.causal.ablation = "off"
    settle(explorer, timeout=timeout)
    return row


def save(explorer, folder: pathlib.Path) -> Row:
    path = folder / "explorer.html"
    t0 = time.perf_counter()
    try:
        explorer.save_html(path)
    except BundleMissing as exc:
        return Row(note=f"n/a: {exc}")
    seconds = time.perf_counter() - t0
    return Row(complete=seconds, note=f"{path.stat().st_size / 2**20:.1f} MiB")


def timed_click(explorer, head):
    """``bench_click.click`` on ``head``, and each click view's own seconds to final."""
    views = {name: view for name, view in explorer.views().items() if name not in ON_DEMAND}
    final = {}
    t0 = time.perf_counter()

    def each_view():  # noted while the click's results are applied
        for name, view in views.items():
            if name not in final and not view.busy:
                final[name] = time.perf_counter() - t0

    return click(explorer, *head, tick=each_view), final


def tiny_sweep(model, folder: pathlib.Path, windows: int):
    """The sweep of ``windows`` windows in ``folder`` (one per model: a store refuses another's), or None."""
    if windows == 0:
        return None
    return pcw.sweep(model, Corpus.python_stdlib(), folder, seq_len=SWEEP_SEQ, k=SWEEP_K,
                     max_windows=windows, progress=False)


def measure(shape: str, tok, n_tokens: int, timeout: float, windows: int, folder: pathlib.Path) -> None:
    """Print ``shape``'s table, a row as soon as it is measured."""
    hf, model, text, ids, forward = model_and_forward(SHAPES[shape](), tok, n_tokens)
    sweep = tiny_sweep(model, folder / f"sweep-{shape}", windows)
    t0 = time.perf_counter()
    explorer = pcw.CircuitExplorer(model, text, sweep=sweep)
    explorer.stop_background()  # a user's clicks and requests with nothing else running
    until_shown(explorer)
    shown = time.perf_counter() - t0
    background = timed(explorer, lambda: None, lambda: True, lambda: all(r._drain() for r in runners(explorer)), timeout)
    built, complete = background.over is None, shown + (background.complete or 0.0)
    if not built:  # the kernel-less answers of every head: background work, stopped so the rows below run alone
        for view in explorer.views().values():
            view._runner.cancel_all()
        settle(explorer, timeout=timeout)
    with torch.no_grad():  # again before the rows: the least disturbed of both runs is the yardstick
        forward = min(forward, best_seconds(lambda: hf(ids, output_attentions=True), 3, warmup=False))
    cfg = model.cfg
    print(f"\n{shape} ({cfg.n_layers}x{cfg.n_heads} heads, vocabulary {cfg.d_vocab}, {ids.shape[1]} tokens): "
          f"forward {forward:.3f} s (eager HF, attentions, best of 3 twice)")
    print("| section | first shown (s / fwd) | complete (s / fwd) | note |")
    print("|---|---|---|---|", flush=True)
    rows = Rows(forward)
    rows.add("build", Row(shown, complete) if built else
             Row(shown, over=timeout, note="kernel-less answers of every head still computing: cancelled"))
    start = (explorer.layer, explorer.head)
    target = (cfg.n_layers // 2, cfg.n_heads // 2 + 1)  # bench_click's: not the initial head
    cache.discard(model, lambda key: target in key or key[1:3] == target)
    views = explorer.views()
    first, final = timed_click(explorer, target)
    rows.add("first visit: all views", Row(complete=first["all"]))
    rows.add("first visit: all but the exact table", Row(complete=first["others"]))
    for name in views:
        if name not in ON_DEMAND:
            rows.add(f"click: {name}", Row(complete=final.get(name)))
    settle(explorer, timeout=timeout)
    again, final = timed_click(explorer, start)
    slowest = max(final, key=final.get)
    rows.add("revisit: all views", Row(complete=again["all"], note=f"slowest: {slowest} {final[slowest]:.3f} s"))
    settle(explorer, timeout=timeout)
    for name in ON_DEMAND:
        if name in views:
            rows.add(f"on demand: {name}", on_demand(explorer, name, timeout))
        else:
            rows.add(f"on demand: {name}", Row(note="n/a: " + explorer.notices.get(name, "no such section")))
    if explorer.composition is not None:
        rows.add("measured composition (K)", measured(explorer, timeout))
    for kind in ("zero", "mean"):
        rows.add(f"ablation: {kind}", ablation(explorer, kind, timeout))
    rows.add("save_html (default budget)", save(explorer, folder))
    explorer.close()
    print(f"load avg (1 min) at the end: {os.getloadavg()[0]:.1f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama-135m"])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--timeout", type=float, default=45.0, help="seconds a section may take before it is "
                        "recorded as '> T s' and cancelled (default 45)")
    parser.add_argument("--windows", type=int, default=4, help="corpus windows of the tiny sweep (default 4; "
                        "0: no sweep)")
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="run beside N single-core busy processes")
    parser.add_argument("--smoke", action="store_true", help=f"{bench_build.SMOKE_SHAPE!r} shape, "
                        f"{bench_build.SMOKE_TOKENS} tokens, 2 windows: checks that the script runs end to end")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.tokens, args.windows = [bench_build.SMOKE_SHAPE], bench_build.SMOKE_TOKENS, 2
    if args.windows < 0 or args.busy < 0 or args.timeout <= 0:
        parser.error("--windows and --busy must be >= 0, --timeout > 0")
    torch.set_num_threads(args.threads)
    from pycircuits_widgets.widgets.core import runner  # the widget layer

    runner._kernel_loop = KernelLoop  # every Runner: background worker, as in a notebook
    tok = tokenizer()
    with busy(args.busy), tempfile.TemporaryDirectory(prefix="pcw-bench-sections-") as tmp:
        print(f"Every CircuitExplorer section vs one eager HF forward with attentions, {args.tokens} tokens, random "
              f"weights, sweep of {args.windows} x {SWEEP_SEQ} tokens; torch {torch.__version__}, "
              f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, {args.busy} busy processes "
              f"(fair sharing alone: {expected_slowdown(args.threads, args.busy):.2f}x slower), "
              f"load avg at start {os.getloadavg()[0]:.1f}\n{screen_route()}", flush=True)
        for shape in args.shapes:
            measure(shape, tok, args.tokens, args.timeout, args.windows, pathlib.Path(tmp))

if __name__ == "__main__":
    sys.exit(main())
