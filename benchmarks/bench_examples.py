"""Dataset examples: how long the kernel takes to show a head's examples from a sweep, at the GPT-2-small
shape (144 heads, k = 20) or, with ``--smoke`` (the smallest size: 8 windows, one round), on the shipped
attn-only-2l (16 heads).

    .venv/bin/python benchmarks/bench_examples.py [--windows 24] [--rounds 3] [--smoke]

Setup (not timed): ``bench_sweep``'s models (the GPT-2-small shape: TransformerLens's native GPT-2
shape with random weights read through ``pcw.from_transformer_lens``, the shipped tokenizer's ids), a
serial sweep of ``--windows`` windows of 128 tokens of the Python stdlib corpus with k = 20, and a
``pcw.DatasetExamples`` on it. Then, in this process:

* first head: ``rows_patch`` of the first head, the sweep's tables and windows read from the store
  (what the first show of an explorer's examples section pays once);
* a head's rows: ``rows_patch(layer, head)`` of every head in turn, ``--rounds`` times (the rows, the
  token strings and documents the page gets first for a head change: the target is <= 50 ms);
* with the attention: ``with_values`` of those rows (the k windows read again by the model, one
  batched ``run_with_cache``), for the first 12 heads, and one forward of 20 windows for scale.

Medians and maxima are printed with the load average (``os.getloadavg``) at start and end.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

SEQ, K = 128, 20


def main(small: bool, windows: int, rounds: int) -> None:
    import torch

    import pycircuits_widgets as pcw
    from bench_sweep import our_model
    from pycircuits_widgets.corpus import Corpus

    load = os.getloadavg()
    name = "attn-only-2l" if small else "GPT-2-small shape"
    model = our_model(name)
    with tempfile.TemporaryDirectory(prefix="pcw-bench-examples-") as tmp:
        start = time.perf_counter()
        swept = pcw.sweep(model, Corpus.python_stdlib(), pathlib.Path(tmp) / "store", seq_len=SEQ, k=K,
                          max_windows=windows, progress=False)
        print(f"{name}: {model.cfg.n_layers} x {model.cfg.n_heads} heads; sweep of {windows} windows x {SEQ} "
              f"tokens, k={K}: {time.perf_counter() - start:.1f} s (setup)")
        view = pcw.DatasetExamples(pcw.Sweep.open(swept.path), model)  # a fresh reader: nothing read yet
        heads = [(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]

        start = time.perf_counter()
        view.rows_patch(*heads[0])
        first = time.perf_counter() - start
        times, patches = [], {}
        for _ in range(rounds):
            for l, h in heads:
                start = time.perf_counter()
                patches[l, h] = view.rows_patch(l, h)
                times.append(time.perf_counter() - start)
        values = []
        for l, h in heads[:12]:
            start = time.perf_counter()
            view.with_values(patches[l, h]["rows"], l, h, -1)
            values.append(time.perf_counter() - start)
        tokens = swept.windows[:K]
        start = time.perf_counter()
        with torch.inference_mode():
            model.run_with_cache(tokens, logits=False)
        forward = time.perf_counter() - start
        view.close()
    rows = len(patches[heads[0]]["rows"])
    print(f"first head (store read):        {first * 1e3:8.1f} ms")
    print(f"a head's rows ({rows} rows, {len(times)} shows): median {statistics.median(times) * 1e3:6.1f} ms, "
          f"max {max(times) * 1e3:6.1f} ms   (target <= 50 ms)")
    print(f"with the attention (re-run):    median {statistics.median(values) * 1e3:8.1f} ms, "
          f"max {max(values) * 1e3:6.1f} ms   (one forward of {K} windows: {forward * 1e3:.1f} ms)")
    print(f"load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=24, help="windows swept (128 tokens each)")
    parser.add_argument("--rounds", type=int, default=3, help="passes over every head")
    parser.add_argument("--smoke", action="store_true",
                        help="smallest size: the shipped attn-only-2l (16 heads), 8 windows, one round")
    args = parser.parse_args()
    if args.smoke:
        main(True, 8, 1)
    else:
        main(False, args.windows, args.rounds)
