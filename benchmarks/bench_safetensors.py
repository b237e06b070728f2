"""Weight-only analyses of a checkpoint bigger than the work: pcw.from_safetensors against
transformers from_pretrained + pcw.from_hf, on the same files.

    .venv/bin/python benchmarks/bench_safetensors.py [--size tiny|small|llama-1.7b|llama3-8b] [--dir DIR] [--smoke]

Writes a random LLaMA-shaped sharded bf16 checkpoint in ``DIR`` (default
``/tmp/pcw_bench_<size>``; kept, and reused when its config matches: ``config.json``,
``model-0000i-of-0000n.safetensors`` of ~500 MB, ``model.safetensors.index.json``), then runs each
route in its own process (a child's ``ru_maxrss`` would start at a heavy parent's peak):

* ``from_safetensors``: ``pcw.from_safetensors(DIR)``, V-composition (all pairs,
  ``baseline=False``) and OV eigenvalue positivity;
* ``transformers fp32``: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)`` (what the
  analyses compute in), ``pcw.from_hf`` (default: verified by a 16-token probe), the same two
  analyses;
* ``transformers bf16`` (``--bf16-route``): the same loaded in bfloat16 (the analyses widen per use).

Columns (GB = 1e9 bytes): wall time (load + analyses; torch, transformers and this package imported
before the clock starts, in every route), peak RSS (``ru_maxrss``, whole process, imports included)
the peak above the RSS after imports and the peak by the end of V-composition, the checkpoint's size, and whether the scores agree
with the ``from_safetensors`` route's (max |difference| over the defined pairs and heads; fp32
routes must agree to 1e-4). ``tiny`` (``--smoke``: checks that the script runs end to end): 2 layers x
4 heads, d_model 64. ``small``: 4 layers x 8 heads, d_model 256 (seconds). ``llama-1.7b``:
16 layers x 32 heads (GQA 8), d_model 2048, d_mlp 5632, vocab 32000 (1.7 GB). ``llama3-8b``:
Llama-3-8B's shapes (16 GB; the transformers routes need 32+ GB and are skipped on a 24 GB machine
unless ``--all-routes``). The load average is printed with every figure.
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peaks import load_average

SIZES = {  # layers, heads, kv heads, d_model, d_mlp, vocab
    "tiny": (2, 4, 2, 64, 128, 512),
    "small": (4, 8, 2, 256, 688, 4096),
    "llama-1.7b": (16, 32, 8, 2048, 5632, 32000),
    "llama3-8b": (32, 32, 8, 4096, 14336, 128256),
}
SHARD_BYTES = 500 * 2**20
AGREE = 1e-4


def llama_config(size: str):
    from transformers import LlamaConfig
    L, H, kv, d, d_mlp, vocab = SIZES[size]
    return LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=d_mlp, num_hidden_layers=L,
                       num_attention_heads=H, num_key_value_heads=kv, max_position_embeddings=2048,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       dtype="bfloat16")


def tensor_shapes(size: str) -> dict[str, tuple[int, ...]]:
    """The Hugging Face LLaMA checkpoint's keys and shapes."""
    L, H, kv, d, d_mlp, vocab = SIZES[size]
    dh = d // H
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(L):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,),
                       f"{p}.self_attn.q_proj.weight": (H * dh, d), f"{p}.self_attn.k_proj.weight": (kv * dh, d),
                       f"{p}.self_attn.v_proj.weight": (kv * dh, d), f"{p}.self_attn.o_proj.weight": (d, H * dh),
                       f"{p}.mlp.gate_proj.weight": (d_mlp, d), f"{p}.mlp.up_proj.weight": (d_mlp, d),
                       f"{p}.mlp.down_proj.weight": (d, d_mlp)})
    shapes.update({"model.norm.weight": (d,), "lm_head.weight": (vocab, d)})
    return shapes


