"""CircuitExplorer build time and ``pcw.run`` time on real model shapes, each as a ratio to
one forward pass of the same Hugging Face model with attentions, measured in the same run.

Run:  .venv/bin/python benchmarks/bench_build.py [--shapes gpt2-small gpt2-medium llama-135m]
      [--tokens 100] [--threads N] [--profile] [--smoke]

``--smoke``: the ``tiny`` shape (2 x 4 heads) on 20 tokens: checks that the script runs end to end.

Models are built locally from configs with random weights (random weights cost the same as
trained ones; nothing is downloaded): GPT-2 small (12 x 12 heads, d_model 768) and medium
(24 x 16, d_model 1024), d_vocab 50304 (GPT-2's 50257 padded to a multiple of 64); and the 135M LLaMA-family shape (30 x 9 heads, 3
key-value heads, d_model 576, MLP 1536, d_vocab 49152, rotary, tied embeddings). Each is read
through ``pcw.from_hf`` with the package's shipped byte-level tokenizer (ids past its
vocabulary display as ``<id N>``). The text is the quick start's, cut to ``--tokens`` tokens.

Columns:

* forward: ``hf_model(ids, output_attentions=True)`` with eager attention, best of 3 (the
  peer: what a user pays to get the patterns from transformers);
* ``pcw.run``: best of 3 (logits, loss, patterns and the activation cache);
* explorer ready: ``pcw.CircuitExplorer(model, text)`` returns (every view built and shown);
  the views' runners work as under a Jupyter kernel (``KernelLoop``): what they compute in
  the background (composition tables, skip-trigram tables, head details, the kernel-less
  answers) is still running, each view showing its busy or partial state;
* explorer shown: no view busy any more: every view shows its content for the initial
  selection (composition table, exact skip-trigram table, eigenvalue scatter and detail);
* explorer complete: additionally ``explorer.wait()``: every background job done, the
  kernel-less answers (``widgets/core/offline.py``: every head's tables for a saved page) included.

The widget layer's import (ipywidgets, anywidget; once per kernel, independent of the model)
is done before the clock starts and printed on its own line.

Targets (issue 12): explorer ready <= 10 x forward, ``pcw.run`` <= 1.2 x forward.
``--profile`` prints where the explorer build spends its time (cProfile, cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pathlib
import platform
import pstats
import resource
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch
import transformers

import pycircuits_widgets as pcw
from peaks import best_seconds
from pycircuits_widgets.demo import SAMPLE_TEXT

SHAPES = {
    # GPT-2's 50257 padded to a multiple of 64 (as nanoGPT trains it): the explorer refuses a tokenizer
    # (here the shipped 1024-token one) on a vocabulary it neither fills nor pads to such a multiple
    "gpt2-small": lambda: transformers.GPT2Config(vocab_size=50304),
    "gpt2-medium": lambda: transformers.GPT2Config(vocab_size=50304, n_embd=1024, n_layer=24, n_head=16),
    "llama-135m": lambda: transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5),
}
SMOKE_SHAPE = "tiny"
"""``--smoke``: 2 layers x 4 heads, d_model 64, the shipped tokenizer's 1024 tokens (checks the script runs)."""
SHAPES[SMOKE_SHAPE] = lambda: transformers.GPT2Config(
    vocab_size=1024, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=None, eos_token_id=None)
SMOKE_TOKENS = 20


class KernelLoop:
    """Stand-in for the Jupyter kernel's IO loop: a script has none, and without one every
    view's ``Runner`` computes synchronously inside the constructor. Under a kernel a worker
    thread computes and the loop applies the results; here ``explorer.wait()`` applies them
    (it drains the runners itself), so "ready" is what a notebook user waits for."""

    def add_callback(self, callback, *args):
        pass  # results are applied by wait(), on this (the "kernel") thread


