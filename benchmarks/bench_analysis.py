"""Benchmark the analysis core at GPT-2-small shapes (random weights) against TransformerLens.

    cd /work/main && .venv/bin/python benchmarks/bench_analysis.py [--full-tl]

Shapes: d_vocab 50257, d_model 768, 12 layers x 12 heads, d_head 64, float32. Every
operation runs in a fresh subprocess so its peak memory (``ru_maxrss`` minus the RSS after
the weights were built) is its own. Peers whose full run is too slow are timed on a stated
fraction and extrapolated (marked ``~``). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

SHAPES = dict(n_layers=12, n_heads=12, d_model=768, d_head=64, d_vocab=50257, n_ctx=1024)


def gpt2_like(seed: int = 0, **over):
    """A weight view with GPT-2-small shapes and Gaussian weights (what the analysis reads)."""
    import types

    import torch

    from pycircuits_widgets.models.config import ModelConfig

    s = {**SHAPES, **over}
    cfg = ModelConfig(positional="learned", name="gpt2-shapes", **s)
    g = torch.Generator().manual_seed(seed)
    L, H, d, dh, V = s["n_layers"], s["n_heads"], s["d_model"], s["d_head"], s["d_vocab"]
    r = lambda *shape, std: torch.randn(*shape, generator=g) * std  # noqa: E731
    return types.SimpleNamespace(
        cfg=cfg, W_E=r(V, d, std=0.1), W_U=r(d, V, std=0.1), W_pos=r(s["n_ctx"], d, std=0.01),
        W_Q=r(L, H, d, dh, std=d ** -0.5), W_K=r(L, H, d, dh, std=d ** -0.5),
        W_V=r(L, H, d, dh, std=d ** -0.5), W_O=r(L, H, dh, d, std=dh ** -0.5),
        token_strings=[f"t{i}" for i in range(V)],
    )


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---------------------------------------------------------------- operations (run in children)
def op_comp_ours(kind, n_layers):
    from pycircuits_widgets.analysis import composition_scores
    m = gpt2_like(n_layers=n_layers)
    return lambda: composition_scores(m, kind, baseline=False), 1.0


def op_comp_tl(kind, n_layers):
    from transformer_lens.FactoredMatrix import FactoredMatrix as TFM
    from transformer_lens.utilities.matrix import composition_scores as tl_scores
    m = gpt2_like(n_layers=n_layers)
    left = TFM(m.W_V, m.W_O)
    right = {"Q": lambda: TFM(m.W_Q, m.W_K.mT), "K": lambda: TFM(m.W_Q, m.W_K.mT).T, "V": lambda: left}[kind]
    return lambda: tl_scores(left, right()), 1.0


def op_eig_ours(kind):
    from pycircuits_widgets.analysis import eigenvalue_positivity
    m = gpt2_like()
    return lambda: eigenvalue_positivity(m, kind), 1.0


def op_eig_tl(kind, n_heads_timed):
    # TL route: one FactoredMatrix full circuit per head, .eigenvalues (its BA side), positivity
    from transformer_lens.FactoredMatrix import FactoredMatrix as TFM
    m = gpt2_like()
    heads = [(i // 12, i % 12) for i in range(n_heads_timed)]

    def go():
        for l, h in heads:
            fm = (TFM(m.W_E @ m.W_V[l, h], m.W_O[l, h] @ m.W_U) if kind == "OV"
                  else TFM(m.W_E @ m.W_Q[l, h], (m.W_E @ m.W_K[l, h]).T))
            ev = fm.eigenvalues
            (ev.sum().real / ev.abs().sum()).item()
    return go, 144 / n_heads_timed


def op_skip_ours(k):
    from pycircuits_widgets.analysis import skip_trigrams
    m = gpt2_like(n_layers=1)
    return lambda: skip_trigrams(m, 0, 0, k=k), 1.0


def op_skip_tl(k, rows):
    # the obvious route: dense row blocks of both circuits through TL's FactoredMatrix, torch.topk
    # per source row, merge; timed on `rows` sources and extrapolated to the vocabulary
    import torch
    from transformer_lens.FactoredMatrix import FactoredMatrix as TFM

    from pycircuits_widgets.analysis.skip_trigrams import centred_factors
    m = gpt2_like(n_layers=1)
    q, kk, v, u = centred_factors(m, 0, 0)

    def go():
        best = torch.empty(0)
        for s in range(0, rows, 256):
            qv, _ = torch.topk(TFM(kk[s:s + 256], q.T).AB, k, dim=1)  # QK^T rows [src, dest]
            ov, _ = torch.topk(TFM(v[s:s + 256], u).AB, k, dim=1)
            cand = (qv.clamp_min(0)[:, :, None] * ov.clamp_min(0)[:, None, :]).flatten()
            best = torch.topk(torch.cat([best, cand]), k).values
    return go, SHAPES["d_vocab"] / rows


def op_skip_dense(k, vocab):
    import torch

    from pycircuits_widgets.analysis.skip_trigrams import centred_factors
    m = gpt2_like(n_layers=1, d_vocab=vocab)
    q, kk, v, u = centred_factors(m, 0, 0)

    def go():
        qk_t, ovm = kk @ q.T, v @ u  # dense [V, V] each
        qv, _ = torch.topk(qk_t, k, dim=1)
        ov, _ = torch.topk(ovm, k, dim=1)
        torch.topk((qv.clamp_min(0)[:, :, None] * ov.clamp_min(0)[:, None, :]).flatten(), k)
    return go, 1.0


def op_skip_ours_small(k, vocab):
    from pycircuits_widgets.analysis import skip_trigrams
    m = gpt2_like(n_layers=1, d_vocab=vocab)
    return lambda: skip_trigrams(m, 0, 0, k=k), 1.0


def child(name, args):
    import torch
    torch.manual_seed(0)
    fn, scale = globals()[name](*args)
    before = rss_mb()
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"s": seconds * scale, "extrapolated": scale != 1.0, "mem_mb": max(0.0, peak - before)}))


def measure(name, *args):
    out = subprocess.run([sys.executable, __file__, "--child", name, json.dumps(args)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--full-tl", action="store_true",
                    help="also run TL's composition scores on all 12 layers (one kind; ~25-150 s, ~8 GB)")
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], json.loads(a.child[1]))
    import torch
    import transformer_lens

    def row(op, ours, peer, peer_name):
        o, p = measure(*ours), measure(*peer)
        fmt = lambda r: f"{'~' if r['extrapolated'] else ''}{r['s']:.2f} s"  # noqa: E731
        print(f"{op:<44} {fmt(o):>10} {o['mem_mb']:>8.0f} MB | {peer_name:<36} {fmt(p):>10} "
              f"{p['mem_mb']:>8.0f} MB | {p['s'] / o['s']:>6.1f}x", flush=True)

    print(f"torch {torch.__version__}, transformer-lens {transformer_lens.__version__ if hasattr(transformer_lens, '__version__') else '4.3.0'}, "
          f"python {platform.python_version()}, threads {torch.get_num_threads()}, cpu {platform.processor() or platform.machine()}")
    print("GPT-2-small shapes, random float32 weights. '~' = timed on a fraction, extrapolated.")
    print(f"{'operation':<44} {'ours':>10} {'peak+':>11} | {'peer':<36} {'peer':>10} {'peak+':>11} | ratio")
    if a.full_tl:
        row("composition scores K, all 144x144 heads", ("op_comp_ours", "K", 12),
            ("op_comp_tl", "K", 12), "TL composition_scores, all layers")
    for kind in ("Q", "K", "V"):
        row(f"composition scores {kind}, 2-layer subset (24x24)", ("op_comp_ours", kind, 2),
            ("op_comp_tl", kind, 2), "TL composition_scores, same subset")
    o = measure("op_comp_ours", "V", 12)
    print(f"{'composition scores V, all 144x144 heads':<44} {o['s']:>8.2f} s {o['mem_mb']:>8.0f} MB | "
          f"{'(TL: run with --full-tl)':<36}", flush=True)
    for kind in ("OV", "QK"):
        row(f"eigenvalue positivity {kind}, all 144 heads", ("op_eig_ours", kind),
            ("op_eig_tl", kind, 3), "TL FactoredMatrix per head (3 timed)")
    row("skip-trigram top-100, one head", ("op_skip_ours", 100),
        ("op_skip_tl", 100, 2048), "TL FM rows+topk (2048 rows timed)")
    row("skip-trigram top-100, d_vocab 4000", ("op_skip_ours_small", 100, 4000),
        ("op_skip_dense", 100, 4000), "naive dense circuits + topk")


if __name__ == "__main__":
    main()
