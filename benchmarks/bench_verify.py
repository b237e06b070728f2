"""Cost of verification at load (``from_hf``'s probe) at GPT-2-small shapes, random weights built
locally (no download): 12 layers, d_model 768, 12 heads, vocabulary 50257, 124M parameters.

    .venv/bin/python benchmarks/bench_verify.py [--rounds 3] [--smoke]

Times (median of the rounds): the translation alone (``verify=False``: config and shape checks,
weight reading, folding), the probe alone (16 tokens through Hugging Face's forward and through
the weight view, compared), and ``from_hf`` with the probe (the default). ``--smoke``: one round at
``SMOKE`` (2 layers of 2 heads, d_model 64, 1024 tokens): checks that the script runs end to end.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

import pycircuits_widgets as pcw
from pycircuits_widgets.models.adapters.verify import PROBE_TOKENS, probe_hf

SMOKE = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 1024, "bos_token_id": None, "eos_token_id": None}


def main(rounds: int, smoke: bool = False) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(**SMOKE) if smoke else transformers.GPT2Config()
    hf = transformers.GPT2LMHeadModel(config).eval()  # eager attention by default
    hf.config._attn_implementation = "eager"
    times = {"translate (verify=False)": [], "probe alone": [], "from_hf (verify=True)": []}
    for _ in range(rounds):
        start = time.perf_counter()
        model = pcw.from_hf(hf, verify=False)
        times["translate (verify=False)"].append(time.perf_counter() - start)
        start = time.perf_counter()
        report = probe_hf(hf, model, "gpt2")
        times["probe alone"].append(time.perf_counter() - start)
        start = time.perf_counter()
        pcw.from_hf(hf)
        times["from_hf (verify=True)"].append(time.perf_counter() - start)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}; {f'smoke shapes {SMOKE}' if smoke else 'GPT-2-small shapes (124M)'}, random, {PROBE_TOKENS}-token probe, "
          f"float32, median of {rounds}")
    print("| step | seconds |\n|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} |")
    share = statistics.median(times["probe alone"]) / statistics.median(times["translate (verify=False)"])
    print(f"probe / translation: {share:.2f}; probe's errors: max logit {report['max_logit_error']:.2e} "
          f"({report['relative_logit_error']:.1e} x max|logit|), max pattern {report['max_pattern_error']:.1e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one round at 2 layers x 2 heads: checks that the script "
                        "runs end to end (its numbers mean nothing)")
    args = parser.parse_args()
    main(1 if args.smoke else args.rounds, args.smoke)
