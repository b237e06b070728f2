"""Skip-trigrams counted over a sweep (``pcw.trigram_counts``): seconds for 20 triples over 2,000 windows of
128 tokens of the Python stdlib corpus, on the shipped 2-layer model, against the bare forward of the same
windows.

    .venv/bin/python benchmarks/bench_trigram_counts.py [--windows 2000] [--rounds 3] [--store DIR] [--smoke]

``--smoke``: 64 windows, one round: checks that the script runs end to end (its numbers mean nothing).

The sweep (scores only: the windows are what is read) is made once in ``--store`` (default: a temporary
folder), before the clock. Rows, medians over rounds (the analysis cache cleared before each):

* counts only: 20 triples that never occur (a source the corpus never holds): the counting pass over
  every window, no forward;
* counts + attention: 20 triples that do occur (10 frequent ones taken from the windows: the most common
  ``(destination, out)`` pairs with the window's first token as source; and the head's top 10
  skip-trigrams): both passes, the forward of each window holding one;
* forward: ``run_with_cache(logits=False)`` over as many windows as the attention pass runs, in the
  sweep's batches (what that pass costs at least).
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

import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import cache
from pycircuits_widgets.analysis.skip_trigrams import head_table

SEQ, LAYER, HEAD = 128, 1, 4


def frequent_triples(windows: torch.Tensor, n: int) -> list:
    """``n`` triples that occur: the commonest adjacent (destination, out) pairs, each with a source that
    starts a window holding the pair before it."""
    pairs = torch.stack([windows[:, 1:-1].flatten(), windows[:, 2:].flatten()], 1)
    unique, counts = pairs.unique(dim=0, return_counts=True)
    triples = []
    for dest, out in unique[counts.argsort(descending=True)].tolist():
        hit = ((windows[:, 1:-1] == dest) & (windows[:, 2:] == out)).any(1).nonzero().flatten()
        triples.append((int(windows[hit[0], 0]), dest, out))
        if len(triples) == n:
            return triples
    return triples


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store", type=pathlib.Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="64 windows, one round: checks that the script runs "
                        "end to end (its numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.windows, args.rounds = 64, 1
    os.environ["PCW_PROGRESS"] = "0"
    model = pcw.load_pretrained("attn-only-2l")
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or pathlib.Path(tmp) / "sweep"
        swept = pcw.sweep(model, pcw.Corpus.python_stdlib(), store, seq_len=SEQ, max_windows=args.windows,
                          scores_only=True, progress=False)
        windows = swept.windows
        table = head_table(model, LAYER, HEAD, 10, approximate=True)
        occurring = frequent_triples(windows, 10) + list(zip(table.source.tolist(), table.destination.tolist(),
                                                              table.out.tolist()))
        unseen = min(set(range(model.cfg.d_vocab)) - set(windows.flatten().tolist()))
        never = [(unseen, d, o) for _, d, o in occurring]

        def counted(triples):
            cache.clear(model)
            return pcw.trigram_counts(swept, model, LAYER, HEAD, triples)

        result = counted(occurring)
        batch = swept.settings["batch_size"]

        @torch.inference_mode()
        def forward():
            for start in range(0, result.windows_run, batch):
                model.run_with_cache(windows[start:min(start + batch, result.windows_run)], logits=False)

        rows = {"counts only": [], "counts + attention": [], "forward": []}
        for _ in range(args.rounds):
            rows["counts only"].append(timed(lambda: counted(never)))
            rows["counts + attention"].append(timed(lambda: counted(occurring)))
            rows["forward"].append(timed(forward))
    print(f"{args.windows} windows x {SEQ} tokens, {len(occurring)} triples of L{LAYER}.H{HEAD}; occurrences "
          f"{int(result.count.sum())} (per triple {result.count.tolist()}); windows run {result.windows_run}; "
          f"torch threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}")
    for name, times in rows.items():
        print(f"  {name:20s} {statistics.median(times) * 1000:8.1f} ms (median of {args.rounds})")
    print(f"  ratio (counts + attention) / forward: {statistics.median(rows['counts + attention']) / statistics.median(rows['forward']):.2f}")


if __name__ == "__main__":
    main()
