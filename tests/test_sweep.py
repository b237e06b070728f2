"""Corpus sweeps on the shipped 2-layer model over 2,000 windows of 32 tokens of the Python stdlib corpus.

Oracles, written here independently of the sweep: every head's top k against brute force (``run_with_cache``
over every window in batches of another size, ``||head_out||`` in float64, a full sort by score then
window then position), with the source each example attends to most; 50 neurons' top k the same way on a
random model with MLPs (activations recomputed in float64 from the residual stream); the corpus head
scores against ``pcw.head_scores`` run one window at a time; the means against the brute-force means.
Scores of two float32 forwards differ in the last bits, so examples are compared within ``chain_tol``
(``tolerance.py``): equal where no other example is that close to the k-th score. The Ray engine and a
killed-then-resumed sweep are compared with the uninterrupted serial store bit for bit: the same windows
in the same batches on one thread, merged in shard order, is the same computation.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.head_scores import head_scores as analysis_head_scores
from pycircuits_widgets.corpus import Corpus, CorpusError, StoreMismatch
from pycircuits_widgets.corpus.windows import PIECE_CHARS
from pycircuits_widgets.models import load_pretrained
from pycircuits_widgets.models.corpus import corpus_documents
from random_models import custom_model
from tolerance import chain_tol, model_forward_length, pattern_tol

ROOT = Path(__file__).resolve().parent.parent
N, T, K = 2000, 32, 20
SETTINGS = {"seq_len": T, "k": K, "max_windows": N, "batch_size": 50, "shard_windows": 250, "progress": False}


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def corpus():
    return Corpus.python_stdlib()


@pytest.fixture(scope="module")
def reference(model, corpus, tmp_path_factory):
    """The uninterrupted serial sweep, on one torch thread (what each Ray worker runs)."""
    with threads(1):
        return pcw.sweep(model, corpus, tmp_path_factory.mktemp("sweeps") / "serial", **SETTINGS)


def brute_force(model, windows: torch.Tensor, neurons: bool = False) -> dict:
    """Every window through ``run_with_cache`` (100 at a time): ``norms [N, L, H, T]`` (float64
    ``||head_out||``), ``head_mag [L, H]`` (the largest ``|| |z| @ |W_O| ||``: what rounding scales with),
    ``patterns``, the mean ``head_out``; with ``neurons``, ``post [N, L, T, d_mlp]`` recomputed in float64
    from the stream the MLP reads and ``neuron_mag [L, d_mlp]``."""
    cfg = model.cfg
    out = {"norms": [], "patterns": [], "post": []}
    head_mag = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)
    neuron_mag = torch.zeros(cfg.n_layers, cfg.d_mlp or 0, dtype=torch.float64)
    head_sum = torch.zeros(cfg.n_layers, cfg.n_heads, cfg.d_model, dtype=torch.float64)
    W_O = model.W_O.double()
    for chunk in windows.split(100):
        _, cache = model.run_with_cache(chunk)
        z = cache.z.double()
        head_out = torch.einsum("blhpe,lhed->blhpd", z, W_O)
        out["norms"].append(head_out.norm(dim=-1))
        head_sum += head_out.sum((0, 3))
        head_mag = torch.maximum(head_mag, (z.abs() @ W_O.abs()).norm(dim=-1).amax((0, 3)))
        out["patterns"].append(cache.patterns)
        if neurons:
            posts = []
            for layer in range(cfg.n_layers):
                x = (cache.resid[:, layer + 1] - cache.mlp_out[:, layer]).double()
                x = x - x.mean(-1, keepdim=True)  # layer norm's centring; its division is the forward's own
                xn = x / cache.ln_scale_mlp[:, layer, :, None].double()
                pre = xn @ model.W_in[layer].double()
                posts.append(torch.nn.functional.gelu(pre))
                neuron_mag[layer] = torch.maximum(neuron_mag[layer], (xn.abs() @ model.W_in[layer].double().abs())
                                                  .amax((0, 1)))
            out["post"].append(torch.stack(posts, 1))
    result = {name: torch.cat(parts) for name, parts in out.items() if parts}
    result.update(head_mag=head_mag, neuron_mag=neuron_mag, head_mean=head_sum / (len(windows) * windows.shape[1]))
    return result


@pytest.fixture(scope="module")
def brute(model, reference):
    return brute_force(model, reference.windows)


def check_top(examples: pd.DataFrame, brute_scores: torch.Tensor, tol: float, where: str) -> None:
    """``examples`` (best first) against ``brute_scores [N, T]`` by a full sort (score descending, then
    window, then position), within ``tol`` per score; equal to the full sort's first k where no other
    score is within rounding of the k-th."""
    w, p, s = examples["window"].to_numpy(), examples["position"].to_numpy(), examples["score"].to_numpy()
    flat = brute_scores.reshape(-1).numpy()
    order = np.lexsort((np.arange(len(flat)), -flat))  # the full sort: score, then (window, position)
    assert len(examples) == K, where
    keys = list(zip(-s.astype(np.float64), w, p))
    assert keys == sorted(keys), f"{where}: not in the total order"
    ours = flat[w * T + p]
    assert np.all(np.abs(s - ours) <= tol), f"{where}: scores off by {np.abs(s - ours).max():.3g} > {tol:.3g}"
    kth = flat[order[K - 1]]
    must = set(np.nonzero(flat > kth + 2 * tol)[0].tolist())
    assert must <= set((w * T + p).tolist()), f"{where}: misses {sorted(must - set((w * T + p).tolist()))}"
    assert np.all(ours >= kth - 2 * tol), f"{where}: holds an example below the k-th score"
    assert np.all(ours[:-1] >= ours[1:] - 2 * tol), f"{where}: ranks out of order"
    if (np.abs(flat - kth) <= 2 * tol).sum() == 1:
        assert (w * T + p).tolist() == order[:K].tolist(), f"{where}: differs from the full sort"


def test_every_heads_examples_are_the_brute_force_top_k(model, reference, brute):
    cfg = model.cfg
    n = model_forward_length(cfg, T)
    ptol = pattern_tol(cfg, T, brute["patterns"])
    for layer in range(cfg.n_layers):
        for head in range(cfg.n_heads):
            df = reference.head_examples(layer, head)
            tol = chain_tol(n, float(brute["head_mag"][layer, head]))
            check_top(df, brute["norms"][:, layer, head], tol, f"L{layer}H{head}")
            rows = brute["patterns"][torch.tensor(df["window"].to_numpy()), layer, head,
                                     torch.tensor(df["position"].to_numpy())]
            attended = rows.gather(-1, torch.tensor(df["source"].to_numpy())[:, None])[:, 0]
            assert torch.all(attended >= rows.amax(-1) - 2 * ptol), f"L{layer}H{head}: source is not the argmax"
            assert torch.allclose(torch.tensor(df["attention"].to_numpy()), attended, atol=2 * ptol, rtol=0)
            assert np.all(df["source"].to_numpy() <= df["position"].to_numpy())  # causal


def role_targets(windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{role: [N, dest, src]}``, written here from the definitions: the previous token (``src = dest - 1``),
    an earlier copy of the destination's token (``src < dest``, same token), the token after an earlier copy
    (``1 <= src <= dest``, ``t[src - 1] = t[dest]``)."""
    N_, T_ = windows.shape
    dest, src = torch.arange(T_)[:, None], torch.arange(T_)[None, :]
    previous = (src == dest - 1).expand(N_, T_, T_)
    duplicate = (windows[:, :, None] == windows[:, None, :]) & (src < dest)
    after = torch.zeros_like(duplicate)
    after[:, :, 1:] = (windows[:, :, None] == windows[:, None, :-1]) & (src[:, 1:] <= dest)
    return {"previous_token": previous, "duplicate_token": duplicate, "induction": after}


