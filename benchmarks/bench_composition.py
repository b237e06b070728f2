"""Benchmark all-pairs Q/K/V composition at GPT-2-small, -medium, -large and -XL head shapes.

    .venv/bin/python benchmarks/bench_composition.py   # from the repository root [--direct-xl] [--no-tl]
    .venv/bin/python benchmarks/bench_composition.py --rotary 100   # a rotary window of 100 offsets
    .venv/bin/python benchmarks/bench_composition.py --smoke        # tiny shapes: checks the script runs

Random float32 weights built here (nothing downloaded), layer norm, GPT-2 head shapes:
small 12 x 12, medium 24 x 16, large 36 x 20, XL 48 x 25 heads of d_head 64 in d_model 768 /
1024 / 1280 / 1600. Every operation runs in a fresh subprocess, so its peak memory
(``ru_maxrss`` minus the RSS after the weights were built) is its own. Columns:

* ours: ``pcw.composition_scores(model, kind, baseline=False)`` (the Gram route); its FLOPs
  (``composition.gram_flops`` plus the per-head thin factors) and the fraction of the fp32 peak
  they reach, measured in the same run (``peaks.py``);
* direct: the route it replaced, one ``[H r, d_model] @ [d_model, later H r]`` GEMM per earlier
  layer on the same thin factors (``2 r^2 d_model`` per pair); XL only with ``--direct-xl``;
* TL: TransformerLens 4.3 ``utilities.matrix.composition_scores`` on the same (centred) weights,
  what ``all_composition_scores`` runs; GPT-2-small only (+8 GB there; its one broadcast
  product grows with heads^2 d_model^2 and does not fit this machine's memory past it).

``--rotary N``: Q/K-composition of a rotary model over query - key offsets ``0..N-1`` (the
explorer's window for an N-token text) at the LLaMA-135M head shapes (30 x 9 heads of d_head 64 in
d_model 576, RMS norm, rotary on every dim): ours (``composition_scores(..., offsets=range(N))``:
the window route, ``_window_correct_scores``, where it costs fewer operations) against "each
offset", the Gram route at every offset (what the window route replaced); the left erratum
(computed once for a window) and the right erratum (its offset-free work once per pair,
``_window_erratum_right_scores``) against their per-offset computation.

The load average is printed before and after: on a shared 2-core machine every time scales
with it. ``--smoke``: both tables at ``SMOKE_SHAPE`` (4 rotary offsets), every case in this process: checks
that the script runs end to end (its numbers mean nothing).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peaks import format_peaks, load_average, measure_peaks, measure_peaks_apart

SHAPES = {  # n_layers, n_heads, d_model, d_head
    "GPT-2-small": (12, 12, 768, 64),
    "GPT-2-medium": (24, 16, 1024, 64),
    "GPT-2-large": (36, 20, 1280, 64),
    "GPT-2-XL": (48, 25, 1600, 64),
}


def _weight_view(L: int, H: int, d: int, dh: int, **cfg):
    """A weight view with only what composition reads: ``cfg`` (``ModelConfig`` with ``cfg``'s fields)
    and random ``W_Q, W_K, W_V, W_O`` of ``L`` layers of ``H`` heads, ``d_head`` ``dh`` in ``d_model`` ``d``."""
    import types

    import torch

    from pycircuits_widgets.models.config import ModelConfig

    config = ModelConfig(n_layers=L, n_heads=H, d_model=d, d_head=dh, d_vocab=1, attn_only=True, **cfg)
    g = torch.Generator().manual_seed(0)
    r = lambda *s, std: torch.randn(*s, generator=g) * std
    return types.SimpleNamespace(cfg=config, W_Q=r(L, H, d, dh, std=d ** -0.5), W_K=r(L, H, d, dh, std=d ** -0.5),
                                 W_V=r(L, H, d, dh, std=d ** -0.5), W_O=r(L, H, dh, d, std=dh ** -0.5))


def heads(shape: str):
    """``_weight_view`` at a GPT-2 shape: learned positions, layer norm."""
    return _weight_view(*SHAPES[shape], n_ctx=1024, positional="learned", normalization="layernorm", name=shape)


ROTARY_SHAPE = (30, 9, 576, 64)
"""``--rotary``: the LLaMA-135M head shapes (n_layers, n_heads, d_model, d_head)."""
SMOKE_SHAPE = (2, 2, 64, 16)
"""``--smoke``: the one shape of both tables."""


def rotary_heads():
    """``_weight_view`` at ``ROTARY_SHAPE`` with rotary positions and RMS norm (nothing to centre)."""
    return _weight_view(*ROTARY_SHAPE, n_ctx=2048, positional="rotary", rotary_dim=ROTARY_SHAPE[3],
                        normalization="rmsnorm", name="LLaMA-135M heads")


def flops(shape: str) -> int:
    """FLOPs of the Gram route: tiles and pair products (``gram_flops``) plus, per head and side,
    a float64 ``[r, r]`` Gram, its ``eigh`` (~9 r^3) and the ``[d, r] @ [r, r]`` thin factor."""
    from pycircuits_widgets.analysis.composition import gram_flops
    L, H, d, r = SHAPES[shape]
    return gram_flops(L, H, d, r) + 2 * L * H * (4 * d * r * r + 9 * r ** 3)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---------------------------------------------------------------- operations (run in children)
def op_ours(shape, kind):
    from pycircuits_widgets.analysis import composition_scores
    m = heads(shape)
    return lambda: composition_scores(m, kind, baseline=False)


def op_direct(shape, kind):
    import torch

    from pycircuits_widgets.analysis.composition import _thin_factors
    m = heads(shape)
    L, H = m.cfg.n_layers, m.cfg.n_heads

    def go():
        X, Y, nx, ny = _thin_factors(m, kind, None)
        r = X.shape[-1]
        out = torch.full((L * H, L * H), float("nan"))
        for l1 in range(L - 1):  # all later heads at once, as before the Gram route
            rows = X[l1 * H:(l1 + 1) * H].mT.reshape(H * r, -1)
            cols = Y[(l1 + 1) * H:].permute(1, 0, 2).reshape(X.shape[1], -1)
            block = (rows @ cols).reshape(H, r, -1, r).square().sum((1, 3))
            out[l1 * H:(l1 + 1) * H, (l1 + 1) * H:] = block.double().div(
                nx[l1 * H:(l1 + 1) * H, None] * ny[None, (l1 + 1) * H:]).sqrt().float()
        return out
    return go


def op_tl(shape, kind):
    from transformer_lens.FactoredMatrix import FactoredMatrix as TFM
    from transformer_lens.utilities.matrix import composition_scores as tl_scores

    from pycircuits_widgets.models.folding import center_reading_weights, center_writing_weights
    m = heads(shape)
    W_Q, W_K, W_V = (center_reading_weights(w) for w in (m.W_Q, m.W_K, m.W_V))
    W_O = center_writing_weights(m.W_O)
    left = TFM(W_V, W_O)
    right = {"Q": lambda: TFM(W_Q, W_K.mT), "K": lambda: TFM(W_Q, W_K.mT).T, "V": lambda: left}[kind]
    return lambda: tl_scores(left, right())


def op_window(kind, n_offsets, norm="correct"):
    from pycircuits_widgets.analysis import composition_scores
    m = rotary_heads()
    return lambda: composition_scores(m, kind, baseline=False, norm=norm, offsets=range(n_offsets))


def op_each_offset(kind, n_offsets, norm="correct"):
    import torch

    from pycircuits_widgets.analysis.composition import _correct_scores, _erratum_scores, _model_factors
    m = rotary_heads()
    if norm == "correct":
        return lambda: torch.stack([_correct_scores(m, kind, o) for o in range(n_offsets)])
    return lambda: torch.stack([_erratum_scores(*_model_factors(m, kind, o), norm) for o in range(n_offsets)])


def rotary(n_offsets: int) -> None:
    """The ``--rotary`` table (module docstring)."""
    print(f"head shapes {ROTARY_SHAPE} (n_layers, n_heads, d_model, d_head), rotary, offsets 0..{n_offsets - 1}; {load_average()}")
    print(f"{'kind':<4} {'norm':<13} | {'ours':>9} {'peak+':>9} | {'each offset':>11} {'peak+':>9} | ratio")
    for kind, norm in (("K", "correct"), ("Q", "correct"), ("K", "erratum_left"), ("K", "erratum_right")):
        ours, each = measure("op_window", kind, n_offsets, norm), measure("op_each_offset", kind, n_offsets, norm)
        print(f"{kind:<4} {norm:<13} | {ours['s']:>7.2f} s {ours['mem_mb']:>6.0f} MB | {each['s']:>9.2f} s "
              f"{each['mem_mb']:>6.0f} MB | {each['s'] / ours['s']:.1f}x", flush=True)
    print(f"{load_average()} at the end")


def child(name, args):
    import torch
    fn = globals()[name](*args)
    before = rss_mb()
    t = time.perf_counter()
    with torch.no_grad():
        fn()
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"s": seconds, "mem_mb": max(0.0, peak - before)}))


IN_PROCESS = False
"""``--smoke``: every case runs in this process (its peak memory is then not its own)."""


def measure(name, *args):
    """One case's ``child`` result, from a fresh process (``IN_PROCESS``: from this one)."""
    if IN_PROCESS:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()) as out:
            child(name, args)
        return json.loads(out.getvalue())
    out = subprocess.run([sys.executable, __file__, "--child", name, json.dumps(args)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--direct-xl", action="store_true", help="also time the direct route at XL (~70 s idle)")
    ap.add_argument("--no-tl", action="store_true", help="skip TransformerLens (GPT-2-small, ~8 GB, minutes)")
    ap.add_argument("--rotary", type=int, metavar="N", help="only the rotary table: Q/K over offsets 0..N-1")
    ap.add_argument("--smoke", action="store_true", help=f"both tables at {SMOKE_SHAPE} (n_layers, n_heads, d_model, "
                    "d_head), every case in this process: checks that the script runs end to end")
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], json.loads(a.child[1]))
    global IN_PROCESS, ROTARY_SHAPE
    if a.smoke:
        IN_PROCESS, ROTARY_SHAPE, a.direct_xl = True, SMOKE_SHAPE, True
        SHAPES.clear()
        SHAPES["smoke"] = SMOKE_SHAPE
    if a.rotary:
        return rotary(a.rotary)
    import torch
    print(f"torch {torch.__version__}, transformer-lens 4.3.0, python {platform.python_version()}, "
          f"threads {torch.get_num_threads()}, cpu {platform.processor() or platform.machine()}")
    peaks = measure_peaks(256, repeats=1) if a.smoke else measure_peaks_apart()
    print(f"measured peaks: {format_peaks(peaks)}; {load_average()}")
    print(f"{'shape':<13} {'kind':<4} {'heads':>5} {'route':<8} | {'time':>9} {'peak+':>9} | {'GFLOP':>7} "
          f"{'GFLOP/s':>8} {'% fp32':>6} | vs ours")
    ours = {}

    def line(shape, kind, route, r, gflop=None):
        L, H = SHAPES[shape][:2]
        rate = f"{gflop:>7.0f} {gflop / r['s']:>8.1f} {100 * gflop / r['s'] / peaks['fp32']:>5.0f}%" if gflop else " " * 23
        ratio = f"{r['s'] / ours[shape, kind]:.1f}x slower" if route != "ours" else ""
        print(f"{shape:<13} {kind:<4} {L * H:>5} {route:<8} | {r['s']:>7.2f} s {r['mem_mb']:>6.0f} MB | {rate} | {ratio}",
              flush=True)

    # the headline first (the largest, GPT-2-XL, every kind), then the smaller shapes with their peers
    headline, with_tl = list(SHAPES)[-1], next(iter(SHAPES))  # TL: GPT-2-small's shape only (module docstring)
    for shape, kind in [(headline, k) for k in "KQV"] + [(s, "K") for s in SHAPES if s != headline]:
        r = measure("op_ours", shape, kind)
        ours[shape, kind] = r["s"]
        line(shape, kind, "ours", r, flops(shape) / 1e9)
        if shape != headline or a.direct_xl:
            line(shape, kind, "direct", measure("op_direct", shape, kind))
        if shape == with_tl and not a.no_tl:
            line(shape, kind, "TL", measure("op_tl", shape, kind))
    print(f"{load_average()} at the end")
    if a.smoke:
        rotary(4)


if __name__ == "__main__":
    main()
