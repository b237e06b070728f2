"""Benchmark FactoredMatrix against TransformerLens's FactoredMatrix and dense torch.

GPT-2-small shapes with random weights (d_vocab 50257, d_model 768, 12 x 12 heads,
d_head 64). Each measurement runs in its own subprocess so that the peak resident memory
(``ru_maxrss``) belongs to that measurement alone; a "weights only" row gives the floor.

Run: ``python benchmarks/bench_factored.py`` (about 3-5 minutes on 2 cores). Peers timed on a
fraction of the work and scaled up are marked ``~`` (the peer's name says the fraction); the
load average is printed with every case. ``--smoke``: every case at ``SMOKE`` shapes in this process:
checks that the script runs end to end (its numbers mean nothing).
"""

import argparse
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peaks import screen_route

D_VOCAB, D_MODEL, N_LAYERS, N_HEADS, D_HEAD = 50257, 768, 12, 12, 64
TOPK_BLOCK_ROWS = 333  # ours uses 64 MiB blocks = 333 rows of 50257 floats; TL gets the same
TL_TOPK_FRACTION = 5  # TL's chunked top-k is timed on the first 1/5 of the rows, times 5
SMOKE = {"D_VOCAB": 128, "D_MODEL": 32, "N_LAYERS": 2, "N_HEADS": 2, "D_HEAD": 8}
"""``--smoke``: these shapes for every case (each case's own vocabulary capped at ``D_VOCAB``)."""


def weights(d_vocab=D_VOCAB):
    """GPT-2-small-shaped random weights, each generated on first use (so peak memory counts only what a case touches)."""
    lead = (N_LAYERS, N_HEADS)
    shapes = {
        "W_E": (d_vocab, D_MODEL), "W_U": (D_MODEL, d_vocab),
        "W_Q": (*lead, D_MODEL, D_HEAD), "W_K": (*lead, D_MODEL, D_HEAD),
        "W_V": (*lead, D_MODEL, D_HEAD), "W_O": (*lead, D_HEAD, D_MODEL),
    }

    class Lazy(dict):
        def __missing__(self, name):
            seed = list(shapes).index(name)
            self[name] = torch.randn(*shapes[name], generator=torch.Generator().manual_seed(seed)) * 0.02
            return self[name]

    return Lazy()


def ours_eig(W):
    from pycircuits_widgets.factored import eigenvalues_of_product

    return eigenvalues_of_product(W["W_E"], W["W_V"], W["W_O"], W["W_U"])


def tl_eig_one_layer(W):
    from transformer_lens import FactoredMatrix as TL

    return (W["W_E"] @ TL(W["W_V"][0], W["W_O"][0]) @ W["W_U"]).eigenvalues


def dense_eig_one_head(W):
    return torch.linalg.eigvals(W["W_E"] @ W["W_V"][0, 0] @ W["W_O"][0, 0] @ W["W_U"])


def ours_norm(W):
    from pycircuits_widgets.factored import FactoredMatrix

    return FactoredMatrix(W["W_V"], W["W_O"]).norm()


def tl_norm(W):
    from transformer_lens import FactoredMatrix as TL

    return TL(W["W_V"], W["W_O"]).norm()


def dense_norm(W):
    return torch.linalg.matrix_norm(W["W_V"] @ W["W_O"])


def ours_topk(W):
    from pycircuits_widgets.factored import FactoredMatrix

    qk = W["W_E"] @ FactoredMatrix(W["W_Q"][0, 0], W["W_K"][0, 0].T) @ W["W_E"].T
    return qk.topk(100)[0]


def tl_topk_fraction(W):
    """The obvious TL way: TL's FactoredMatrix, row chunks densified, torch.topk per chunk."""
    from transformer_lens import FactoredMatrix as TL

    qk = W["W_E"] @ TL(W["W_Q"][0, 0], W["W_K"][0, 0].T) @ W["W_E"].T
    n_rows = qk.ldim // TL_TOPK_FRACTION
    best = []
    for start in range(0, n_rows, TOPK_BLOCK_ROWS):
        block = qk[start : min(start + TOPK_BLOCK_ROWS, n_rows)].AB.flatten()
        values, _idx = torch.topk(block, 100)
        best.append(values)
    return torch.topk(torch.cat(best), 100).values


def dense_topk(W):
    qk = W["W_E"] @ W["W_Q"][0, 0] @ W["W_K"][0, 0].T @ W["W_E"].T
    return torch.topk(qk.flatten(), 100).values


def weights_only(W):
    return None