def test_every_heads_examples_by_role_are_the_brute_force_top_k(model, reference, brute):
    """``head_examples(by=role)``: the positions with the most attention on the role's targets (float64 sums
    of the brute-force patterns; positions without a target are no example), with the target attended most.
    The mass is a sum of pattern entries over targets, which a softmax perturbation moves by at most twice its
    score error (``4 * pattern_tol``), plus float32 summation over at most ``T`` terms of at most 1."""
    cfg = model.cfg
    ptol = pattern_tol(cfg, T, brute["patterns"])
    tol = 4 * ptol + T * torch.finfo(torch.float32).eps
    windows = reference.windows
    for role, targets in role_targets(windows).items():
        mass = torch.einsum("nlhij,nij->nlhi", brute["patterns"].double(), targets.double())
        mass = mass.masked_fill(~targets.any(-1)[:, None, None], float("-inf"))
        for layer in range(cfg.n_layers):
            for head in range(cfg.n_heads):
                df = reference.head_examples(layer, head, by=role)
                assert role in df.columns and "score" not in df.columns
                check_top(df.rename(columns={role: "score"}), mass[:, layer, head], tol, f"L{layer}H{head} by {role}")
                w, p = torch.tensor(df["window"].to_numpy()), torch.tensor(df["position"].to_numpy())
                src = torch.tensor(df["source"].to_numpy())
                assert targets[w, p, src].all(), f"L{layer}H{head} by {role}: a source that is not a target"
                rows = brute["patterns"][w, layer, head, p].masked_fill(~targets[w, p], -1.0)
                attended = rows.gather(-1, src[:, None])[:, 0]
                assert torch.all(attended >= rows.amax(-1) - 2 * ptol), f"L{layer}H{head} by {role}: not the top target"
    with pytest.raises(ValueError, match="by must be 'norm' or one of 'previous_token'"):
        reference.head_examples(0, 0, by="copying")


def test_ties_rank_by_window_then_position(reference, model):
    """Position 0 attends only to itself, so its ||head_out|| depends on its token alone: windows starting
    with the same token tie exactly, and rank by window."""
    tied = 0
    for layer in range(model.cfg.n_layers):
        for head in range(model.cfg.n_heads):
            df = reference.head_examples(layer, head)
            for _, group in df.groupby("score"):
                if len(group) > 1:
                    tied += 1
                    assert list(zip(group["window"], group["position"])) == sorted(zip(group["window"], group["position"]))
    assert tied > 0


def test_corpus_head_scores_are_head_scores_on_the_same_windows(model, corpus, reference, brute, tmp_path):
    expected = analysis_head_scores(model, reference.windows)
    tol = T * pattern_tol(model.cfg, T, brute["patterns"])
    for name, value in expected.items():
        torch.testing.assert_close(reference.head_scores()[name], value, atol=tol, rtol=0)
    scores_only = pcw.head_scores(model, corpus, seq_len=T, max_windows=500)  # a scores-only sweep, other batches
    for name, value in analysis_head_scores(model, reference.windows[:500]).items():
        torch.testing.assert_close(scores_only[name], value, atol=tol, rtol=0)
    assert reference.head_scores()["induction"].max() > 0.3  # the shipped model's induction heads


