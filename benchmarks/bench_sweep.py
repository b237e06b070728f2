"""Corpus sweeps: tokens/s of the bare forward, the serial sweep, the Ray sweep and a TransformerLens loop
doing the same work, on the shipped 2-layer model and the shapes of GPT-2-small and SmolLM2-135M; peak
memory; memory and store size as the corpus grows.

    .venv/bin/python benchmarks/bench_sweep.py [--rounds 3] [--big-rounds 1] [--windows 8192] [--big-windows 48]
    .venv/bin/python benchmarks/bench_sweep.py --smoke   # attn-only-2l, 32 windows, no Ray, in this process

Every measurement is a fresh subprocess (its peak RSS is its own), on the same windows of the Python
stdlib corpus (128 tokens, batches of 16 windows; shards of 256 windows, the default, except Ray's on
the big shapes: 16, so that both workers have shards), rounds interleaved, the best of the rounds shown (the
least disturbed: on a shared 2-core host a round's rate moves by up to 30% with the neighbours):

* forward: ``model(batch)`` (logits) over the windows, already tokenised; "sweep's forward" is the
  forward the sweep runs (``run_with_cache(mlp_post=True, logits=False)``, no bookkeeping), with the
  freed memory kept between batches as the sweep keeps it (``corpus.memory.heap_kept``): the sweep's
  ratio to it counts only what the sweep adds, not what the heap saves;
* serial: ``pcw.sweep(model, corpus, store, max_windows=n)`` end to end (tokenising, recording, the
  store written and finished), torch's default threads;
* Ray: the same with ``engine="ray"`` on a local cluster of 2 CPUs started before the clock (2 actors of
  one thread each; their start, the weights' transfer and the package shipping are timed). "steady"
  compares the rates from the end of the first wave of shards (one per worker) to the last shard: the
  engines' start left out;
* TransformerLens loop: TransformerLens 4.3 ``TransformerBridge.run_with_cache`` over the same batches
  (only the hooks read: z, pattern, MLP post), ``head_out = z W_O`` per layer and its norms,
  ``torch.topk`` merges of every head's and neuron's running top k, the source attended most at the
  kept examples, the head scores' target masses and the mean sums: the sweep's work, written the
  obvious way. The attn-only-2l row's TransformerLens model is a TL-native model of the same shape
  (TL has no Shortformer positions); a big shape's is the TL-native model both sides read
  (``pcw.from_transformer_lens`` of it). "TL forward" is that model's ``run_with_cache`` alone over the
  same batches (the same hooks read, nothing done with them): the peer's floor, which bounds what any
  recording could gain on it (serial / TL <= sweep's forward / TL forward).

The serial and Ray cases import pyarrow (and, through it, pandas: about 0.5 s, once per process) before
the clock, as every case imports torch before it: a sweep's rate, not a process's start.

Then serial sweeps of 2,048 and 20,480 windows (attn-only-2l, ``--rss-windows``): the peak RSS's growth
at 10x the corpus and the store's size per million tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

SEQ, BATCH, K = 128, 16, 20
BIG = {  # TL-native configs of the big shapes (random weights: the rates depend on the shape alone)
    "GPT-2-small shape": {"d_model": 768, "d_head": 64, "n_layers": 12, "n_heads": 12, "n_ctx": 1024, "d_vocab": 50257,
                          "act_fn": "gelu_new", "normalization_type": "LN"},
    "SmolLM2-135M shape": {"d_model": 576, "d_head": 64, "n_layers": 30, "n_heads": 9, "n_key_value_heads": 3,
                           "d_mlp": 1536, "n_ctx": 2048, "d_vocab": 49152, "act_fn": "silu", "gated_mlp": True,
                           "normalization_type": "RMS", "positional_embedding_type": "rotary", "rotary_base": 100000},
}
# windows per shard: the default (None: 256 at 128 tokens) but for Ray on the big shapes, whose few windows would be one
# shard and one busy worker. (A serial shard of one batch would pay a shard's fixed costs, its store files and
# its memory handed back, at every batch: not a sweep anyone runs.)
RAY_SHARD = dict.fromkeys(BIG, 16)
TINY = {"d_model": 128, "d_head": 16, "n_layers": 2, "n_heads": 8, "n_ctx": 128, "d_vocab": 1024, "attn_only": True,
        "normalization_type": "LN"}


# --- one measurement (a subprocess) -------------------------------------------------------------------
def tl_bridge(shape: dict):
    from transformer_lens import TransformerBridge
    from transformer_lens.config import TransformerBridgeConfig

    return TransformerBridge.boot_native(TransformerBridgeConfig(**shape, seed=0))


def our_model(name: str):
    import pycircuits_widgets as pcw

    shipped = pcw.load_pretrained("attn-only-2l")
    if name == "attn-only-2l":
        return shipped
    bridge = tl_bridge(BIG[name])
    model = pcw.from_transformer_lens(bridge)
    model.tokenizer = ShippedIds(shipped.tokenizer)
    return model


class ShippedIds:
    """The shipped tokenizer read as a big shape's (its ids, < 1024, are valid ids of either): the
    same windows of the same corpus for every model; ids past it display as ``<id N>``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.end_of_text_id = tokenizer.end_of_text_id
        self.encode, self.fingerprint = tokenizer.encode, tokenizer.fingerprint

    def display_token(self, token_id: int) -> str:
        return self.tokenizer.display_token(token_id) if token_id < self.tokenizer.vocab_size else f"<id {token_id}>"


