"""Causal checks as multiples of one forward pass of the same model, measured in the same run; and,
with ``--findings``, what they find on the shipped 2-layer model.

Run:  .venv/bin/python benchmarks/bench_interventions.py [--rounds 7] [--threads 2] [--models attn-only-2l gpt2-small]
      .venv/bin/python benchmarks/bench_interventions.py --findings      # the shipped model's numbers only
      .venv/bin/python benchmarks/bench_interventions.py --smoke         # one round, the shipped model only
      .venv/bin/python benchmarks/bench_interventions.py --explorer [--models ...]   # the explorer's toggle only

Models (nothing downloaded): the shipped ``attn-only-2l`` on the demo text, repeated to 100 tokens
(the explorer's text size); a GPT-2-small-shaped model (``transformers.GPT2Config()`` defaults: 12 x 12
heads, d_model 768, MLPs, d_vocab 50257) with random weights, read through ``pcw.from_hf``, on 100
random token ids.

Each round times, one after the other: the forward (``model.run_with_cache(tokens)``, what every
ratio divides by), then each operation (one under 50 ms a few times in a row); the table shows each
one's fastest call and its ratio to the fastest forward (on a shared machine the fastest call is the
one least disturbed, for both). The
explorer holds the clean run of its text, so the operations are given it (``clean=pcw.run(...)``)
except "ablate, clean run included". Targets (issue 41): one head's ablation <= 1 forward, the
measured K-composition matrix at GPT-2-small shape <= 10 forwards, all three kinds <= 30.

"one path_patch per pair" is the route without batching: one forward per (writer, reader) pair,
resumed at the reader's layer and carried to the loss, timed on a sample of pairs (one reader per
layer) and scaled to all pairs (``~``). Beside the
wall clock, each operation's process CPU time (both threads): on a machine other jobs share, the
wall clock of a long operation takes their share too, its CPU time does not.

``--explorer``: the explorer's ablate toggle on each model's text (a ``CircuitExplorer`` in a script, where
the toggle's run is computed at once): the forwards each click runs (``run_with_cache`` calls, counted;
"resumed": from the clean run at the head's layer) and its time beside one forward (the click's time includes
every view's update; a head click in a script also recomputes the other sections for the new head). Target (issue 41):
a toggle <= 1 forward; "off" none.

``--findings``: on the shipped model, the previous-token heads of layer 0 and the induction heads of
layer 1 (``pcw.head_scores`` over 0.5), each previous-token head's measured K-composition into each
induction head on the demo text beside the weight-based ``pcw.composition_scores(model, "K")`` (raw
and less its random baseline), and the loss change from zero-ablating each induction head on the demo
text and on a stdlib-corpus sample (the model's training corpus, ``models.corpus``: the first 128
tokens of every 40th stdlib source file).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch

import pycircuits_widgets as pcw
from peaks import load_average  # benchmarks/ is on sys.path when run as a script
from pycircuits_widgets.demo import SAMPLE_TEXT
from pycircuits_widgets.models.corpus import corpus_documents

N_TOKENS = 100


def shipped():
    """The shipped 2-layer model and the demo text repeated to ``N_TOKENS`` tokens."""
    model = pcw.load_pretrained("attn-only-2l")
    ids = model.to_tokens(SAMPLE_TEXT)
    return model, ids.repeat(N_TOKENS // len(ids) + 1)[:N_TOKENS][None]


def gpt2_small():
    """GPT-2-small shape, random weights, and ``N_TOKENS`` random ids."""
    import transformers

    torch.manual_seed(0)
    model = pcw.from_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval(), verify=False)
    return model, torch.randint(0, model.cfg.d_vocab, (1, N_TOKENS), generator=torch.Generator().manual_seed(0))


MODELS = {"attn-only-2l": shipped, "gpt2-small": gpt2_small}


def operations(model, tokens, clean) -> dict:
    """``{label: call}`` of the timed operations."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    ops = {
        "ablate one head, layer 0": lambda: pcw.ablate(model, tokens, heads=[(0, 1)], clean=clean),
        f"ablate one head, layer {L - 1}": lambda: pcw.ablate(model, tokens, heads=[(L - 1, 1)], clean=clean),
        "ablate one head, layer 0, clean run included": lambda: pcw.ablate(model, tokens, heads=[(0, 1)]),
        f"path_patch L0.H0 -> L{L - 1}.H1 by K": lambda: pcw.path_patch(model, tokens, (0, 0), (L - 1, 1), "K",
                                                                        clean=clean),
    }
    for via in "KQV":
        ops[f"measured_composition {via} ({L}x{H} heads)"] = \
            lambda via=via: pcw.measured_composition(model, tokens, via, clean=clean)
    return ops


