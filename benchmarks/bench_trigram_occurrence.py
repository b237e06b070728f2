"""How often a head's skip-trigrams occur in its corpus, read through each embedding (issue "Circuits at
depth"): for every head of each model, the fraction of its top ``--top`` skip-trigrams (``head_table``,
exact top-k by ``qk * ov``) that occur at least once in a sweep's windows (``pcw.trigram_counts``: exact
occurrence counts), read through ``W_E`` (the paper's reading), ``W_E`` + block 0 and the corpus stream
entering the head's layer (``pcw.effective_embedding``). A reading that describes what a head sees should
name triples the corpus holds.

    .venv/bin/python benchmarks/bench_trigram_occurrence.py [--windows 512] [--top 100]
        [--trained runs/3l] [--store DIR] [--smoke]

Models: the shipped ``attn-only-1l`` and ``attn-only-2l``, and with ``--trained`` a run of
``python -m pycircuits_widgets.train`` (its ``model.safetensors``; the README's three-layer recipe has an
induction head in its last layer). The corpus: the Python stdlib corpus, ``--windows`` windows of 128
tokens (a scores-only sweep in ``--store``, default a temporary folder). Layer-0 heads read ``W_E``
itself: every reading is the same table there, so their row says so once.

``--smoke``: 16 windows, top 10, the 1-layer model: checks that the script runs end to end.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.skip_trigrams import head_table

SEQ = 128
READINGS = ("raw", "mlp0", "corpus")


def trained(run: pathlib.Path):
    """A ``train.py`` run's model (its checkpoint, checked against the shipped tokenizer it was trained with)."""
    from pycircuits_widgets.models import from_attn_only, load_attn_only
    from pycircuits_widgets.train import TOKENIZER_PATH

    net, meta, tokenizer = load_attn_only(run / "model.safetensors", run / "model.json", TOKENIZER_PATH)
    model = from_attn_only(net, tokenizer)
    model.metadata = meta
    return model


def occurrence(model, sweep, layer: int, head: int, top: int, reading: str) -> float:
    """The fraction of head ``(layer, head)``'s top ``top`` skip-trigrams read through ``reading`` that
    occur in ``sweep``'s windows."""
    embedding = None if reading == "raw" else pcw.effective_embedding(
        model, layer, reading, sweep=sweep if reading == "corpus" else None)
    table = head_table(model, layer, head, top, approximate=True, embedding=embedding)
    triples = torch.stack([table.source, table.destination, table.out], 1)
    counts = pcw.trigram_counts(sweep, model, layer, head, triples, max_windows=1)  # (counts are over every window)
    return float((counts.count > 0).double().mean())


def measure(model, sweep, top: int) -> list[dict]:
    rows = []
    for layer in range(model.cfg.n_layers):
        readings = READINGS[:1] if layer == 0 else READINGS
        for head in range(model.cfg.n_heads):
            rates = {r: occurrence(model, sweep, layer, head, top, r) for r in readings}
            rows.append({"layer": layer, "head": head, **rates})
    return rows


def report(name: str, rows: list[dict], scores: dict, windows: int, top: int) -> None:
    print(f"\n### {name}: fraction of each head's top {top} skip-trigrams seen in {windows} windows of {SEQ} tokens\n")
    print("| head | induction score | W_E | W_E + block 0 | corpus stream |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k]:.2f}" if k in r else "(= W_E: layer 0 reads it)" for k in READINGS]
        print(f"| L{r['layer']}.H{r['head']} | {float(scores['induction'][r['layer'], r['head']]):.2f} | "
              + " | ".join(cells) + " |")
    for layer in sorted({r["layer"] for r in rows}):
        of = [r for r in rows if r["layer"] == layer]
        means = " | ".join(f"{sum(r[k] for r in of) / len(of):.2f}" if k in of[0] else "" for k in READINGS)
        print(f"| layer {layer} mean | | {means} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=512)
    parser.add_argument("--top", type=int, default=100)
    parser.add_argument("--trained", type=pathlib.Path, default=None, help="a train.py run folder")
    parser.add_argument("--store", type=pathlib.Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    names = ["attn-only-1l"] if args.smoke else ["attn-only-1l", "attn-only-2l"]
    windows, top = (16, 10) if args.smoke else (args.windows, args.top)
    models = [pcw.load_pretrained(n) for n in names]
    if args.trained is not None and not args.smoke:
        models.append(trained(args.trained))
    print(f"load average before: {os.getloadavg()}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.store or pathlib.Path(tmp)
        corpus = pcw.Corpus.python_stdlib()
        for model in models:
            folder = root / model.cfg.name.replace(" ", "_").replace("(", "").replace(")", "")
            sweep = pcw.sweep(model, corpus, folder, seq_len=SEQ, max_windows=windows, scores_only=True,
                              progress=False)
            report(model.cfg.name, measure(model, sweep, top), sweep.head_scores(), sweep.n_windows, top)
    print(f"\n{time.perf_counter() - start:.0f} s; load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