def test_head_means_are_the_mean_head_out(model, reference, brute):
    tol = chain_tol(model_forward_length(model.cfg, T), float(brute["head_mag"].max()))
    means = reference.head_means()
    assert means.shape == (2, 8, 128) and means.dtype == torch.float32
    torch.testing.assert_close(means.double(), brute["head_mean"], atol=tol, rtol=0)
    assert reference.neuron_means() is None and reference.neuron_fraction_positive() is None
    # a Sweep is what pcw.ablate(kind="mean") reads its means from
    tokens = reference.windows[:4]
    by_sweep = pcw.ablate(model, tokens, heads=[(1, 6), (0, 2)], kind="mean", means=reference)
    by_table = pcw.ablate(model, tokens, heads=[(1, 6), (0, 2)], kind="mean", means={"heads": means})
    assert torch.equal(by_sweep.loss, by_table.loss) and by_sweep.loss_change > 0


@pytest.fixture(scope="module")
def mlp_model(model):
    """Random weights with GELU MLPs, the shipped tokenizer (to read the corpus)."""
    m = custom_model(dtype=torch.float32, n_layers=2, n_heads=4, d_model=64, d_head=16, d_vocab=1024, n_ctx=T,
                     attn_only=False, d_mlp=128, act_fn="gelu", seed=3)
    m.tokenizer = model.tokenizer
    return m


def test_fifty_neurons_examples_and_every_neurons_statistics_against_brute_force(mlp_model, corpus, tmp_path):
    swept = pcw.sweep(mlp_model, corpus, tmp_path / "mlp", **SETTINGS)
    bf = brute_force(mlp_model, swept.windows, neurons=True)
    n = model_forward_length(mlp_model.cfg, T)
    neurons = np.random.default_rng(0).choice(2 * 128, 50, replace=False)
    for flat in neurons:
        layer, neuron = divmod(int(flat), 128)
        df = swept.neuron_examples(layer, neuron)
        assert list(df.columns) == ["window", "position", "score", "token"]
        check_top(df, bf["post"][:, layer, :, neuron], chain_tol(n, float(bf["neuron_mag"][layer, neuron])),
                  f"neuron L{layer}N{neuron}")
    post = bf["post"]  # [N, L, T, d_mlp]
    tol = chain_tol(n, float(bf["neuron_mag"].max()))
    torch.testing.assert_close(swept.neuron_means().double(), post.mean((0, 2)), atol=tol, rtol=0)
    # a position counts as > 0 in one forward and not the other only within rounding of 0
    near_zero = (post.abs() <= tol).sum((0, 2)) / (N * T)
    diff = (swept.neuron_fraction_positive().double() - (post > 0).double().mean((0, 2))).abs()
    assert torch.all(diff <= near_zero + 1e-7)
    assert swept.neuron_means().shape == (2, 128)
    for layer in range(2):  # heads of a model with MLPs too
        for head in range(4):
            check_top(swept.head_examples(layer, head), bf["norms"][:, layer, head],
                      chain_tol(n, float(bf["head_mag"][layer, head])), f"L{layer}H{head}")


def assert_same_store(a, b) -> None:
    """Bit for bit: windows, example tables, statistics, manifest."""
    assert a.manifest == b.manifest
    assert torch.equal(a.windows, b.windows)
    tables = sorted({p.name for p in a.path.glob("*.parquet")} | {p.name for p in b.path.glob("*.parquet")})
    assert tables and tables == sorted(p.name for p in b.path.glob("*.parquet"))
    for table in tables:
        pd.testing.assert_frame_equal(pd.read_parquet(a.path / table), pd.read_parquet(b.path / table),
                                      check_exact=True)
    sa, sb = load_file(a.path / "stats.safetensors"), load_file(b.path / "stats.safetensors")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


KILLED = """
import os, signal, sys, torch
import pycircuits_widgets as pcw

def kill_after_two(progress):  # the process kills itself, as an interrupt or an OOM kill would
    if progress.shards_done == 2:
        os.kill(os.getpid(), signal.SIGKILL)

torch.set_num_threads(1)
pcw.sweep(pcw.load_pretrained("attn-only-2l"), pcw.Corpus.python_stdlib(), sys.argv[1], seq_len=32, k=20,
          max_windows=2000, batch_size=50, shard_windows=250, progress=kill_after_two)
"""