def until_shown(explorer) -> None:
    """Apply the views' results until none is busy: everything the first paint of the initial
    selection shows is there (background work, the kernel-less answers, may still run). A
    benchmark, not a test: it polls."""
    views = explorer.views().values()
    runners = [view._runner for view in views if hasattr(view, "_runner")]
    while True:
        for runner in runners:
            runner._drain()  # what the kernel's loop does with posted results
        if not any(view.busy for view in views):
            return
        time.sleep(0.005)


def tokenizer():
    """The shipped byte-level BPE tokenizer as a transformers tokenizer."""
    path = pathlib.Path(pcw.__file__).parent / "checkpoints" / "tokenizer.json"
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


def text_of(tok, n_tokens: int) -> str:
    """The quick start's text (repeated as needed), cut to ``n_tokens`` tokens."""
    ids = tok((SAMPLE_TEXT + "\n") * (1 + n_tokens // 20))["input_ids"][:n_tokens]
    return tok.decode(ids)


def model_and_forward(config, tok, n_tokens: int):
    """``(hf, model, text, ids, forward)``: a random-weight Hugging Face model of ``config`` and its
    weight view (``pcw.from_hf``), the text of ``n_tokens`` tokens and its ids ``[1, n]``, and the
    best of 3 seconds of the model's eager forward with attentions."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model = pcw.from_hf(hf, tok)
    text = text_of(tok, n_tokens)
    ids = model.to_tokens(text).reshape(1, -1)
    with torch.no_grad():
        hf(ids, output_attentions=True)  # warm-up (allocator, kernels)
        forward = best_seconds(lambda: hf(ids, output_attentions=True), 3, warmup=False)
    return hf, model, text, ids, forward


def measure(shape: str, tok, n_tokens: int, profile: bool) -> dict:
    _, model, text, ids, forward = model_and_forward(SHAPES[shape](), tok, n_tokens)
    pcw.run(model, text)
    run = best_seconds(lambda: pcw.run(model, text), 3, warmup=False)
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    explorer = pcw.CircuitExplorer(model, text)
    ready = time.perf_counter() - t0
    until_shown(explorer)
    shown = time.perf_counter() - t0
    explorer.wait(None)
    complete = time.perf_counter() - t0
    if profiler:
        profiler.disable()
        print(f"\n-- {shape}: explorer build + wait, cumulative --")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    cfg = model.cfg
    return {"shape": shape, "heads": f"{cfg.n_layers}x{cfg.n_heads}", "n": ids.shape[1], "forward": forward, "run": run,
                "ready": ready, "shown": shown, "complete": complete}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=[s for s in SHAPES if s != SMOKE_SHAPE])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help=f"the {SMOKE_SHAPE!r} shape on {SMOKE_TOKENS} tokens: "
                        "checks that the script runs end to end (its numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.tokens = [SMOKE_SHAPE], SMOKE_TOKENS
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    from pycircuits_widgets.widgets.core import runner  # the widget layer (ipywidgets, anywidget)
    widgets_import = time.perf_counter() - t0
    runner._kernel_loop = KernelLoop  # every Runner: background worker, as in a notebook
    tok = tokenizer()
    print(f"CircuitExplorer build and pcw.run vs one eager HF forward with attentions, {args.tokens} tokens, "
          "random weights")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs")
    print(f"widget layer import (once per kernel, not in the times below): {widgets_import:.2f} s")
    print("| shape | heads | tokens | forward (s) | pcw.run (s) | run / fwd (target <= 1.2) "
          "| explorer ready (s) | ready / fwd (target <= 10) | shown (s) | shown / fwd | complete (s) | complete / fwd "
          "| load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for shape in args.shapes:  # a row as soon as it is measured
        r = measure(shape, tok, args.tokens, args.profile)
        f = r["forward"]
        print(f"| {r['shape']} | {r['heads']} | {r['n']} | {f:.3f} | {r['run']:.3f} | {r['run'] / f:.2f} "
              f"| {r['ready']:.2f} | {r['ready'] / f:.1f} | {r['shown']:.2f} | {r['shown'] / f:.1f} | {r['complete']:.2f} | {r['complete'] / f:.1f} "
              f"| {os.getloadavg()[0]:.1f} |", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")


if __name__ == "__main__":
    main()