def windows_of(tokenizer, n: int):
    import torch

    from pycircuits_widgets.corpus import Corpus
    from pycircuits_widgets.corpus.windows import window_blocks

    blocks = window_blocks(Corpus.python_stdlib(), tokenizer, SEQ, n, stop=n)
    return torch.from_numpy(next(iter(blocks)))


TL_HOOKS = ("attn.hook_z", "attn.hook_pattern", "mlp.hook_post")


def tl_forward(bridge, windows) -> None:
    """TransformerLens's ``run_with_cache`` over the batches, the hooks ``tl_loop`` reads kept, nothing
    done with them (module docstring)."""
    import torch

    with torch.no_grad():
        for batch in windows.split(BATCH):
            bridge.run_with_cache(batch, names_filter=lambda n: n.endswith(TL_HOOKS))


def tl_loop(bridge, windows, k: int) -> None:
    """The sweep's work through TransformerLens hooks (module docstring)."""
    import torch

    from pycircuits_widgets.analysis.head_scores import target_masks

    cfg = bridge.cfg
    L, H = cfg.n_layers, cfg.n_heads
    mlp = not cfg.attn_only
    d_mlp = cfg.d_mlp if mlp else 0
    W_O = bridge.W_O.detach()  # [L, H, d_head, d_model]
    head_top = (torch.full((L, H, k), -torch.inf), torch.zeros(L, H, k, dtype=torch.long))
    head_src = torch.zeros(L, H, k, dtype=torch.long), torch.zeros(L, H, k)
    neuron_top = (torch.full((L, d_mlp, k), -torch.inf), torch.zeros(L, d_mlp, k, dtype=torch.long))
    mass = torch.zeros(3, L, H, dtype=torch.float64)
    head_sum = torch.zeros(L, H, cfg.d_model, dtype=torch.float64)
    neuron_sum = torch.zeros(L, d_mlp, dtype=torch.float64)
    positive = torch.zeros(L, d_mlp, dtype=torch.long)
    with torch.no_grad():
        for start in range(0, len(windows), BATCH):
            x = windows[start:start + BATCH]
            b, T = x.shape
            _, cache = bridge.run_with_cache(x, names_filter=lambda n: n.endswith(TL_HOOKS))
            masks = torch.stack(list(target_masks(x).values()), 1).float()  # [b, 3, T, T]
            offset = start * T
            for layer in range(L):
                z = cache[f"blocks.{layer}.attn.hook_z"]  # [b, T, H, d_head]
                pattern = cache[f"blocks.{layer}.attn.hook_pattern"]  # [b, H, T, T]
                head_out = torch.einsum("bthe,hed->bthd", z, W_O[layer])
                head_sum[layer] += head_out.sum((0, 1)).double()
                norms = head_out.norm(dim=-1).permute(2, 0, 1).reshape(H, b * T)
                values = torch.cat([head_top[0][layer], norms], -1)
                ids = torch.cat([head_top[1][layer], torch.arange(b * T).expand(H, -1) + offset], -1)
                top = values.topk(k, dim=-1)
                head_top[0][layer], head_top[1][layer] = top.values, ids.gather(-1, top.indices)
                fresh = top.indices >= k  # kept examples from this batch: their source attended most
                local = head_top[1][layer] - offset
                rows = pattern[local.clamp(0, b * T - 1) // T, torch.arange(H)[:, None], local.clamp(0, b * T - 1) % T]
                att, src = rows.max(-1)
                head_src[0][layer] = torch.where(fresh, src, head_src[0][layer])
                head_src[1][layer] = torch.where(fresh, att, head_src[1][layer])
                mass[:, layer] += torch.einsum("bhij,bsij->sh", pattern, masks).double()
                if mlp:
                    post = cache[f"blocks.{layer}.mlp.hook_post"].reshape(b * T, d_mlp).T  # [d_mlp, b T]
                    neuron_sum[layer] += post.sum(-1).double()
                    positive[layer] += (post > 0).sum(-1)
                    values = torch.cat([neuron_top[0][layer], post], -1)
                    ids = torch.cat([neuron_top[1][layer], torch.arange(b * T).expand(d_mlp, -1) + offset], -1)
                    top = values.topk(k, dim=-1)
                    neuron_top[0][layer], neuron_top[1][layer] = top.values, ids.gather(-1, top.indices)


def measure(case: str, name: str, n: int) -> dict:
    """Run one case; seconds timed, tokens, peak RSS (MiB), store bytes."""
    import torch

    import pycircuits_widgets as pcw
    from pycircuits_widgets.corpus import Corpus

    out = {"tokens": n * SEQ, "threads": torch.get_num_threads()}
    if case in ("tl", "tl_forward"):
        bridge = tl_bridge(TINY if name == "attn-only-2l" else BIG[name])
        windows = windows_of(pcw.load_pretrained("attn-only-2l").tokenizer, n)
        start = time.perf_counter()
        if case == "tl":
            tl_loop(bridge, windows, K)
        else:
            tl_forward(bridge, windows)
        out["seconds"] = time.perf_counter() - start
    elif case == "forward":
        model = our_model(name)
        windows = windows_of(model.tokenizer, n)
        with torch.no_grad():
            start = time.perf_counter()
            for batch in windows.split(BATCH):
                model(batch)
            out["seconds"] = time.perf_counter() - start
    elif case == "sweep_forward":
        from pycircuits_widgets.corpus.memory import heap_kept

        model = our_model(name)
        windows = windows_of(model.tokenizer, n)
        with torch.no_grad(), heap_kept():
            start = time.perf_counter()
            for batch in windows.split(BATCH):
                model.run_with_cache(batch, mlp_post=not model.cfg.attn_only, logits=False)
            out["seconds"] = time.perf_counter() - start
    else:
        # their first import is a process's cost, not the sweep's (module docstring); pyarrow's tables import pandas
        import pandas  # noqa: F401
        import pyarrow  # noqa: F401

        model = our_model(name)
        corpus = Corpus.python_stdlib()
        corpus.scan()  # the corpus's first read (a few seconds) is the same for every engine: not timed
        options = {}
        if case == "ray":
            from pycircuits_widgets.corpus.ray_engine import start_local_cluster

            start_local_cluster(num_cpus=2)
            options = {"engine": "ray", "workers": 2}
        marks = []  # (seconds, tokens recorded) after each shard: the steady rate, past the engine's start

        def mark(p):
            marks.append((time.perf_counter() - start, p.tokens_done))

        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            pcw.sweep(model, corpus, pathlib.Path(tmp) / "s", seq_len=SEQ, k=K, max_windows=n, batch_size=BATCH,
                      shard_windows=RAY_SHARD.get(name) if case == "ray" else None, progress=mark, **options)
            out["seconds"] = time.perf_counter() - start
            out["store_bytes"] = sum(p.stat().st_size for p in pathlib.Path(tmp).rglob("*") if p.is_file())
        # shards finish in waves, one per worker each: the rate from the end of the first wave to the last shard
        workers = 2 if case == "ray" else 1
        (t0, n0), (t1, n1) = marks[min(workers, len(marks)) - 1], marks[-1]
        out["steady"] = (n1 - n0) / (t1 - t0) if t1 > t0 else None
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


# --- the run ------------------------------------------------------------------------------------------
IN_PROCESS = False
"""``--smoke``: every case runs in this process (its peak RSS is then not its own)."""


def run_case(case: str, name: str, n: int) -> dict:
    if IN_PROCESS:
        return measure(case, name, n)
    env = {**os.environ, "PCW_PROGRESS": "0", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, "--case", case, "--model", name, "--windows", str(n)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"{case} {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = ("forward", "sweep_forward", "serial", "ray", "tl", "tl_forward")


def main(rounds: int, big_rounds: int, windows: int, big_windows: int, rss_windows: int, save: str,
         cases: tuple[str, ...] = CASES) -> None:
    loads = [os.getloadavg()[0]]
    rows = {}
    for name, n, r in (("attn-only-2l", windows, rounds), *((big, big_windows, big_rounds) for big in BIG)):
        if r == 0:
            continue
        results = {case: [] for case in cases}
        for _ in range(r):
            for case in cases:
                results[case].append(run_case(case, name, n))
                print(f"{name} {case}: {results[case][-1]}", file=sys.stderr, flush=True)
        rows[name] = results
    loads.append(os.getloadavg()[0])
    small = run_case("serial", "attn-only-2l", rss_windows)
    big = run_case("serial", "attn-only-2l", 10 * rss_windows)
    loads.append(os.getloadavg()[0])
    measured = {"rows": rows, "small": small, "big": big, "loads": loads, "rounds": [rounds, big_rounds]}
    pathlib.Path(save).write_text(json.dumps(measured))
    report(measured)


def report(measured: dict) -> None:
    """The tables of one run's measurements (``--report FILE`` prints a saved run again)."""
    from importlib.metadata import version

    import torch

    rows, small, big, loads, (rounds, big_rounds) = (measured[k] for k in ("rows", "small", "big", "loads",
                                                                             "rounds"))

    def rate(res, key=None):  # the best round's; nan for a case not run (--smoke: Ray)
        return max(x[key] if key else x["tokens"] / x["seconds"] for x in res) if res else float("nan")

    def rss(res):
        return max(x["peak_rss_mib"] for x in res) if res else float("nan")

    print(f"torch {torch.__version__} ({rows['attn-only-2l']['forward'][0]['threads']} threads), ray {version('ray')}, "
          f"transformer-lens {version('transformer-lens')}; {os.cpu_count()} CPUs; load average at the start / after "
          f"the table's runs / at the end: {' / '.join(f'{x:.2f}' for x in loads)}; windows of {SEQ} tokens, batches "
          f"of {BATCH}, k={K}; the best of {rounds} rounds (big shapes: {big_rounds})")
    print("\n| model | windows | forward tok/s | sweep's forward | sweep serial | sweep Ray (2 x 1 thread) | "
          "TransformerLens loop | TL forward | serial / forward | serial / sweep's forward | serial / TL | "
          "sweep's forward / TL forward | Ray / serial (end to end; steady) | "
          "peak RSS forward / serial / Ray driver / TL (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, res in rows.items():
        res = {case: res.get(case, []) for case in CASES}
        f, sf, s, ry, tl, tlf = (rate(res[c]) for c in CASES)
        steady = (f"{rate(res['ray'], 'steady') / rate(res['serial'], 'steady'):.2f}"
                  if res["ray"] and all(x["steady"] for x in res["ray"] + res["serial"]) else "-")
        print(f"| {name} | {res['forward'][0]['tokens'] // SEQ} | {f:,.0f} | {sf:,.0f} | {s:,.0f} | {ry:,.0f} | "
              f"{tl:,.0f} | {tlf:,.0f} | {s / f:.2f} | {s / sf:.2f} | {s / tl:.2f} | {sf / tlf:.2f} | {ry / s:.2f}; {steady} | "
              f"{rss(res['forward']):.0f} / {rss(res['serial']):.0f} / {rss(res['ray']):.0f} / {rss(res['tl']):.0f} |")
    growth = big["peak_rss_mib"] / small["peak_rss_mib"] - 1
    per_token = (big["store_bytes"] - small["store_bytes"]) / (big["tokens"] - small["tokens"])
    fixed = small["store_bytes"] - per_token * small["tokens"]
    print(f"\nattn-only-2l serial, {small['tokens'] // SEQ} -> {big['tokens'] // SEQ} windows: peak RSS "
          f"{small['peak_rss_mib']:.0f} -> {big['peak_rss_mib']:.0f} MiB ({growth:+.1%}); "
          f"{small['tokens'] / small['seconds']:,.0f} -> {big['tokens'] / big['seconds']:,.0f} tok/s")
    print(f"store: {per_token * 1e6 / 2**20:.2f} MiB per million tokens (the windows) + {fixed / 2**20:.2f} MiB "
          f"(examples and statistics, whatever the corpus's size) for attn-only-2l at k={K}")
    for name in BIG:
        if name in rows:
            serial = rows[name]["serial"][0]
            print(f"{name}, {serial['tokens']} tokens: store {serial['store_bytes'] / 2**20:.1f} MiB "
                  "(mostly its neurons' examples, whatever the corpus's size)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-rounds", type=int, default=1, help="rounds of each big shape")
    parser.add_argument("--windows", type=int, default=8192, help="attn-only-2l windows")
    parser.add_argument("--big-windows", type=int, default=48, help="windows of each big shape")
    parser.add_argument("--rss-windows", type=int, default=2048, help="attn-only-2l windows, then 10 times as many")
    parser.add_argument("--save", default=os.path.join(tempfile.gettempdir(), "bench_sweep.json"),
                        help="where the measurements are written (JSON)")
    parser.add_argument("--report", metavar="FILE", help="print the tables of a saved run")
    parser.add_argument("--smoke", action="store_true", help="attn-only-2l only, 32 windows (16 and 160 for the "
                        "memory growth), one round, every case but Ray's (its cluster's start alone outlasts the rest; "
                        "tests/test_sweep.py runs that route) in this process: checks that the script runs end to end")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        IN_PROCESS = True
        os.environ["PCW_PROGRESS"] = "0"
        args.rounds, args.big_rounds, args.windows, args.rss_windows = 1, 0, 32, 16
    if args.case:
        print(json.dumps(measure(args.case, args.model, args.windows)))
    elif args.report:
        report(json.loads(pathlib.Path(args.report).read_text()))
    else:
        main(args.rounds, args.big_rounds, args.windows, args.big_windows, args.rss_windows, args.save,
             tuple(c for c in CASES if c != "ray") if args.smoke else CASES)
