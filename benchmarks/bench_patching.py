"""Exact head-output patching against TransformerLens's, at GPT-2-small's shape.

    .venv/bin/python benchmarks/bench_patching.py [--prompts 4] [--tokens 20] [--repeats 2] [--steps 5]
        [--edges-only] [--smoke]

One random GPT-2-small (``transformers.GPT2Config()``: 12 layers of 12 heads, d_model 768, vocabulary
50,257) as a TransformerBridge, and ours from it (``pcw.from_transformer_lens``); a task of ``--prompts``
random clean and corrupted prompts of ``--tokens`` tokens with a logit-difference metric. Timed, best of
``--repeats`` after a warm-up, in one process, alternating: ``pcw.activation_patch(model, task,
"head_out")`` (a layer's heads in one batched forward resumed at that layer) and TransformerLens's
``patching.get_act_patch_attn_head_out_all_pos`` (a whole hooked forward per head), both over all 144
heads; and one plain forward of the corrupted prompts, the unit of the "forwards" column. Then
attribution patching (``pcw.attribution_patch``) of every head and of every neuron (one forward with
its gradient taps and one backward each), and of every head's key input (AtP*'s correction: a resumed
forward and a backward per layer), in forwards, and of every head with AtP*'s GradDrop (a forward and a
backward more per layer). The targets (issue 53): exact ours >= 3x
TransformerLens, <= 1 forward per head; attribution of every head and neuron <= 3 forwards.
Edge attribution (``pcw.edge_attribution``) of every edge (embed, heads and MLPs into every head's
query, key and value input, every MLP's input and the logits: 32,491 edges at GPT-2-small's shape), EAP
(one forward with read taps and one backward, then one product of the output differences with the
gradients) and EAP-IG with ``--steps`` (a forward and a backward per step), in forwards per step
(target <= 3), timed alternating with the forward, best of each of ``max(--repeats, 3)``; and ``.faithfulness`` of its top-1% circuit (one forward per layer's attention and per
MLP, and one for the metric), in forwards. ``--smoke``: 2 layers of 2 heads, 2 prompts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

from peaks import best_seconds, load_average


def word_tokenizer(size: int):
    """A local tokenizer of ``size`` words ``w0 w1 ...`` (nothing downloaded: the bridge needs one)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def alternating_best(fns: list, repeats: int) -> list[float]:
    """The fastest of ``repeats`` timed calls of each of ``fns``, called in turn (after one untimed call each)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="EAP-IG's integration steps")
    ap.add_argument("--edges-only", action="store_true", help="time only the forward and edge attribution")
    ap.add_argument("--smoke", action="store_true", help="2 layers of 2 heads, 2 prompts: checks that it runs")
    a = ap.parse_args()
    os.environ.setdefault("PCW_PROGRESS", "0")
    import transformer_lens.patching as tl_patching
    import transformers
    from transformer_lens import TransformerBridge

    import pycircuits_widgets as pcw

    shape = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 1000} if a.smoke else {}
    if a.smoke:
        a.prompts, a.repeats = 2, 1
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).eval()
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=hf, tokenizer=word_tokenizer(hf.config.vocab_size))
    model = pcw.from_transformer_lens(bridge)
    c = model.cfg
    g = torch.Generator().manual_seed(0)
    clean, corrupted = (torch.randint(0, c.d_vocab, (a.prompts, a.tokens), generator=g) for _ in range(2))
    answers = torch.randint(0, c.d_vocab, (a.prompts, 2), generator=g)
    task = pcw.Task(model, clean, corrupted, answers=[tuple(map(int, pair)) for pair in answers])
    with torch.no_grad():
        _, clean_cache = bridge.run_with_cache(clean)
    rows = torch.arange(a.prompts)

    def metric(logits):
        at = logits[:, -1].detach().double()
        return task.normalise(float((at[rows, answers[:, 0]] - at[rows, answers[:, 1]]).mean()))

    def tl():
        with torch.no_grad():
            return tl_patching.get_act_patch_attn_head_out_all_pos(bridge, corrupted, clean_cache, metric)

    # alternating, best of each: a neighbour's load on a shared machine falls on all of them alike
    forward, eap, ig = alternating_best([lambda: model.run_with_cache(corrupted),
                                         lambda: pcw.edge_attribution(model, task),
                                         lambda: pcw.edge_attribution(model, task, "eap-ig", a.steps)],
                                        max(a.repeats, 3))
    result = pcw.edge_attribution(model, task)
    top = result.circuit(top_n=max(1, len(result.edges) // 100))
    faithful = best_seconds(lambda: result.faithfulness(top), 1)
    heads = c.n_layers * c.n_heads
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {c.n_layers} layers x {c.n_heads} heads, "
          f"d_model {c.d_model}, vocab {c.d_vocab}; {a.prompts} prompts of {a.tokens} tokens; {load_average()}")
    print("| operation | ours (s) | TransformerLens (s) | TL / ours | ours in forwards |")
    print("|---|---|---|---|---|")
    print(f"| one forward (the unit) | {forward:.3f} | | | 1 |")
    print(f"| edge_attribution eap, all {len(result.edges)} edges | {eap:.3f} | | | {eap / forward:.2f} per step |")
    print(f"| edge_attribution eap-ig, steps={a.steps} | {ig:.3f} | | | {ig / forward / a.steps:.2f} per step |")
    print(f"| faithfulness of the top {len(top)} edges | {faithful:.3f} | | | {faithful / forward:.2f} in all |")
    if a.edges_only:
        return
    # alternating too: the ratio and the forwards per head from runs under the same neighbours' load
    unit, ours, theirs = alternating_best([lambda: model.run_with_cache(corrupted),
                                           lambda: pcw.activation_patch(model, task, "head_out"), tl], a.repeats)
    attribution = {site: best_seconds(lambda site=site: pcw.attribution_patch(model, task, site), a.repeats)
                   for site in ("head_out", "neuron", "k_input")}
    graddrop = best_seconds(lambda: pcw.attribution_patch(model, task, "head_out", graddrop=True), a.repeats)
    print(f"| head_out patching, all {heads} heads | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f}x | "
          f"{ours / unit / heads:.2f} per head (its own forward {unit:.3f} s) |")
    for site, seconds in attribution.items():
        cells = c.n_layers * c.d_mlp if site == "neuron" else heads
        print(f"| attribution_patch {site}, all {cells} cells | {seconds:.3f} | | | {seconds / forward:.2f} in all |")
    print(f"| attribution_patch head_out, graddrop=True | {graddrop:.3f} | | | {graddrop / forward:.2f} in all |")
    print(f"({load_average()})")


if __name__ == "__main__":
    main()
