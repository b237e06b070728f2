"""Effective embeddings (issue 56 item 1): the token representation a layer's heads read.

Oracles, each independent of the code under test:
* ``"mlp0"``: each family's own Hugging Face forward of every token alone (a one-token input; rotary
  positions rotate nothing there): its hidden state after the first layer;
* ``"corpus"``: a brute-force float64 mean, token by token, of the residual stream entering the layer,
  read off a whole forward of every window (``run_with_cache`` without ``layers``), and at layer 0 the
  exact identity ``W_E[t] + mean of W_pos over the positions holding t`` (learned positions).

Tolerances from error models: the HF comparison is ``chain_tol`` of the forward's length at the
stream's magnitude in float32 (the models are float64, but HF's norms compute their statistics in
float32); the means are float64 ``reduction_tol`` over the positions averaged.
"""

import importlib
from pathlib import Path

import pytest
import torch

import pycircuits_widgets as pcw
from family_configs import tiny_model
from pycircuits_widgets.analysis import effective_embedding
from pycircuits_widgets.analysis.circuits import embedding
from pycircuits_widgets.corpus import Corpus
from pycircuits_widgets.models import load_pretrained
from pycircuits_widgets.models.corpus import corpus_documents
from random_models import custom_model
from tolerance import chain_tol, model_forward_length, reduction_tol

SWEEP = {"seq_len": 16, "k": 3, "batch_size": 8, "shard_windows": 16, "max_windows": 48, "progress": False}


def gpt2_like(seed: int):
    """Learned positions, MLPs, layer norm, float64; the shipped tokenizer (to read the corpus)."""
    m = custom_model(n_layers=3, positional="learned", attn_only=False, d_mlp=32, act_fn="gelu", d_vocab=1024,
                     n_ctx=16, seed=seed)
    m.tokenizer = load_pretrained("attn-only-2l").tokenizer
    return m


@pytest.fixture(scope="module")
def learned():
    return gpt2_like(3)


@pytest.fixture(scope="module")
def swept(learned, tmp_path_factory):
    texts = [doc for doc in corpus_documents("pydoc")[:4] if doc.strip()]
    return pcw.sweep(learned, Corpus.from_texts(texts), tmp_path_factory.mktemp("store"), **SWEEP)


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "qwen3"])
def test_mlp0_is_the_familys_own_forward_of_each_token_alone(name):
    hf = tiny_model(name, dtype=torch.float64)
    model = pcw.from_hf(hf, verify=False)
    if model.cfg.positional == "learned":
        pytest.fail(f"{name} has learned positions: mlp0 leaves them out, HF cannot")
    got = effective_embedding(model, 1, "mlp0")
    ids = torch.arange(model.cfg.d_vocab)[:, None]
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True).hidden_states[1][:, 0]
    stream = got.stream
    if model.cfg.normalization == "layernorm":  # the weight view centres what writes the stream (folded layer norm)
        want = want - want.mean(-1, keepdim=True)
        assert (stream.mean(-1).abs() <= reduction_tol(model.cfg.d_model, float(stream.abs().max()), torch.float64)).all()
    # HF's norms compute their statistics in float32 whatever the model's dtype: float32 roundings
    tol = chain_tol(model_forward_length(model.cfg, 1), float(want.abs().max()), torch.float32)
    assert (stream - want).abs().max() <= tol
    assert torch.equal(got.tokens, ids[:, 0]) and got.counts is None
    torch.testing.assert_close(got.vectors, model.layer_read(got.stream)[0], rtol=0, atol=0)


def test_raw_is_the_papers_embedding(learned):
    got = effective_embedding(learned, 2, "raw")
    assert torch.equal(got.vectors, embedding(learned, 2)) and torch.equal(got.stream, learned.W_E)
    assert "exact at layer 0 only" in got.note


@pytest.mark.parametrize("layer", [0, 2])
def test_corpus_is_the_brute_force_mean_stream_entering_the_layer(learned, swept, layer):
    got = effective_embedding(learned, layer, "corpus", sweep=swept)
    windows = swept.windows
    _, cache = learned.run_with_cache(windows, logits=False)
    stream = cache.resid[:, layer].reshape(-1, learned.cfg.d_model)
    flat = windows.reshape(-1)
    assert torch.equal(got.tokens, torch.unique(flat))
    for i, t in enumerate(got.tokens.tolist()):
        rows = stream[flat == t]
        assert int(got.counts[i]) == len(rows)
        tol = reduction_tol(len(rows), float(rows.abs().sum(0).max()) / len(rows), torch.float64, computations=2)
        assert (got.stream[i] - rows.mean(0)).abs().max() <= tol, t
    if layer == 0:  # the exact identity: W_E plus the mean positional contribution of the token's positions
        positions = torch.arange(windows.shape[1]).repeat(windows.shape[0])
        for i, t in enumerate(got.tokens.tolist()):
            want = learned.W_E[t] + learned.W_pos[positions[flat == t]].mean(0)
            tol = reduction_tol(int(got.counts[i]), float(learned.W_pos.abs().max()) + float(learned.W_E[t].abs().max()),
                                torch.float64, computations=2)
            assert (got.stream[i] - want).abs().max() <= tol, t


