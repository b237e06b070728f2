"""bfloat16 forward accuracy, ours vs Hugging Face's own, on tiny random Llama models (8 seeds).

    .venv/bin/python benchmarks/bench_bf16_accuracy.py [--seeds 8] [--smoke]

Both run the same bfloat16 weights; the errors are max |logit - reference| over 2 x 24 tokens,
against the float32 forward of the unrounded weights and of the bfloat16-rounded weights. ``--smoke``:
one seed (checks that the script runs end to end).
"""

import argparse
import copy
import pathlib
import sys

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import pycircuits_widgets as pcw
from family_configs import probe_tokens, reference, tiny_model


def main(seeds: int = 8) -> None:
    rows = []
    for seed in range(seeds):
        tokens = probe_tokens(seed)
        truth, _ = reference(tiny_model("llama", seed=seed), tokens)
        source = tiny_model("llama", seed=seed).to(torch.bfloat16)
        rounded, _ = reference(copy.deepcopy(source).float(), tokens)
        ours, theirs = pcw.from_hf(source)(tokens).float(), reference(source, tokens)[0].float()
        rows.append([float((x - t).abs().max()) for t in (truth, rounded) for x in (ours, theirs)])
    r = np.array(rows)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, llama tiny (2 layers, d_model 64), "
          f"{seeds} seeds, max |logit error| (mean over seeds, per-seed range)")
    print("| reference | ours bf16 | Hugging Face bf16 |\n|---|---|---|")
    for i, name in enumerate(("float32, unrounded weights", "float32, bf16-rounded weights")):
        a, b = r[:, 2 * i], r[:, 2 * i + 1]
        print(f"| {name} | {a.mean():.3f} ({a.min():.3f}-{a.max():.3f}) | {b.mean():.3f} ({b.min():.3f}-{b.max():.3f}) |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8, help="random models (default 8)")
    parser.add_argument("--smoke", action="store_true", help="one seed: checks that the script runs end to end")
    args = parser.parse_args()
    main(1 if args.smoke else args.seeds)