def test_a_killed_sweep_resumes_to_the_uninterrupted_store(model, corpus, reference, tmp_path):
    path = tmp_path / "killed"
    run = subprocess.run([sys.executable, "-c", KILLED, str(path)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PCW_PROGRESS": "0"}, timeout=600)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["merged_through"] == 1 and manifest["pending"] == [] and not manifest["complete"]
    with pytest.raises(ValueError, match="not finished .2 shards recorded.; run pcw.sweep with the same arguments"):
        pcw.Sweep.open(path)
    # what a kill in the middle of a write leaves: a temporary, a shard file the manifest never named
    (path / "shards" / ".000002.safetensors.123.0a1b2c3d.tmp").write_bytes(b"half a file")
    (path / "shards" / "000002.safetensors").write_bytes(b"not a safetensors file")
    with threads(1):
        resumed = pcw.sweep(model, corpus, path, **SETTINGS)
    assert_same_store(resumed, reference)
    assert sorted(p.name for p in path.iterdir()) == [".lock", "heads.parquet", "heads_by_duplicate_token.parquet",
                                                      "heads_by_induction.parquet", "heads_by_previous_token.parquet",
                                                      "manifest.json", "stats.safetensors", "windows"]


def test_an_interrupted_ray_sweep_resumes_to_the_serial_store(model, corpus, reference, ray_cluster, tmp_path):
    """Ray's 2 workers (one thread each) record shards while the driver raises after the third is kept:
    the shards in flight are lost, the rest resume; the result is the serial store."""

    class Stop(Exception):
        pass

    def stop_after_three(progress):
        if progress.shards_done == 3:
            raise Stop

    path = tmp_path / "ray"
    with pytest.raises(Stop):
        pcw.sweep(model, corpus, path, engine="ray", **{**SETTINGS, "progress": stop_after_three})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["merged_through"] + 1 + len(manifest["pending"]) == 3 and not manifest["complete"]
    resumed = pcw.sweep(model, corpus, path, engine="ray", workers=2, **SETTINGS)
    assert_same_store(resumed, reference)
    assert ray_cluster.is_initialized()  # the session's cluster is left running


def test_two_ray_nodes_with_a_worker_killed_mid_sweep_end_with_the_serial_store(reference, tmp_path):
    """A head and a worker node started with Ray's own commands (separate raylets and object stores), in a
    network namespace holding only the loopback interface (``ray_two_nodes.py``); one actor's process is
    killed after the second shard is kept: the sweep finishes (the shard retried) or says to run it again,
    and the store equals the uninterrupted serial one, bit for bit."""
    path = tmp_path / "two_nodes"
    run = subprocess.run(["unshare", "-n", sys.executable, str(ROOT / "tests" / "ray_two_nodes.py"), str(path)],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PCW_PROGRESS": "0"}, timeout=900)
    assert run.returncode == 0, f"stdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-3000:]}"
    result = json.loads(next(line for line in reversed(run.stdout.splitlines()) if line.startswith('{"nodes"')))
    assert result["nodes"] == [["127.0.0.1", 1.0], ["127.0.0.1", 1.0]] and len(result["killed"]) == 1
    assert result["first_run"] == "finished" or "run the same sweep again" in result["first_run"]
    assert_same_store(pcw.Sweep.open(path), reference)


def test_a_store_made_by_another_sweep_is_refused_naming_what_differs(model, corpus, reference, tmp_path):
    with pytest.raises(StoreMismatch, match=r"settings\.k: 20 in the store, 10 now"):
        pcw.sweep(model, corpus, reference.path, **{**SETTINGS, "k": 10})
    with pytest.raises(StoreMismatch, match=r"made by another sweep \(of model 'attn-only-2l'\): model\.fingerprint: "):
        pcw.sweep(load_pretrained("attn-only-1l"), corpus, reference.path, **SETTINGS)
    with pytest.raises(StoreMismatch, match=r"corpus\.fingerprint"):
        pcw.sweep(model, Corpus.from_texts(["x = 1\n" * 400]), reference.path, **SETTINGS)
    assert pcw.Sweep.open(reference.path).n_windows == N  # still the finished sweep
    again = pcw.sweep(model, corpus, reference.path, **SETTINGS)  # the same call: read back, nothing rerun
    assert_same_store(again, reference)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(StoreMismatch, match="a folder with files and no sweep manifest"):
        pcw.sweep(model, corpus, tmp_path / "other", **SETTINGS)
    with pytest.raises(NotADirectoryError, match="is a file"):
        pcw.sweep(model, corpus, tmp_path / "other" / "notes.txt", **SETTINGS)


def test_the_sweeps_tables_and_its_refusals(model, reference):
    df = reference.head_examples(1, 6)
    assert list(df.columns) == ["window", "position", "score", "source", "attention", "token", "source_token"]
    strings = model.token_strings
    w = reference.windows
    assert df["token"].tolist() == [strings[w[a, b]] for a, b in zip(df["window"], df["position"])]
    assert df["source_token"].tolist() == [strings[w[a, b]] for a, b in zip(df["window"], df["source"])]
    assert reference.windows.shape == (N, T) and reference.n_tokens == N * T and reference.skipped == {"empty": 3}
    assert "2000 windows of 32 tokens, k=20" in repr(reference)
    with pytest.raises(ValueError, match="attention-only: it has no MLP neurons"):
        reference.neuron_examples(0, 0)
    with pytest.raises(ValueError, match=r"layer must be an int in 0\.\.1, got 2"):
        reference.head_examples(2, 0)
    with pytest.raises(ValueError, match=r"head must be an int in 0\.\.7, got 8"):
        reference.head_examples(0, 8)


def test_bad_arguments_are_refused_before_any_work(model, mlp_model, corpus, tmp_path):
    store = tmp_path / "s"
    for kwargs, error, message in (
            ({"engine": "spark"}, ValueError, "engine must be one of"),
            ({"seq_len": 129}, ValueError, "longer than the model's context"),
            ({"batch_size": 3, "shard_windows": 10}, ValueError, "multiple of batch_size"),
            ({"k": 0}, ValueError, "k must be a positive int"),
            ({"workers": 2}, TypeError, "engine options are for engine='ray'")):
        with pytest.raises(error, match=message):
            pcw.sweep(model, corpus, store, **kwargs)
    with pytest.raises(TypeError, match="takes a pcw.Corpus"):
        pcw.sweep(model, ["some text"], store)
    with pytest.raises(TypeError, match="takes a CircuitModel"):
        pcw.sweep("gpt2", corpus, store)
    no_tokenizer = custom_model(dtype=torch.float32)
    no_tokenizer.tokenizer = None
    with pytest.raises(ValueError, match="has no tokenizer"):
        pcw.sweep(no_tokenizer, corpus, store)
    with pytest.raises(CorpusError, match="no window: fewer than seq_len=32 tokens"):
        pcw.sweep(model, Corpus.from_texts(["x = 1\n"]), store, seq_len=32)
    with pytest.raises(TypeError, match="max_windows and store are for a Corpus"):
        pcw.head_scores(model, "some text", max_windows=3)


def test_the_readme_corpus_sweeps_examples_run_as_written(tmp_path, monkeypatch):
    """The section's Python blocks, as a reader pastes them (the multi-node one needs a cluster started
    with ``ray start``: its engine is the one the Ray tests above run)."""
    monkeypatch.chdir(tmp_path)  # the examples' stores and files
    monkeypatch.setenv("PCW_PROGRESS", "0")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Corpus sweeps\n", 1)[1].split("\n## ", 1)[0]
    blocks = [block.split("```", 1)[0] for block in section.split("```python\n")[1:]]
    assert len(blocks) == 3 and "ray.init(address=" in blocks[2]
    first: dict = {}
    with threads(1):
        exec(compile(blocks[0], "README.md (corpus sweeps example)", "exec"), first)
    assert first["sweep"].windows.shape == (512, 128) and first["sweep"].head_examples(1, 6)["score"].is_monotonic_decreasing
    assert first["again"].head_scores()["induction"].equal(first["sweep"].head_scores()["induction"])
    assert set(first["scores"]) == {"previous_token", "duplicate_token", "induction"}
    sources: dict = {}
    exec(compile(blocks[1], "README.md (corpus sources)", "exec"), sources)
    assert sources["lines"].documents == 2 and sources["rows"].documents == 2 and sources["texts"].documents == 2
    assert sources["files"].documents >= 3 and sources["files"].skipped == {}


# -- a store that checks itself (issue 52) ------------------------------------------------------------
SMALL = {"seq_len": 16, "k": 5, "batch_size": 4, "shard_windows": 8, "progress": False}


@pytest.fixture(scope="module")
def small_texts():
    return [doc for doc in corpus_documents("pydoc")[:6] if doc.strip()]


def small_sweep(model, path, texts):
    with threads(1):
        return pcw.sweep(model, Corpus.from_texts(texts), path, max_windows=40, **SMALL)


def edit_manifest(path: Path, edit, redigest: bool = True) -> None:
    """Change the manifest at ``path`` as a hand (or a script) would; ``redigest``: recompute its digest
    too, as a deliberate edit would, so that only the schema and the files' records can catch it."""
    from pycircuits_widgets.corpus.store import _content_digest

    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    if redigest:
        m["digest"] = _content_digest(m)
    (path / "manifest.json").write_text(json.dumps(m))


def flip_byte(file: Path, at: int = -5) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def test_a_flipped_byte_in_any_stored_file_is_refused_naming_it(model, small_texts, tmp_path):
    for name in ("stats.safetensors", "windows/000001.safetensors", "heads.parquet"):
        path = tmp_path / name.replace("/", "_")
        small_sweep(model, path, small_texts)
        flip_byte(path / name)
        with pytest.raises(pcw.StoreCorrupt, match=f"{name} is not the file the sweep wrote .its sha256 differs"):
            s = pcw.Sweep.open(path)
            s.windows
            s.head_examples(0, 0)


def test_an_edited_manifest_is_refused_by_its_digest_and_by_its_schema(model, small_texts, tmp_path):
    path = tmp_path / "s"
    reference = small_sweep(model, path, small_texts)
    assert reference.n_windows == 40 and reference.manifest["shards"] == 5
    original = (path / "manifest.json").read_text()
    cases = [
        (lambda m: m.update(shards=2, windows=16), False, "edited or damaged after the sweep wrote it"),
        # the same edit with its digest redone: the files it still names give it away
        (lambda m: m.update(shards=2, windows=16), True, r"complete must be true only once every shard is merged"),
        (lambda m: m.update(shards=2, windows=16, merged_through=1), True,
         r"files must be the files its progress implies, got .*'unexpected': \['windows/000002"),
        (lambda m: m.update(windows=41), True, r"windows must be in 33\.\.40 for 5 shards of 8 windows"),
        (lambda m: m["settings"].update(seq_len=8), True, "settings.seq_len: 16 sealed, 8 now"),
        (lambda m: m["settings"].update(seq_len="16"), True, "settings.seq_len must be an int >= 1, got '16'"),
        (lambda m: m.update(complete="yes"), True, "complete must be true or false"),
        (lambda m: m["files"].update({"../other/stats.safetensors": m["files"]["stats.safetensors"]}), True,
         "files must be names of the store's layout"),
        (lambda m: m.update(format="pycircuits_widgets.sweep/1"), True, "made by an earlier version"),
    ]
    for edit, redigest, message in cases:
        (path / "manifest.json").write_text(original)
        edit_manifest(path, edit, redigest)
        with pytest.raises((pcw.StoreCorrupt, ValueError), match=message):
            pcw.Sweep.open(path).windows
    (path / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match=r"manifest.json is not a sweep manifest \(not JSON: RecursionError"):
        pcw.Sweep.open(path)


def test_a_manifest_edited_with_its_digest_redone_is_refused_naming_the_field(model, small_texts, tmp_path):
    # a deliberate edit recomputes the manifest's own digest; counts that the schema allows (39 of 40 windows),
    # the model's fingerprint (a sweep then passes for another model's) or k change nothing the schema
    # sees: the finished sweep's content, sealed in its statistics file, gives them away on open
    path = tmp_path / "s"
    small_sweep(model, path, small_texts)
    original = (path / "manifest.json").read_text()
    for edit, field, was, now in (
            (lambda m: m.update(windows=39), "windows", 40, 39),
            (lambda m: m["settings"].update(seq_len=8), "settings.seq_len", 16, 8),
            (lambda m: m["settings"].update(k=4), "settings.k", 5, 4),
            (lambda m: m["model"].update(fingerprint="0" * 64), "model.fingerprint", None, "0" * 64),
            (lambda m: m["info"]["model"].update(n_heads=4), "info.model.n_heads", 8, 4),
            (lambda m: m["tokenization"].update(separator=5), "tokenization.separator", None, 5)):
        (path / "manifest.json").write_text(original)
        edit_manifest(path, edit)
        expected = rf"manifest\.json: {re.escape(field)}: {'.*' if was is None else was} sealed, {now!r} now"
        with pytest.raises(pcw.StoreCorrupt, match=expected):
            pcw.Sweep.open(path)
    (path / "manifest.json").write_text(original)
    assert pcw.Sweep.open(path).n_tokens == 40 * 16


def test_the_same_weights_under_another_name_share_a_store_that_names_no_folder(model, small_texts, tmp_path):
    # from_hf names a model by the folder it was loaded from (an absolute path): the fingerprint hashed it, so
    # a colleague's copy of the same checkpoint, or a model its user renamed, was "another model" to the store,
    # the explorer and mean ablation. The fingerprint is what computes; the store keeps the name's last part
    made = small_sweep(model, tmp_path / "s", small_texts)
    elsewhere = load_pretrained("attn-only-2l")
    elsewhere.cfg.name = "/home/alice/checkpoints/step-1000/"
    assert_same_store(small_sweep(elsewhere, tmp_path / "s", small_texts), made)  # read back, not refused
    made.check_model(elsewhere, "test")
    tokens = model.to_tokens("def f(x):\n    return x + 1\n")
    assert pcw.ablate(elsewhere, tokens, heads=[(1, 6)], kind="mean", means=made).loss.equal(
        pcw.ablate(model, tokens, heads=[(1, 6)], kind="mean", means=made).loss)
    theirs = small_sweep(elsewhere, tmp_path / "t", small_texts)
    assert theirs.model_name == "step-1000" and "alice" not in (tmp_path / "t" / "manifest.json").read_text()
    with pytest.raises(StoreMismatch, match=r"made by another sweep \(of model 'attn-only-2l'\): model\.fingerprint"):
        small_sweep(load_pretrained("attn-only-1l"), tmp_path / "s", small_texts)


class Stop(Exception):
    pass


def stop_after(n: int):
    def progress(p):
        if p.shards_done == n:
            raise Stop
    return progress


def test_a_resume_checks_every_file_and_trusts_no_file_name_as_a_path(model, small_texts, tmp_path):
    other = small_sweep(model, tmp_path / "other", small_texts)
    other_stats = (other.path / "stats.safetensors").read_bytes()
    path = tmp_path / "s"
    with pytest.raises(Stop), threads(1):
        pcw.sweep(model, Corpus.from_texts(small_texts), path, max_windows=40, **{**SMALL, "progress": stop_after(3)})
    original = (path / "manifest.json").read_text()
    assert json.loads(original)["merged"] == "000002.safetensors"
    # another store's file named as this one's merge: refused by name, nothing of the other store touched
    edit_manifest(path, lambda m: m.update(merged="../../other/stats.safetensors"))
    with pytest.raises(pcw.StoreCorrupt, match="merged must be null or a shard file name"):
        small_sweep(model, path, small_texts)
    assert (other.path / "stats.safetensors").read_bytes() == other_stats
    # a damaged window file: refused before the resume builds on it
    (path / "manifest.json").write_text(original)
    flip_byte(path / "windows" / "000001.safetensors")
    with pytest.raises(pcw.StoreCorrupt, match="windows/000001.safetensors is not the file the sweep wrote"):
        small_sweep(model, path, small_texts)
    flip_byte(path / "windows" / "000001.safetensors")  # restored: the resume ends where the whole sweep does
    assert_same_store(small_sweep(model, path, small_texts), other)


def test_a_file_changed_during_a_sweep_leaves_no_shard_of_its_changed_text(model, tmp_path):
    # one document of three tokenisation pieces (windows.PIECE_CHARS) changes at its start after the corpus is
    # scanned: windows are cut from its changed first piece before its end shows the change. None of them may
    # be kept, so the run after the file is restored ends with the store of a sweep that never saw the change
    source = "\n".join(corpus_documents("all")[-200:])
    long_doc = source[:3 * PIECE_CHARS - 1000]
    assert len(long_doc) > 2 * PIECE_CHARS
    files = []
    for i, text in enumerate(["x = 1\n" * 30, long_doc, "def f():\n    return 2\n" * 20]):
        files.append(tmp_path / f"doc{i}.py")
        files[-1].write_text(text)
    settings = {"seq_len": 32, "k": 5, "batch_size": 64, "shard_windows": 128, "progress": False}
    corpus = Corpus.from_files([str(f) for f in files])
    corpus.scan()
    files[1].write_text(long_doc[:5000].replace("e", "E") + long_doc[5000:])
    with pytest.raises(CorpusError, match="doc1.py changed since the corpus was scanned"), threads(1):
        pcw.sweep(model, corpus, tmp_path / "s", **settings)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    kept = manifest["merged_through"] + 1 + len(manifest["pending"])
    first_window_of_doc1 = len(model.tokenizer.encode("x = 1\n" * 30)) // settings["seq_len"]
    assert kept * settings["shard_windows"] <= first_window_of_doc1 + 1  # nothing of the changed document kept
    files[1].write_text(long_doc)
    with threads(1):
        resumed = pcw.sweep(model, corpus, tmp_path / "s", **settings)
        whole = pcw.sweep(model, Corpus.from_files([str(f) for f in files]), tmp_path / "whole", **settings)
    assert resumed.n_windows > 10 * settings["shard_windows"]
    assert_same_store(resumed, whole)


def test_a_store_killed_before_its_first_manifest_is_taken_again(model, small_texts, tmp_path):
    path = tmp_path / "s"
    for part in ("windows", "shards", "merged"):
        (path / part).mkdir(parents=True)
    (path / ".lock").touch()
    (path / ".manifest.json.123.0a1b2c3d.tmp").write_text("{")
    assert small_sweep(model, path, small_texts).n_windows == 40


READ_ONLY = """
import json, sys, torch
import pycircuits_widgets as pcw
from pycircuits_widgets.models.corpus import corpus_documents

torch.set_num_threads(1)
model, texts, out = pcw.load_pretrained("attn-only-2l"), json.loads(sys.argv[2]), {}
for name, k in (("same", 5), ("finished", 6), ("unfinished", 5)):
    try:
        swept = pcw.sweep(model, pcw.Corpus.from_texts(texts), f"{sys.argv[1]}/{name.replace('same', 'finished')}",
                          max_windows=40, seq_len=16, k=k, batch_size=4, shard_windows=8, progress=False)
        out[name] = swept.head_scores()["induction"].tolist()
    except Exception as err:
        out[name] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


def test_a_store_on_read_only_media_reads_back_or_says_why_it_cannot(model, small_texts, tmp_path):
    # on media mounted read-only (a bind mount in a mount namespace of its own: file modes do not stop root)
    # the same call reads its finished store back without writing a lock; another sweep's finished store and
    # an unfinished one were refused by the lock file's own error, not saying what was wrong or what to do
    media = tmp_path / "media"
    reference = small_sweep(model, media / "finished", small_texts)
    with pytest.raises(Stop), threads(1):
        pcw.sweep(model, Corpus.from_texts(small_texts), media / "unfinished", max_windows=40,
                  **{**SMALL, "progress": stop_after(2)})
    for store in ("finished", "unfinished"):
        (media / store / ".lock").unlink()
    script = f"mount --bind {media} {media} && mount -o remount,bind,ro {media} && exec {sys.executable} -c \"$0\" \"$@\""
    run = subprocess.run(["unshare", "-rm", "sh", "-c", script, READ_ONLY, str(media), json.dumps(small_texts)],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PCW_PROGRESS": "0"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["same"] == reference.head_scores()["induction"].tolist()
    assert re.fullmatch(r"StoreMismatch: store .*finished was made by another sweep \(of model 'attn-only-2l'\): "
                        r"settings\.k: 5 in the store, 6 now\. .*", out["finished"]), out["finished"]
    assert re.fullmatch(r"OSError: store .*unfinished cannot be written \(Read-only file system\): an unfinished sweep "
                        r"resumes only in a folder it can write; copy it to one", out["unfinished"]), out["unfinished"]
    assert not (media / "finished" / ".lock").exists() and not (media / "unfinished" / ".lock").exists()


def test_arguments_with_a_unit_or_a_range_are_refused_not_defaulted(model, corpus, tmp_path):
    store = tmp_path / "s"
    for kwargs, error, message in (
            ({"seq_len": 0}, ValueError, "seq_len must be a positive int, got 0"),
            ({"batch_size": 0}, ValueError, "batch_size must be a positive int, got 0"),
            ({"shard_windows": 0}, ValueError, "shard_windows must be a positive int, got 0"),
            ({"scores_only": "no"}, TypeError, "scores_only must be True or False, got 'no'"),
            ({"k": 100_000}, ValueError, "k must be at most 1000 examples per head and neuron, got 100000")):
        with pytest.raises(error, match=message):
            pcw.sweep(model, corpus, store, **kwargs)
    with pytest.raises(ValueError, match="seq_len must be a positive int, got 0"):
        pcw.head_scores(model, corpus, seq_len=0)
    with pytest.raises(TypeError, match=r"progress must be True, False or a callable taking a SweepProgress, got 'yes'"):
        pcw.sweep(model, corpus, store, progress="yes")
    for call in (lambda: pcw.sweep(model, corpus, None), lambda: pcw.Sweep.open(None),
                 lambda: pcw.head_scores(model, corpus, store=3)):
        with pytest.raises(TypeError, match=r"store must be a folder's path \(str or os.PathLike\), got (NoneType|int)"):
            call()
    assert not store.exists()  # refused before the store was made
    # the Ray engine's sizes, before any cluster is started or joined
    from pycircuits_widgets.corpus import ray_engine

    for kwargs, message in (({"workers": 0}, r"workers must be a positive int or None .*got 0"),
                            ({"cpus_per_worker": 0}, "cpus_per_worker must be a positive int, got 0"),
                            ({"num_gpus": -1}, r"num_gpus must be a number >= 0 .*got -1")):
        with pytest.raises(ValueError, match=message):
            next(ray_engine.run(model, {}, iter([]), **kwargs))


ONE_SHARD = """
import resource, sys, torch
sys.path.insert(0, sys.argv[1])
from random_models import custom_model
from pycircuits_widgets.corpus.record import Recorder

torch.set_num_threads(1)
# many neurons, a tiny forward: the shard's memory is its accumulators
model = custom_model(dtype=torch.float32, n_layers=1, n_heads=1, d_model=8, d_head=8, d_vocab=40, n_ctx=4,
                     attn_only=False, d_mlp=16384, act_fn="gelu")
windows = torch.randint(0, 40, (400, 4), generator=torch.Generator().manual_seed(0))
recorder = Recorder(model, 20)
one = sum(t.nbytes for t in recorder.record(windows[:2], 0, 2).tensors().values())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
recorder.record(windows, 0, 2)
print(one, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
"""


def test_a_shards_memory_does_not_grow_with_its_batches():
    # each batch's accumulator was kept until the shard's end (merged once): GPT-2 small's shape, a shard of
    # 128 batches peaked at 7.7 GiB. Merged as each batch ends, a shard holds two accumulators and the merge's
    # working copies (a few accumulators' bytes), whatever its number of batches (here 200)
    run = subprocess.run([sys.executable, "-c", ONE_SHARD, str(ROOT / "tests")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    one, growth = map(int, run.stdout.split())
    assert growth < 20 * one, f"peak RSS grew {growth / 2**20:.0f} MiB over 200 batches of {one / 2**20:.1f} MiB each"


HEAP_KEPT = """
import os, torch
from pycircuits_widgets.corpus.memory import heap_kept

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def kept_after_free():  # resident bytes a touched, freed 16 MiB block leaves behind
    before = resident()
    block = torch.ones(4 << 20)
    del block
    return resident() - before

with heap_kept():
    with heap_kept():  # an inner block's end leaves the outer one's memory kept
        pass
    inside = kept_after_free()
    held = resident()
print(inside, held - resident())
"""


def test_a_shards_freed_memory_is_kept_between_batches_and_handed_back_after():
    # glibc's defaults give a fresh process's 16 MiB block back on free (mapped, then unmapped), so the
    # next batch faults its pages in again (memory.py); kept inside heap_kept, handed back when it ends
    run = subprocess.run([sys.executable, "-c", HEAP_KEPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    inside, released = map(int, run.stdout.split())
    assert inside >= 15 << 20, f"a freed 16 MiB block left {inside / 2**20:.1f} MiB resident inside heap_kept"
    assert released >= 15 << 20, f"heap_kept's end handed back {released / 2**20:.1f} MiB of it"


def test_a_ray_cluster_that_cannot_start_or_be_reached_names_the_serial_engine(monkeypatch):
    # a busy 2-core machine has made Ray's own start-up deadlines expire (issue 52): after its retries the
    # sweep says what else makes the same store
    import ray

    from pycircuits_widgets.corpus import ray_engine

    calls = []

    def init(*args, **kwargs):  # Ray raises a bare Exception for a node that did not start, joining or starting
        calls.append(kwargs)
        raise Exception("The current node timed out during startup")  # noqa: TRY002 (Ray's own)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"did not start in 3 attempts .*engine='serial' makes the same store"):
        ray_engine.start_local_cluster()
    assert len(calls) == 3
    with pytest.raises(RuntimeError, match=r"could not connect to the Ray cluster at '127.0.0.1:1'.*engine='serial'"):
        next(ray_engine.run(None, {}, iter([]), address="127.0.0.1:1"))


def test_the_sweeps_bar_ticks_after_every_batch_and_counts_every_token_once(model, small_texts, tmp_path, monkeypatch):
    """Issue 51: a bar that moved only per shard sat still for a shard's minutes on a large model. The
    serial engine's bar counts each batch's tokens as the batch ends; the shard's end adds nothing twice."""
    from pycircuits_widgets.corpus import sweeps

    ticks = []

    class Bar:
        def update(self, n):
            ticks.append(n)

        def close(self):
            pass

    monkeypatch.setattr(sweeps, "progress_bar", lambda *args, **kwargs: Bar())
    settings = {**SMALL, "progress": True, "max_windows": 16}
    sweep = pcw.sweep(model, Corpus.from_texts(small_texts), tmp_path / "store", **settings)
    per_batch = SMALL["batch_size"] * SMALL["seq_len"]
    assert sum(ticks) == sweep.n_windows * SMALL["seq_len"] == 16 * SMALL["seq_len"]
    assert [t for t in ticks if t] == [per_batch] * (sweep.n_windows // SMALL["batch_size"])