def test_the_corpus_means_of_several_layers_come_from_one_pass_and_are_kept(learned, swept, monkeypatch):
    """Layers asked together are read in one pass stopped at the last of them (a layer asked alone: one
    pass stopped there), kept after: asked again, no forward; each equals that layer read alone."""
    from pycircuits_widgets.analysis import cache
    from pycircuits_widgets.analysis.effective_embedding import corpus_means, corpus_means_of

    module = importlib.import_module("pycircuits_widgets.analysis.effective_embedding")  # (the package exports
    # the function of the same name)
    cache.clear(learned)
    forwards = []
    real = learned.run_with_cache
    monkeypatch.setattr(learned, "run_with_cache", lambda *a, **k: forwards.append(k.get("layers")) or real(*a, **k))
    batches = -(-swept.n_windows // module.BATCH_WINDOWS)
    one = corpus_means(learned, swept, [1])
    assert forwards == [1] * batches  # stopped at the layer asked
    forwards.clear()
    every = corpus_means(learned, swept, [0, 1, 2])
    assert forwards == [2] * batches  # 0 and 2 in one pass; 1 was kept
    forwards.clear()
    again = corpus_means(learned, swept, [2, 0])
    assert forwards == [] and all(torch.equal(a, b) for a, b in zip(again[2], every[2]))
    for layer in (0, 2):
        alone = corpus_means_of(learned, swept, [layer])[layer]
        assert all(torch.equal(a, b) for a, b in zip(every[layer], alone))
    assert one[1] is every[1]
    monkeypatch.setattr(module, "MEANS_BYTES", 1)  # one layer's sums at a time: a pass each
    cache.clear(learned)
    forwards.clear()
    corpus_means(learned, swept, [1, 2])
    assert forwards == [1] * batches + [2] * batches


def test_min_count_leaves_rare_tokens_out_and_counts_them(learned, swept):
    every = effective_embedding(learned, 1, "corpus", sweep=swept)
    some = effective_embedding(learned, 1, "corpus", sweep=swept, min_count=5)
    assert torch.equal(some.tokens, every.tokens[every.counts >= 5]) and some.left_out == int((every.counts < 5).sum())
    assert some.left_out > 0 and every.left_out == 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"layer": 3, "kind": "raw"}, ValueError, r"effective_embedding: layer must be in 0\.\.2, got 3"),
    ({"layer": 1, "kind": "mean"}, ValueError, "kind must be one of 'raw', 'mlp0', 'corpus', got 'mean'"),
    ({"layer": 0, "kind": "mlp0"}, ValueError, "layer 0's heads read the stream before it"),
    ({"layer": 1, "kind": "corpus"}, ValueError, r"kind='corpus' reads a sweep"),
    ({"layer": 1, "kind": "raw", "min_count": 0}, ValueError, "min_count must be an int >= 1, got 0"),
])
def test_bad_arguments_are_refused_by_name(learned, kwargs, error, match):
    with pytest.raises(error, match=match):
        effective_embedding(learned, **kwargs)


def test_another_models_sweep_is_refused(swept):
    other = gpt2_like(4)
    with pytest.raises(ValueError, match="effective_embedding"):
        effective_embedding(other, 1, "corpus", sweep=swept)


def test_the_readme_example_runs_as_written(learned, swept):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Effective embeddings"):]
    block = section[section.index("```python") + len("```python"):section.index("```\n", section.index("```python") + 9)]
    scope = {"pcw": pcw, "model": learned, "sweep": swept}
    exec(compile(block, "README.md (effective embeddings)", "exec"), scope)
    assert scope["emb"].kind == "corpus" and (scope["emb"].counts >= 3).all()


