"""Kernel-side recompute latency of the circuit views for a head change, and payload sizes.

Run:  .venv/bin/python benchmarks/bench_widgets.py [--changes 20] [--exact-changes 3] [--smoke]

``--smoke``: 2 head changes (1 exact), the GPT-2-shaped layer at 2 heads and ``SMOKE_VOCAB`` tokens:
checks that the script runs end to end (its numbers mean nothing).

* "shipped": ``pcw.load_pretrained("attn-only-2l")`` (falls back to random weights of the same
  architecture, and says so, while the checkpoint is not there).
Latency excludes the transfer to the page (the runner has no debounce: a newer request stops an older one between chunks).

* "gpt2-shape": one attention layer with GPT-2-small head shapes and vocabulary (12 heads,
  d_model 768, d_head 64, d_vocab 50257), random weights. A skip-trigram table does not depend
  on other layers, so one layer measures the same per-head work.

Each row times the synchronous recompute a head change triggers (what the worker thread runs):
``first`` = until the first update the view can show, ``exact`` = until the final one. Head
changes cycle over all heads (p50/p95 over ``--changes`` changes; the exact GPT-2-shaped table
over ``--exact-changes``). Payload = the state the view receives (JSON + binary buffers).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ipywidgets.widgets.widget import _remove_buffers

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import cache
from pycircuits_widgets.models import AttnOnlyTransformer, ModelConfig, from_attn_only
from pycircuits_widgets.widgets.core.offline import last


class _Strings:
    """Stand-in tokenizer for random-weight models: display strings only."""

    def __init__(self, n):
        self.n = n

    def display_token(self, i):
        return f"tok{i}"


def shipped_model():
    return pcw.load_pretrained("attn-only-2l"), "attn-only-2l (shipped)"


SMOKE_VOCAB = 2048


def gpt2_shaped_model(n_heads=12, d_vocab=50257):
    cfg = ModelConfig(n_layers=1, n_heads=n_heads, d_model=768, d_head=64, d_vocab=d_vocab, n_ctx=1024,
                      name="gpt2-shape")
    name = "gpt2-small shape (1 layer), random" if (n_heads, d_vocab) == (12, 50257) else \
        f"gpt2-small head shape, {n_heads} heads, d_vocab {d_vocab}, random"
    return from_attn_only(AttnOnlyTransformer(cfg, seed=0), _Strings(cfg.d_vocab)), name


def heads(model, n):
    cfg = model.cfg
    return [((i // cfg.n_heads) % cfg.n_layers, i % cfg.n_heads) for i in range(1, n + 1)]


def time_steps(make_steps, changes):
    """ms to the first and the last update of each change."""
    first, last = [], []
    for args in changes:
        t0 = time.perf_counter()
        it = make_steps(*args)
        next(it)
        first.append(1e3 * (time.perf_counter() - t0))
        for _ in it:
            pass
        last.append(1e3 * (time.perf_counter() - t0))
    return first, last


def payload_bytes(widget, names):
    state, _, buffers = _remove_buffers(widget.get_state(names))
    return len(json.dumps(state)) + sum(len(bytes(b)) for b in buffers)


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def row(model_name, op, first, last, size):
    print(f"| {model_name} | {op} | {len(last)} | {pct(first, 50):.0f} | {pct(first, 95):.0f} | "
          f"{pct(last, 50):.0f} | {pct(last, 95):.0f} | {size / 1024:.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--changes", type=int, default=20)
    ap.add_argument("--exact-changes", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help=f"2 head changes (1 exact), 2 heads and d_vocab {SMOKE_VOCAB} "
                    "for the GPT-2 shape: checks that the script runs end to end (its numbers mean nothing)")
    args = ap.parse_args()
    if args.smoke:
        args.changes, args.exact_changes = 2, 1
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    print("| model | recompute on head change | n | first p50 ms | first p95 ms | exact p50 ms | exact p95 ms | payload KiB |")
    print("|---|---|---|---|---|---|---|---|")

    model, name = shipped_model()
    table = pcw.SkipTrigramTable(model, k=100)
    f, l = time_steps(cold_table(table), heads(model, args.changes))
    row(name, "SkipTrigramTable top-100, cold", f, l, payload_bytes(table, ["trigrams"]))
    for L, H in heads(model, args.changes):
        last(table._table_steps(L, H, 100))  # as after a first visit: the head's table is in the model's cache
    f, l = time_steps(lambda L, H: table._table_steps(L, H, 100), heads(model, args.changes))
    row(name, "SkipTrigramTable top-100, revisited head", f, l, payload_bytes(table, ["trigrams"]))
    table.token = 5
    f, l = time_steps(lambda L, H: table._related_steps(5, L, H, 10), heads(model, args.changes))
    row(name, "SkipTrigramTable token query", f, l, payload_bytes(table, ["related"]))
    plot = pcw.EigenvaluePlot(model)
    f, l = time_steps(plot._detail_steps, [(L, H, 12) for L, H in heads(model, args.changes)])
    row(name, "EigenvaluePlot head detail", f, l, payload_bytes(plot, ["detail"]))
    comp = pcw.CompositionMatrix(model)
    H = model.cfg.n_heads
    pairs = [([0, i % H, 1, (3 * i) % H], "QKV"[i % 3]) for i in range(args.changes)]
    f, l = time_steps(comp._detail_steps, pairs)
    comp.selected_pair = [0, 1, 1, 2]
    comp.wait()
    row(name, "CompositionMatrix pair detail", f, l, payload_bytes(comp, ["detail"]))
    t0 = time.perf_counter()
    pcw.CompositionMatrix(model)
    print(f"| {name} | CompositionMatrix construction (6 score tables) | 1 | | | {1e3 * (time.perf_counter() - t0):.0f} | | "
          f"{payload_bytes(comp, ['scores', 'baselines']) / 1024:.1f} |")

    big, name = gpt2_shaped_model(2, SMOKE_VOCAB) if args.smoke else gpt2_shaped_model()
    V = big.cfg.d_vocab
    table = _lazy_table(big)
    changes = heads(big, args.changes)
    first = []
    for L, Hh in changes:
        t0 = time.perf_counter()
        next(cold_table(table)(L, Hh))
        first.append(1e3 * (time.perf_counter() - t0))
    _, exact = time_steps(cold_table(table),
                          changes[: args.exact_changes])
    table.recompute()
    row(name, f"SkipTrigramTable top-100, cold (first: n={len(first)}, top-100 of the 64 strongest sources)", first, exact, payload_bytes(table, ["trigrams"]))
    table.token = 5
    table.wait(120)
    f, l = time_steps(lambda L, Hh: table._related_steps(5, L, Hh, 10), changes)
    row(name, "SkipTrigramTable token query, new head", f, l, payload_bytes(table, ["related"]))
    f, l = time_steps(lambda t: table._related_steps(t, *changes[-1], 10), [(t,) for t in range(0, V, V // 20)])
    row(name, "SkipTrigramTable token query, same head", f, l, payload_bytes(table, ["related"]))
    t0 = time.perf_counter()
    for text in ("tok123", "tok4", "zzz"):
        pcw.widgets.views.skip_trigram_table.find_tokens(table._strings, text)
    print(f"| {name} | token search over {V} strings (per query) | 3 | | | {1e3 * (time.perf_counter() - t0) / 3:.0f} | | |")
    plot = pcw.EigenvaluePlot(big, scores={})
    f, l = time_steps(plot._detail_steps, [(L, Hh, 12) for L, Hh in changes])
    row(name, "EigenvaluePlot head detail", f, l, payload_bytes(plot, ["detail"]))


def cold_table(table):
    """The table recompute for a head change with nothing of the model cached (``analysis.cache``:
    neither the head's centred factors nor its table)."""

    def steps(layer, head):
        cache.clear(table.model)
        return table._table_steps(layer, head, 100)

    return steps


def _lazy_table(model):
    """A table widget whose constructor does not compute a first table (k=1 is cheap)."""
    table = pcw.SkipTrigramTable(model, k=1)
    table.wait(600)  # a large vocabulary's first table is computed in the background
    table.unobserve_all("k")
    table.k = 100
    return table


if __name__ == "__main__":
    main()