def write_checkpoint(size: str, folder: Path) -> None:
    """Random bf16 weights (N(0, 0.02); norm scales 1 + N(0, 0.1)) in ~500 MB shards, one shard in memory."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(size)
    groups, current, nbytes = [], [], 0
    for key, shape in shapes.items():
        n = 2 * torch.Size(shape).numel()
        if current and nbytes + n > SHARD_BYTES:
            groups.append(current)
            current, nbytes = [], 0
        current.append(key)
        nbytes += n
    groups.append(current)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for key in keys:
            noise = torch.randn(shapes[key], generator=gen)
            tensors[key] = (1 + 0.1 * noise if key.endswith("norm.weight") else 0.02 * noise).bfloat16()
            weight_map[key] = name
            total += 2 * noise.numel()
        save_file(tensors, folder / name, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    llama_config(size).save_pretrained(folder)  # last: a folder with config.json is complete


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def child(route: str, folder: str, out: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401  (both routes use transformers)

    import pycircuits_widgets as pcw
    import pycircuits_widgets.analysis
    before = rss_gb()
    t = time.perf_counter()
    with torch.no_grad():
        if route == "from_safetensors":
            model = pcw.from_safetensors(folder)
        else:
            dtype = torch.float32 if route == "transformers fp32" else torch.bfloat16
            model = pcw.from_hf(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval())
        loaded = time.perf_counter() - t
        V = pcw.composition_scores(model, "V", baseline=False)
        composed = time.perf_counter() - t - loaded
        peak_V = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        P = pcw.eigenvalue_positivity(model, "OV")
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB
    torch.save({"V": V.float(), "P": P.float()}, out)
    print(json.dumps({"s": seconds, "load_s": loaded, "V_s": composed, "OV_s": seconds - loaded - composed,
                      "peak_gb": peak, "peak_plus_gb": peak - before, "peak_V_gb": peak_V}))


def measure(route: str, folder: Path) -> dict:
    out = folder / f"scores_{route.replace(' ', '_')}.pt"
    res = subprocess.run([sys.executable, __file__, "--child", route, str(folder), str(out)],
                         capture_output=True, text=True)
    if res.returncode:
        return {"error": (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1][:120]}
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "scores": out}


def agreement(a: Path, b: Path) -> str:
    import torch
    x, y = torch.load(a), torch.load(b)
    dv = float((x["V"] - y["V"]).nan_to_num().abs().max())
    dp = float((x["P"] - y["P"]).abs().max())
    same_nan = bool((x["V"].isnan() == y["V"].isnan()).all())
    verdict = "yes" if same_nan and max(dv, dp) <= AGREE else "no"
    return f"{verdict} (V {dv:.1e}, OV {dp:.1e})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=SIZES, default="llama-1.7b")
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--bf16-route", action="store_true", help="also time transformers loading in bfloat16")
    ap.add_argument("--all-routes", action="store_true", help="run the transformers routes at llama3-8b too")
    ap.add_argument("--child", nargs=3)
    ap.add_argument("--smoke", action="store_true", help="--size tiny: checks that the script runs end to end")
    a = ap.parse_args()
    if a.smoke:
        a.size = "tiny"
    if a.child:
        return child(*a.child)
    import safetensors
    import torch
    import transformers
    folder = a.dir or Path(f"/tmp/pcw_bench_{a.size}")
    expected = llama_config(a.size).to_dict()
    config = folder / "config.json"
    if not config.is_file() or any(json.loads(config.read_text()).get(k) != expected[k] for k in
                                   ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", (f"import sys; sys.path[:0] = {sys.path[:2]!r}; import bench_safetensors "
                        f"as b; from pathlib import Path; b.write_checkpoint({a.size!r}, Path({str(folder)!r}))")],
                       check=True)
        print(f"wrote {folder} in {time.perf_counter() - t:.0f} s")
    size_gb = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e9
    L, H, kv, d, d_mlp, vocab = SIZES[a.size]
    print(f"{a.size}: {L} layers x {H} heads (GQA {kv}), d_model {d}, d_mlp {d_mlp}, vocab {vocab}; bf16, "
          f"{len(list(folder.glob('*.safetensors')))} shards, {size_gb:.2f} GB")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, safetensors {safetensors.__version__}, "
          f"python {platform.python_version()}, threads {torch.get_num_threads()}, "
          f"RAM {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB")
    routes = ["from_safetensors", "transformers fp32"] + (["transformers bf16"] if a.bf16_route else [])
    if a.size == "llama3-8b" and not a.all_routes:
        routes = routes[:1]
    print("| route | time (load + V-comp + OV) | peak RSS (above imports; peak by the end of V) | checkpoint | "
          "peak / checkpoint | "
          "scores agree |\n|---|---|---|---|---|---|")
    results = {}
    for route in routes:
        print(f"  ({route}: {load_average()} before)", file=sys.stderr, flush=True)
        r = results[route] = measure(route, folder)
        if "error" in r:
            print(f"| {route} | failed: {r['error']} | | {size_gb:.2f} GB | | |", flush=True)
            continue
        agree = "(reference)" if route == "from_safetensors" else (
            agreement(results["from_safetensors"]["scores"], r["scores"]) if "scores" in results["from_safetensors"]
            else "n/a")
        print(f"| {route} | {r['s']:.1f} s ({r['load_s']:.1f} + {r['V_s']:.1f} + {r['OV_s']:.1f}) | "
              f"{r['peak_gb']:.2f} GB ({r['peak_plus_gb']:.2f} GB; {r['peak_V_gb']:.2f} GB by the end of V) | "
              f"{size_gb:.2f} GB | "
              f"{r['peak_gb'] / size_gb:.2f} | {agree} |", flush=True)
    if all("error" not in results.get(k, {"error": 1}) for k in routes[:2]) and len(routes) > 1:
        ours, hf = results["from_safetensors"], results["transformers fp32"]
        print(f"from_safetensors / transformers fp32: peak {ours['peak_gb'] / hf['peak_gb']:.2f}x, "
              f"time {ours['s'] / hf['s']:.2f}x")
    print(load_average() + " at the end")


if __name__ == "__main__":
    main()
