"""Cost of verification at load (``from_hf``'s probe) at GPT-2-small shapes, random weights built
locally (no download): 12 layers, d_model 768, 12 heads, vocabulary 50257, 124M parameters.

    .venv/bin/python benchmarks/bench_verify.py [--rounds 3]

Times (median of the rounds): the translation alone (``verify=False``: config and shape checks,
weight reading, folding), the probe alone (16 tokens through Hugging Face's forward and through
the weight view, compared), and ``from_hf`` with the probe (the default).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import pycircuits_widgets as pcw  # noqa: E402
from pycircuits_widgets.models.adapters.verify import PROBE_TOKENS, probe_hf  # noqa: E402


def main(rounds: int) -> None:
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()  # eager attention by default
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
          f"load average {os.getloadavg()[0]:.2f}; GPT-2-small shapes (124M, random), {PROBE_TOKENS}-token probe, "
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
    main(parser.parse_args().rounds)