def per_pair(model, tokens, clean) -> dict:
    """``{label: (call, pairs)}``: ``path_patch`` by K into head 0 of each later layer, and the number of
    pairs one such call stands for (every writer before that layer, every reader in it)."""
    H = model.cfg.n_heads
    return {f"path_patch into layer {layer}": (lambda layer=layer: pcw.path_patch(model, tokens, (0, 0), (layer, 0),
                                                                                 "K", clean=clean), layer * H * H)
            for layer in range(1, model.cfg.n_layers)}


def timed(call) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``call()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench(name: str, rounds: int) -> None:
    model, tokens = MODELS[name]()
    clean = pcw.run(model, tokens)
    ops = operations(model, tokens, clean)
    pairs = per_pair(model, tokens, clean)
    calls = {"forward": lambda: model.run_with_cache(tokens), **ops, **{k: call for k, (call, _) in pairs.items()}}
    best = {label: [float("inf")] * 2 for label in calls}
    with torch.no_grad():
        # warm-up; an operation under 50 ms runs several times a round (one call would time its neighbours'
        # freed memory and idle threads as much as itself)
        repeats = {label: max(1, min(20, int(0.05 / timed(call)[0]))) for label, call in calls.items()}
        print(f"\n## {name}: {load_average()} (start)", flush=True)
        for _ in range(rounds):
            for label, call in calls.items():
                for _ in range(repeats[label]):
                    best[label] = [min(a, b) for a, b in zip(best[label], timed(call))]
    (fw, fw_cpu) = best["forward"]
    print(f"{load_average()} (end); {rounds} rounds, fastest of each (wall clock; process CPU time)")
    print("| operation | time | forwards | CPU time | forwards (CPU) |\n|---|---|---|---|---|")

    def row(label, wall, cpu, approx=""):
        print(f"| {label} | {approx}{wall * 1e3:.1f} ms | {approx}{wall / fw:.2f} | {approx}{cpu * 1e3:.1f} ms "
              f"| {approx}{cpu / fw_cpu:.2f} |")

    row(f"forward (run_with_cache, {tokens.shape[1]} tokens)", fw, fw_cpu)
    for label in ops:
        row(label, *best[label])
    three = [sum(best[label][i] for label in ops if label.startswith("measured_composition")) for i in (0, 1)]
    row("measured_composition, all three kinds", *three)
    row("K by one path_patch per pair (a resumed forward each; sampled, scaled)",
        *[sum(best[label][i] * n for label, (_, n) in pairs.items()) for i in (0, 1)], approx="~")
    print(flush=True)


def explorer_toggle(name: str, rounds: int) -> None:
    """The explorer's ablate toggle: forwards run and time per click, beside one forward."""
    model, tokens = MODELS[name]()
    explorer = pcw.CircuitExplorer(model, tokens[0], layer=model.cfg.n_layers - 1, head=1)
    model = explorer.model  # (the explorer's view of the model reading ids)
    forward = model.run_with_cache
    calls = []

    def counted(*args, resume=None, **kwargs):
        calls.append(resume is not None)
        return forward(*args, resume=resume, **kwargs)

    model.run_with_cache = counted
    L = model.cfg.n_layers
    clicks = {"ablate (zero) on": lambda: setattr(explorer.causal, "ablation", "zero"),
              "another head (layer 0) while on": lambda: (setattr(explorer, "layer", 0)),
              f"back to a layer-{L - 1} head while on": lambda: setattr(explorer, "layer", L - 1),
              "ablate off (the clean run kept)": lambda: setattr(explorer.causal, "ablation", "off")}
    clean = explorer.forward(model, explorer.text)
    alone = lambda: pcw.ablate(model, clean.tokens, heads=[(L - 1, 1)], clean=clean)
    best = {label: float("inf") for label in ["forward", "alone", *clicks]}
    runs = {}
    print(f"\n## explorer toggle, {name}, {tokens.shape[1]} tokens: {load_average()} (start)", flush=True)
    for _ in range(rounds):
        best["forward"] = min(best["forward"], timed(lambda: forward(tokens))[0])
        best["alone"] = min(best["alone"], timed(alone)[0])
        for label, click in clicks.items():
            calls.clear()
            best[label] = min(best[label], timed(click)[0])
            runs[label] = list(calls)
    del model.run_with_cache
    explorer.close()
    print(f"{load_average()} (end); {rounds} rounds, fastest of each (wall clock)")
    print("| click | forwards run | time (every view's update included) | forwards (time) |\n|---|---|---|---|")
    print(f"| one forward | 1 | {best['forward'] * 1e3:.1f} ms | 1.00 |")
    print(f"| pcw.ablate of a layer-{L - 1} head alone (what the toggle runs) | 1 (1 resumed) | "
          f"{best['alone'] * 1e3:.1f} ms | {best['alone'] / best['forward']:.2f} |")
    for label in clicks:
        n = f"{len(runs[label])} ({sum(runs[label])} resumed)"
        print(f"| {label} | {n} | {best[label] * 1e3:.1f} ms | {best[label] / best['forward']:.2f} |")