@pytest.mark.parametrize("kind", ["mlp0", "corpus"])
def test_skip_trigrams_read_through_an_effective_embedding_are_its_dense_circuits(learned, swept, kind):
    """The skip-trigram table of a layer-2 head read through ``kind``: the top triples of the centred
    circuits with the effective vectors in place of ``W_E`` (tokens: the embedding's, outs through
    ``W_U``), written out densely in float64 here."""
    from pycircuits_widgets.analysis import skip_trigrams

    emb = effective_embedding(learned, 2, kind, sweep=swept if kind == "corpus" else None)
    vocab = emb.tokens[::max(1, len(emb.tokens) // 60)]  # (a dense [src, dest, out] of 60 tokens)
    got = skip_trigrams(learned, 2, 1, k=15, approximate=True, vocab=vocab,
                        embedding=emb if kind == "corpus" else "mlp0")
    rows = torch.isin(emb.tokens, vocab)
    E, ids = emb.vectors[rows].double(), emb.tokens[rows]
    QK = E @ learned.W_Q[2, 1].double() @ learned.W_K[2, 1].double().T @ E.T
    OV = E @ learned.W_V[2, 1].double() @ learned.W_O[2, 1].double() @ learned.W_U.double()[:, ids]
    QK, OV = QK - QK.mean(1, keepdim=True), OV - OV.mean(1, keepdim=True)
    score = QK.T.clamp_min(0)[:, :, None] * OV.clamp_min(0)[:, None, :]  # [src, dest, out]
    top = torch.topk(score.flatten(), 15)
    src, rest = top.indices // (len(ids) ** 2), top.indices % (len(ids) ** 2)
    want = list(zip(ids[src].tolist(), ids[rest // len(ids)].tolist(), ids[rest % len(ids)].tolist()))
    # float32 factors of float64 weights: the scores agree to float32's rounding of each chain
    scale = float(top.values.abs().max())
    assert [t.score for t in got] == pytest.approx(top.values.tolist(), abs=chain_tol(4 * learned.cfg.d_model, scale))
    assert {(t.source, t.destination, t.out) for t in got[:5]} == set(want[:5])
    with pytest.raises(ValueError, match="an effective embedding of layer 2 .* for a head of layer 1"):
        skip_trigrams(learned, 1, 0, approximate=True, embedding=emb)
    with pytest.raises(ValueError, match="embedding='corpus' reads a sweep"):
        skip_trigrams(learned, 2, 0, approximate=True, embedding="corpus")
    with pytest.raises(ValueError, match="embedding must be None, 'raw', 'mlp0' or an EffectiveEmbedding, got 'mlp1'"):
        skip_trigrams(learned, 2, 0, approximate=True, embedding="mlp1")
    with pytest.raises(TypeError, match="embedding must be None, 'raw', 'mlp0' or an EffectiveEmbedding, got Tensor"):
        skip_trigrams(learned, 2, 0, approximate=True, embedding=emb.vectors)


@pytest.mark.parametrize("kind", ["mlp0", "corpus"])
def test_eigenvalue_positivity_read_through_an_effective_embedding_is_its_dense_spectrum(learned, swept, kind):
    """Each head of layers 1.. read through ``kind``: the positivity of the dense spectrum of its full circuit
    with the effective vectors in place of ``W_E`` (OV: ``E W_V W_O W_U[:, tokens]``, square over the tokens
    held; QK: ``E W_Q W_K^T E^T``), written out in float64 here; layer 0 as through ``W_E``."""
    from pycircuits_widgets.analysis import eigenvalue_positivity

    sweep = swept if kind == "corpus" else None
    for circuit in ("OV", "QK"):
        got = eigenvalue_positivity(learned, circuit, embedding=kind, sweep=sweep)
        assert torch.equal(got[0], eigenvalue_positivity(learned, circuit)[0])
        for layer in (1, 2):
            emb = effective_embedding(learned, layer, kind, sweep=sweep)
            E = emb.vectors.double()
            for head in range(learned.cfg.n_heads):
                if circuit == "OV":
                    M = E @ learned.W_V[layer, head] @ learned.W_O[layer, head] @ learned.W_U[:, emb.tokens]
                else:
                    M = E @ learned.W_Q[layer, head] @ learned.W_K[layer, head].T @ E.T
                eigs = torch.linalg.eigvals(M)
                want = float(eigs.sum().real / eigs.abs().sum())
                # the result is float32 (its rounding: |want| 2^-24); both routes run in float64, the dense
                # n x n spectrum's n - d_head zero eigenvalues coming out at float64 rounding of |M| each
                tol = abs(want) * 2.0 ** -24 + len(E) * 2.0 ** -50 * float(M.abs().max()) / float(eigs.abs().sum())
                assert abs(float(got[layer, head]) - want) <= tol, (circuit, layer, head)
    with pytest.raises(ValueError, match="embedding must be None, 'raw', 'mlp0' or 'corpus', got 'mlp1'"):
        eigenvalue_positivity(learned, "OV", embedding="mlp1")
