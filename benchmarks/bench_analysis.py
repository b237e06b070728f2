"""Benchmark the analysis core at GPT-2-small shapes (random weights) against TransformerLens.

    .venv/bin/python benchmarks/bench_analysis.py [--repeats 3] [--full-tl] [--only skip eig comp] [--smoke]

Shapes: d_vocab 50257 (and 151936, Qwen2's, for skip-trigrams), d_model 768, 12 layers x 12
heads, d_head 64, float32. Every measurement runs in a fresh subprocess (so "cold" is a first
call; "warm" is a second call in the same process, the analysis cache cleared before it) and its
peak memory (``ru_maxrss`` minus the RSS after the weights were built) is its own. Ours and the peer alternate, ``--repeats`` rounds;
the table gives medians and the load average seen during the run. Peers run on all the work,
except where stated with ``~`` and the fraction measured. "% peak" = the minimum work of the
kernel (stated per row) over the measured GEMM peak of its precision (``peaks.py``, same run)
and our cold median; skip-trigrams also against ``screen-thin``, the measured roofline of their
int8 screen at inner dimension d_head = 64 (``peaks.py``). ``--smoke``: tiny shapes, one round,
every case in this process: checks that the script runs end to end (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peaks import format_peaks, load_average, measure_peaks, measure_peaks_apart, screen_route

SHAPES = {"n_layers": 12, "n_heads": 12, "d_model": 768, "d_head": 64, "d_vocab": 50257, "n_ctx": 1024}


SMOKE_SHAPES = {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_head": 8, "d_vocab": 512, "n_ctx": 32}
"""``--smoke``: the smallest shapes every case runs at (skip-trigrams also at twice the vocabulary)."""


class TokenIds:
    """Token ``i`` displays as ``"t{i}"`` (the analyses read token strings only to label results)."""

    def encode(self, text: str) -> list[int]:
        return [int(t[1:]) for t in text.split()]

    def display_token(self, token_id: int) -> str:
        return f"t{token_id}"


def gpt2_like(seed: int = 0, **over):
    """A ``CircuitModel`` with GPT-2-small shapes (``SHAPES``, updated by ``over``) and Gaussian weights."""
    import torch

    from pycircuits_widgets.models import CircuitModel
    from pycircuits_widgets.models.config import ModelConfig

    s = {**SHAPES, **over}
    cfg = ModelConfig(positional="learned", name="gpt2-shapes", **s)
    g = torch.Generator().manual_seed(seed)
    L, H, d, dh, V = s["n_layers"], s["n_heads"], s["d_model"], s["d_head"], s["d_vocab"]
    r = lambda *shape, std: torch.randn(*shape, generator=g) * std
    return CircuitModel(
        cfg, tokenizer=TokenIds(), W_E=r(V, d, std=0.1), W_U=r(d, V, std=0.1), W_pos=r(s["n_ctx"], d, std=0.01),
        W_Q=r(L, H, d, dh, std=d ** -0.5), W_K=r(L, H, d, dh, std=d ** -0.5),
        W_V=r(L, H, d, dh, std=d ** -0.5), W_O=r(L, H, dh, d, std=dh ** -0.5),
    )


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---------------------------------------------------------------- operations (run in children)
def uncached(model, call):
    """``call`` with ``model``'s analysis cache cleared first: a second call ("warm") computes again
    rather than reading the first call's result (``analysis.cache``)."""
    from pycircuits_widgets.analysis import cache

    def go():
        cache.clear(model)
        return call()
    return go


def op_comp_ours(kind, n_layers):
    from pycircuits_widgets.analysis import composition_scores
    m = gpt2_like(n_layers=n_layers)
    return uncached(m, lambda: composition_scores(m, kind, baseline=False)), 1.0


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
    return uncached(m, lambda: eigenvalue_positivity(m, kind)), 1.0


def op_eig_tl(kind):
    # TL route on all 144 heads: one FactoredMatrix full circuit per head, .eigenvalues, positivity
    from transformer_lens.FactoredMatrix import FactoredMatrix as TFM
    m = gpt2_like()

    def go():
        for l in range(SHAPES["n_layers"]):
            for h in range(SHAPES["n_heads"]):
                fm = (TFM(m.W_E @ m.W_V[l, h], m.W_O[l, h] @ m.W_U) if kind == "OV"
                      else TFM(m.W_E @ m.W_Q[l, h], (m.W_E @ m.W_K[l, h]).T))
                ev = fm.eigenvalues
                (ev.sum().real / ev.abs().sum()).item()
    return go, 1.0