OV, QK, ALL = ("W_E", "W_V", "W_O", "W_U"), ("W_E", "W_Q", "W_K"), ("W_E", "W_U", "W_Q", "W_K", "W_V", "W_O")
# name: (d_vocab, function of the weights, extrapolation factor, weights it reads)
CASES = {
    "weights_only": (D_VOCAB, weights_only, 1, ALL),
    "ours_eig": (D_VOCAB, ours_eig, 1, OV),
    "tl_eig": (D_VOCAB, tl_eig_one_layer, N_LAYERS, OV),
    "ours_eig_2000": (2000, ours_eig, 1, OV),
    "dense_eig_2000": (2000, dense_eig_one_head, N_LAYERS * N_HEADS, OV),
    "ours_norm": (D_VOCAB, ours_norm, 1, ("W_V", "W_O")),
    "tl_norm": (D_VOCAB, tl_norm, 1, ("W_V", "W_O")),
    "dense_norm": (D_VOCAB, dense_norm, 1, ("W_V", "W_O")),
    "ours_topk": (D_VOCAB, ours_topk, 1, QK),
    "tl_topk": (D_VOCAB, tl_topk_fraction, TL_TOPK_FRACTION, QK),
    "ours_topk_5000": (5000, ours_topk, 1, QK),
    "dense_topk_5000": (5000, dense_topk, 1, QK),
}

# (operation, ours case, peer case, peer name and how it was timed)
ROWS = [
    ("(a) eig, 144 full OV circuits", "ours_eig", "tl_eig", "TL FactoredMatrix (1 layer x12)"),
    ("(a) eig, 144 OV, vocab 2000", "ours_eig_2000", "dense_eig_2000", "dense eigvals (1 head x144)"),
    ("(b) Frobenius norm, 144 OV", "ours_norm", "tl_norm", "TL FactoredMatrix.norm"),
    ("(b) Frobenius norm, 144 OV", "ours_norm", "dense_norm", "dense W_V@W_O"),
    ("(c) top-100 full QK 50257^2", "ours_topk", "tl_topk", "TL rows+torch.topk (1/5 x5)"),
    ("(c) top-100 QK, vocab 5000", "ours_topk_5000", "dense_topk_5000", "dense + torch.topk"),
]


def measure(name):
    """Run one case in this process; print seconds (extrapolated) and peak RSS as JSON."""
    vocab, fn, scale, needed = CASES[name]
    W = weights(min(vocab, D_VOCAB))
    for weight in needed:  # generate before the clock starts
        W[weight]
    repeats = 3 if name.startswith(("ours_norm", "dense_norm")) else 1  # sub-second cases: best of 3
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        fn(W)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "seconds": min(times) * scale, "cpu_seconds": min(cpu_times) * scale,
        "peak_mib": peak_mib, "threads": torch.get_num_threads(), "scaled": scale != 1,
    }))


def run_case(name, in_process=False):
    """``measure(name)``'s result, from a fresh process (``in_process``: from this one)."""
    if in_process:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            measure(name)
        return json.loads(out.getvalue())
    out = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(smoke=False):
    if smoke:
        globals().update(SMOKE)
    results = {}
    for name in CASES:
        results[name] = run_case(name, in_process=smoke)
        print(f"  {name}: {results[name]['seconds']:.3f} s, {results[name]['peak_mib']:.0f} MiB "
              f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    floor = results["weights_only"]["peak_mib"]
    shapes = f"smoke shapes {SMOKE}" if smoke else "GPT-2-small shapes"
    print(f"{shapes}; torch {torch.__version__}, {results['ours_eig']['threads']} threads; "
          f"peak RSS per process (all GPT-2-small weights + interpreter alone: {floor:.0f} MiB); load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} at the end; ~ = scaled up from the fraction named")
    print(screen_route())
    header = (f"| {'operation':30} | {'ours s':>8} | {'ours CPU s':>10} | {'peer':32} | {'peer s':>8} | "
              f"{'peer CPU s':>10} | {'peer/ours':>9} | {'ours peak MiB':>13} | {'peer peak MiB':>13} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for op, ours, peer, peer_name in ROWS:
        o, p = results[ours], results[peer]
        t = "~" if p["scaled"] else " "
        print(f"| {op:30} | {o['seconds']:8.3f} | {o['cpu_seconds']:10.3f} | {peer_name:32} | {t}{p['seconds']:7.3f} | "
              f"{t}{p['cpu_seconds']:9.3f} | {t}{p['seconds'] / o['seconds']:7.1f}x | {o['peak_mib']:13.0f} | {p['peak_mib']:13.0f} |")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every case at tiny shapes in this process: checks that "
                        "the script runs end to end (its numbers mean nothing)")
    parser.add_argument("case", nargs="?", choices=list(CASES), help=argparse.SUPPRESS)  # one case, in a fresh process
    args = parser.parse_args()
    if args.case:
        measure(args.case)
    else:
        main(args.smoke)