def corpus_sample(model, every: int = 40, length: int = 128) -> torch.Tensor:
    """``[n, length]``: the first ``length`` tokens of every ``every``-th stdlib source file (long enough)."""
    rows = []
    for doc in corpus_documents("stdlib")[::every]:
        ids = model.tokenizer.encode(doc)
        if len(ids) >= length:
            rows.append(ids[:length])
    return torch.tensor(rows)


def findings() -> None:
    model = pcw.load_pretrained("attn-only-2l")
    scores = pcw.head_scores(model)
    previous = [h for h in range(model.cfg.n_heads) if scores["previous_token"][0, h] > 0.5]
    induction = [h for h in range(model.cfg.n_heads) if scores["induction"][1, h] > 0.5]
    demo = model.to_tokens(SAMPLE_TEXT)
    sample = corpus_sample(model)
    measured = pcw.measured_composition(model, demo, "K")
    raw, less_baseline = pcw.composition_scores(model, "K", baseline=False), pcw.composition_scores(model, "K")
    print(f"\n## attn-only-2l: previous-token heads L0.H{previous} (score > 0.5), induction heads L1.H{induction}")
    print(f"demo text {demo.shape[0]} tokens; stdlib sample {tuple(sample.shape)} tokens\n")
    print("| writer -> reader | prev-token / induction score | K-comp measured (demo text) | weight-based K-comp "
          "(raw) | less random baseline |\n|---|---|---|---|---|")
    for h1 in previous:
        for h2 in induction:
            print(f"| L0.H{h1} -> L1.H{h2} | {scores['previous_token'][0, h1]:.3f} / {scores['induction'][1, h2]:.3f} "
                  f"| {measured[0, h1, 1, h2]:.3f} | {raw[0, h1, 1, h2]:.3f} | {less_baseline[0, h1, 1, h2]:.3f} |")
    clean_demo, clean_sample = pcw.run(model, demo), pcw.run(model, sample)
    print(f"\n| zero-ablated head | loss change, demo text (clean {clean_demo.loss:.3f} nats) | stdlib sample "
          f"(clean {clean_sample.loss:.3f} nats) |")
    print("|---|---|---|")
    for h in induction:
        on_demo = pcw.ablate(model, demo, heads=[(1, h)], clean=clean_demo).loss_change
        on_sample = pcw.ablate(model, sample, heads=[(1, h)], clean=clean_sample).loss_change
        print(f"| L1.H{h} | {on_demo:+.3f} | {on_sample:+.3f} |")
    both = pcw.ablate(model, demo, heads=[(1, h) for h in induction], clean=clean_demo).loss_change
    both_sample = pcw.ablate(model, sample, heads=[(1, h) for h in induction], clean=clean_sample).loss_change
    print(f"| all {len(induction)} induction heads | {both:+.3f} | {both_sample:+.3f} |")
    for h1 in previous:
        on_demo = pcw.ablate(model, demo, heads=[(0, h1)], clean=clean_demo).loss_change
        on_sample = pcw.ablate(model, sample, heads=[(0, h1)], clean=clean_sample).loss_change
        print(f"| L0.H{h1} (previous-token) | {on_demo:+.3f} | {on_sample:+.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--findings", action="store_true", help="only the shipped model's numbers")
    ap.add_argument("--smoke", action="store_true", help="one round, the shipped model only: checks that the script "
                    "runs end to end")
    ap.add_argument("--explorer", action="store_true", help="only the explorer's ablate toggle")
    a = ap.parse_args()
    if a.smoke:
        a.rounds, a.models = 1, ["attn-only-2l"]
    torch.set_num_threads(a.threads)
    os.environ.setdefault("PCW_PROGRESS", "0")  # no bars between the timings
    print(f"pycircuits_widgets {pcw.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"python {sys.version.split()[0]}")
    if a.explorer:
        for name in a.models:
            explorer_toggle(name, a.rounds)
        return
    findings()
    if not a.findings:
        for name in a.models:
            bench(name, a.rounds)
        print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MB")


if __name__ == "__main__":
    main()