def op_skip_ours(k, vocab):
    from pycircuits_widgets.analysis import skip_trigrams
    m = gpt2_like(n_layers=1, d_vocab=vocab)
    return uncached(m, lambda: skip_trigrams(m, 0, 0, k=k)), 1.0


def op_skip_tl(k, vocab, fraction):
    # the obvious route (TransformerLens style): dense row blocks of both centred circuits through
    # TL's FactoredMatrix, torch.topk per source row, merge; on the first `fraction` of the sources
    import torch
    from transformer_lens.FactoredMatrix import FactoredMatrix as TFM

    from pycircuits_widgets.analysis.skip_trigrams import centred_factors
    m = gpt2_like(n_layers=1, d_vocab=vocab)
    rows = round(vocab * fraction)
    q, kk, v, u = centred_factors(m, 0, 0)  # not timed: favours the peer, keeps ~ a plain scale-up

    def go():
        best = torch.empty(0)
        for s in range(0, rows, 256):
            stop = min(s + 256, rows)
            qv, _ = torch.topk(TFM(kk[s:stop], q.T).AB, k, dim=1)  # QK^T rows [src, dest]
            ov, _ = torch.topk(TFM(v[s:stop], u).AB, k, dim=1)
            cand = (qv.clamp_min(0)[:, :, None] * ov.clamp_min(0)[:, None, :]).flatten()
            best = torch.topk(torch.cat([best, cand]), k).values
    return go, fraction


def child(name, args):
    import torch
    torch.manual_seed(0)
    fn, fraction = globals()[name](*args)
    before = rss_mb()
    t = time.perf_counter()
    fn()
    cold = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    warm = None
    if fraction == 1.0 and name.endswith("_ours"):
        t = time.perf_counter()
        fn()
        warm = time.perf_counter() - t
    print(json.dumps({"cold": cold, "warm": warm, "fraction": fraction, "mem_mb": max(0.0, peak - before)}))


def measure(name, *args, in_process=False):
    """One case's ``child`` result, run in a fresh process (``in_process``: in this one, for ``--smoke``)."""
    if in_process:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()) as out:
            child(name, args)
    else:
        out = subprocess.run([sys.executable, __file__, "--child", name, json.dumps(args)],
                             capture_output=True, text=True, check=True)
    r = json.loads(out.getvalue() if in_process else out.stdout.strip().splitlines()[-1])
    r["load"] = os.getloadavg()[0]
    return r


def gemm_work(d_vocab, symmetric):
    """Minimum work of one full-circuit eigen pass, GOP: the vocab-sized product (its upper
    triangle when symmetric) plus 144 heads' ``[d_head, d_model] [d_model, d_model] [d_model, d_head]``."""
    d, dh, heads = SHAPES["d_model"], SHAPES["d_head"], SHAPES["n_layers"] * SHAPES["n_heads"]
    vocab = d_vocab * d * (d + 1) if symmetric else 2 * d_vocab * d * d
    return (vocab + 2 * heads * (dh * d * d + dh * dh * d)) / 1e9


def rows_to_run(a):
    """(group, label, ours spec, peer spec, peer label, work GOP, peak keys) of every row."""
    V, dh, L, H = SHAPES["d_vocab"], SHAPES["d_head"], SHAPES["n_layers"], SHAPES["n_heads"]
    pair, heads = f"2-layer subset ({2 * H}x{2 * H})", f"all {L * H} heads"
    rows = []
    if "comp" in a.only:
        if a.full_tl:
            rows.append(("comp", f"composition scores K, all {L * H}x{L * H} heads", ("op_comp_ours", "K", L),
                         ("op_comp_tl", "K", L), "TL composition_scores, all layers", None, None))
        for kind in ("Q", "K", "V"):
            rows.append(("comp", f"composition scores {kind}, {pair}", ("op_comp_ours", kind, 2),
                         ("op_comp_tl", kind, 2), "TL composition_scores, same subset", None, None))
    if "eig" in a.only:
        for kind in ("OV", "QK"):
            rows.append(("eig", f"eigenvalue positivity {kind}, {heads}", ("op_eig_ours", kind),
                         ("op_eig_tl", kind), f"TL FactoredMatrix, each of {L * H} heads",
                         gemm_work(V, kind == "QK"), ("fp32",)))
    if "skip" in a.only:
        for vocab, fraction in ((V, 1.0), (2 * V if a.smoke else 151936, a.fraction)):
            peer = "TL FM rows + topk" + ("" if fraction == 1 else f" ({fraction:g} of sources)")
            rows.append(("skip", f"exact skip-trigram top-100, d_vocab {vocab}", ("op_skip_ours", 100, vocab),
                         ("op_skip_tl", 100, vocab, fraction), peer, 4 * vocab * vocab * dh / 1e9,
                         ("int8", "screen-thin")))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of ours/peer, interleaved (default 3)")
    ap.add_argument("--only", nargs="+", default=["skip", "eig", "comp"], choices=["skip", "eig", "comp"])
    ap.add_argument("--fraction", type=float, default=0.125,
                    help="share of the sources the peer runs at d_vocab 151936 (extrapolated, marked ~)")
    ap.add_argument("--full-tl", action="store_true",
                    help="also run TL's composition scores on all 12 layers (K; ~8 GB)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round, every case in this process: "
                    "checks that the script runs end to end (its numbers mean nothing)")
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], json.loads(a.child[1]))
    from importlib.metadata import version

    import torch

    if a.smoke:
        SHAPES.update(SMOKE_SHAPES)
        a.repeats = 1
    print(f"torch {torch.__version__}, transformer-lens {version('transformer-lens')}, python "
          f"{platform.python_version()}, threads {torch.get_num_threads()}, cpus {os.cpu_count()}; {load_average()}")
    peaks = measure_peaks(256, repeats=1) if a.smoke else measure_peaks_apart()
    print(f"measured peaks: {format_peaks(peaks)}; {load_average()}\n{screen_route()}", flush=True)
    rows = rows_to_run(a)
    results = {r[1]: ([], []) for r in rows}
    loads = []
    for rep in range(a.repeats):  # interleaved: every row's ours and peer in each round
        for _, label, ours, peer, _, _, _ in rows:
            o, p = measure(*ours, in_process=a.smoke), measure(*peer, in_process=a.smoke)
            results[label][0].append(o)
            results[label][1].append(p)
            loads += [o["load"], p["load"]]
            print(f"  round {rep + 1}: {label}: ours {o['cold']:.2f} s, peer {p['cold'] / p['fraction']:.2f} s "
                  f"(load {o['load']:.1f} / {p['load']:.1f})", file=sys.stderr, flush=True)
    shapes = "smoke shapes " + json.dumps(SMOKE_SHAPES) if a.smoke else "GPT-2-small shapes"
    print(f"{shapes}, random float32 weights; {a.repeats} interleaved rounds, medians; load average "
          f"(1 min) {min(loads):.1f}-{max(loads):.1f} during the run, {load_average()} at the end")
    print(f"{'operation':<46} {'ours cold':>9} {'warm':>7} {'peak+':>8} | {'peer':<38} {'peer':>9} {'peak+':>8} "
          f"| {'ratio':>6} | % peak")
    for _, label, _, _, peer_label, work, peak_keys in rows:
        os_, ps = results[label]
        cold = statistics.median(o["cold"] for o in os_)
        warms = [o["warm"] for o in os_ if o["warm"] is not None]
        warm = f"{statistics.median(warms):.2f}" if warms else "-"
        frac = ps[0]["fraction"]
        peer = statistics.median(p["cold"] / frac for p in ps)
        mark = "~" if frac != 1.0 else ""
        pct = ", ".join(f"{100 * work / peaks[key] / cold:.0f}% {key}" for key in peak_keys or () if key in peaks) or "-"
        print(f"{label:<46} {cold:>7.2f} s {warm:>7} {statistics.median(o['mem_mb'] for o in os_):>5.0f} MB | "
              f"{peer_label:<38} {mark}{peer:>7.2f} s {statistics.median(p['mem_mb'] for p in ps):>5.0f} MB | "
              f"{mark}{peer / cold:>5.1f}x | {pct}")


if __name__ == "__main__":
    main()
