"""pcw.from_safetensors: a checkpoint folder read layer by layer equals from_hf's weight view of the
same model (from_hf is verified against each family's own forward), for sharded float32 and bf16
checkpoints written here by save_pretrained; the weight-only analyses agree to float rounding,
read no MLP weight, and what needs a forward or a whole stack says so.

Tolerances: both loaders fold the same float32 values with the same code, so their weights differ only
where a sum over ``d_model`` may be ordered differently (``fold_tol``). The analyses are compared on
float64 views of both (what they check, the reading path, does not depend on the precision): there
fixed float64 margins stand far above float64 rounding (the same code on weights a few float64 ulps
apart, ~1e-13 relative). Forwards within ``logit_tol``.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import pycircuits_widgets as pcw
from family_configs import tiny_model
from pycircuits_widgets.models.adapters import checkpoint_model
from pycircuits_widgets.models.adapters.checkpoint_model import NeedsModel
from tolerance import assert_within, logit_tol, reduction_tol

# llama: GQA, rotary, biases; gpt2: Conv1D, learned positions, layer norm, tied embeddings;
# gpt_neox: fused per-head QKV, a checkpoint name transformers renames (embed_out -> lm_head);
# gptj: interleaved rotary; granite: multipliers folded into the weights
FAMILIES = ("llama", "gpt2", "gpt_neox", "gptj", "granite")
FLOAT64 = {"rtol": 1e-10, "atol": 1e-12}
"""Float64 views of the same weights: the same analysis code, a few float64 ulps apart at most."""
COPIES = {"rtol": torch.finfo(torch.float32).eps, "atol": 1e-12}
"""Positivities come back in float32: two such float64 values, each rounded once, lie a float32 ulp apart at most."""


def fold_tol(hf, name: str) -> float:
    """Bound on two float32 folds of the same raw weights (ours from the shards, from_hf's from the module):
    they differ only where a sum over ``d_model`` may be ordered differently, a centring's mean (a layer
    norm's readers and writers) or a norm's bias times a reader (a bias): ``reduction_tol`` of its
    ``d_model + 2`` roundings (the sum, the division, the subtraction), each side, of terms at most
    ``largest^2`` (a norm scale or bias times a weight; ``largest`` the largest raw parameter), or for
    a bias ``d_model`` of them."""
    largest = max(float(p.detach().abs().max()) for p in hf.parameters())
    d = hf.config.hidden_size
    return reduction_tol(d + 2, largest ** 2 * (d if name.startswith("b_") else 1), computations=2)


def save(tmp_path, name: str, dtype=torch.float32, mutate=None):
    """``(folder, hf model)``: the tiny model of ``name`` saved in at least two shards."""
    hf = tiny_model(name).to(dtype)
    if mutate is not None:
        with torch.no_grad():
            mutate(hf)
    folder = tmp_path / name
    hf.save_pretrained(folder, safe_serialization=True, max_shard_size="60KB")
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(folder.glob("model-*.safetensors"))) >= 2
    return folder, hf


def record_reads(model) -> list[str]:
    """The names of the tensors ``model`` reads from its shards from now on."""
    keys, read = [], model.files.read

    def recording(key, rows=None):
        keys.append(key)
        return read(key, rows)

    model.files.read = recording
    return keys


@pytest.fixture(params=FAMILIES)
def saved(request, tmp_path):
    return save(tmp_path, request.param)


@pytest.fixture
def pair(saved):
    """Float64 views of the checkpoint and of the model: the analyses are compared there."""
    folder, hf = saved
    return pcw.from_safetensors(folder, dtype=torch.float64), pcw.from_hf(hf.double())


def test_weights_equal_from_hf_layer_by_layer(saved):
    folder, hf = saved
    ours, ref = pcw.from_safetensors(folder), pcw.from_hf(hf)
    assert ours.cfg.n_layers == ref.cfg.n_layers and ours.dtype == torch.float32
    assert ours.metadata["notes"][1:] == ref.metadata["notes"]
    for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_V", "b_O", "W_in", "W_out"):
        expected = getattr(ref, name)
        assert (getattr(ours, name) is None) == (expected is None), name
        if expected is not None:
            for layer in range(ref.cfg.n_layers):
                assert_within(getattr(ours, name)[layer], expected[layer], fold_tol(hf, name))
    for name in ("W_E", "W_U", "W_pos", "b_U"):
        expected = getattr(ref, name)
        if expected is None:
            assert getattr(ours, name) is None, name
        else:
            assert_within(getattr(ours, name), expected, fold_tol(hf, name))


def test_weight_only_analyses_equal_from_hf_and_read_no_mlp(pair):
    ours, ref = pair
    reads = record_reads(ours)
    rotary = ref.cfg.positional == "rotary"
    offsets = [0, 3] if rotary else None
    for kind in "QKV":
        got = pcw.composition_scores(ours, kind, offsets=None if kind == "V" else offsets)
        want = pcw.composition_scores(ref, kind, offsets=None if kind == "V" else offsets)
        torch.testing.assert_close(got, want, equal_nan=True, **FLOAT64)
    for kind in ("OV",) if rotary else ("OV", "QK"):
        positivities = (pcw.eigenvalue_positivity(m, kind) for m in (ours, ref))
        torch.testing.assert_close(*positivities, **COPIES)
    got = pcw.analysis.composition_detail(ours, "V", (0, 1), (1, 2))
    want = pcw.analysis.composition_detail(ref, "V", (0, 1), (1, 2))
    assert got.score == pytest.approx(want.score, rel=FLOAT64["rtol"])
    torch.testing.assert_close(got.singular_values, want.singular_values, **FLOAT64)
    got, want = (pcw.analysis.top_virtual_heads(m, k=5) for m in (ours, ref))
    assert [(v.h1, v.h2) for v in got] == [(v.h1, v.h2) for v in want]
    assert [v.norm for v in got] == pytest.approx([v.norm for v in want], rel=FLOAT64["rtol"])
    if not rotary:
        got, want = (pcw.skip_trigrams(m, 1, 2, k=10, approximate=True) for m in (ours, ref))
        assert [(t.source, t.destination, t.out) for t in got] == [(t.source, t.destination, t.out) for t in want]
    assert reads and not [key for key in reads if any(part in key.split(".") for part in
                                                       ("mlp", "fc_in", "fc_out", "fc1", "fc2"))]


def test_circuits_of_every_head_equal_from_hf(pair):
    ours, ref = pair
    torch.testing.assert_close(ours.OV.AB, ref.OV.AB, **FLOAT64)
    torch.testing.assert_close(ours.QK.AB, ref.QK.AB, **FLOAT64)
    torch.testing.assert_close(pcw.analysis.ov(ours, 1, 3).AB, pcw.analysis.ov(ref, 1, 3).AB, **FLOAT64)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_vocabulary_read_in_blocks_gives_the_same_circuits(tmp_path, monkeypatch, name):
    folder, hf = save(tmp_path, name)
    monkeypatch.setattr(checkpoint_model, "VOCAB_BLOCK", 50)  # 128 tokens: blocks of 50, 50 and 28
    # float64 views: the blocks' sums are ordered otherwise than the whole vocabulary's
    ours, ref = pcw.from_safetensors(folder, dtype=torch.float64), pcw.from_hf(hf.double())
    assert [(b.start, b.stop) for b in ours.vocab_blocks()] == [(0, 50), (50, 100), (100, 128)]
    torch.testing.assert_close(ours.token_rows("W_U", slice(50, 100)), ref.W_U[:, 50:100], **FLOAT64)
    for kind in ("OV",) if ref.cfg.positional == "rotary" else ("OV", "QK"):
        for layer in (None, 0):
            torch.testing.assert_close(pcw.analysis.eigen.token_gram(ours, kind, layer),
                                       pcw.analysis.eigen.token_gram(ref, kind, layer), **FLOAT64)
        positivities = (pcw.eigenvalue_positivity(m, kind) for m in (ours, ref))
        torch.testing.assert_close(*positivities, **COPIES)


def test_bf16_checkpoint_is_read_as_float32_exactly(tmp_path):
    folder, _ = save(tmp_path, "llama", dtype=torch.bfloat16)
    ours = pcw.from_safetensors(folder)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = pcw.from_hf(loaded)
    assert ours.W_V[1].dtype == torch.float32 and ours.W_E.dtype == torch.float32
    for name in ("W_E", "W_U"):  # bf16 values widen exactly; the folds round as fold_tol allows
        assert_within(getattr(ours, name), getattr(ref, name), fold_tol(loaded, name))
    for layer in range(ref.cfg.n_layers):
        assert_within(ours.W_V[layer], ref.W_V[layer], fold_tol(loaded, "W_V"))
    ours, ref = pcw.from_safetensors(folder, dtype=torch.float64), pcw.from_hf(loaded.double())
    torch.testing.assert_close(pcw.composition_scores(ours, "V"), pcw.composition_scores(ref, "V"),
                               equal_nan=True, **FLOAT64)
    torch.testing.assert_close(pcw.eigenvalue_positivity(ours), pcw.eigenvalue_positivity(ref), **COPIES)


def test_float64_view_matches_a_float64_model(tmp_path):
    folder, hf = save(tmp_path, "gpt2")
    ours = pcw.from_safetensors(folder, dtype=torch.float64)
    ref = pcw.from_hf(hf.double())
    assert ours.to(torch.float32).W_V[0].dtype == torch.float32
    torch.testing.assert_close(pcw.eigenvalue_positivity(ours, "QK"), pcw.eigenvalue_positivity(ref, "QK"), **COPIES)


def test_the_folders_own_tokenizer_is_loaded(tmp_path):
    folder, hf = save(tmp_path, "gpt2")
    words = ["<unk>"] + [f"w{i}" for i in range(hf.config.vocab_size - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    ours = pcw.from_safetensors(folder)
    assert ours.to_tokens("w3 w7 w3").tolist() == [4, 8, 4]
    got = pcw.skip_trigrams(ours, 0, 1, k=5, approximate=True)
    assert [(t.source_str, t.out_str) for t in got] == [(words[t.source], words[t.out]) for t in got]


def test_forward_needs_the_model(tmp_path):
    folder, _ = save(tmp_path, "llama")
    model = pcw.from_safetensors(folder)
    with pytest.raises(NeedsModel, match="needs the model.*from_hf"):
        pcw.run(model, [1, 2, 3])
    with pytest.raises(NeedsModel, match="from_hf"):
        model.loss([1, 2, 3])


def test_stacks_are_read_per_layer_and_say_so(tmp_path):
    folder, _ = save(tmp_path, "llama")
    model = pcw.from_safetensors(folder)
    assert model.W_Q.shape == (2, 4, 64, 16) and model.W_Q[1, 2].shape == (64, 16)
    with pytest.raises(TypeError, match="one layer at a time.*stack"):
        model.W_Q[0:2]
    with pytest.raises(AttributeError, match="read one layer at a time.*W_Q.stack"):
        model.W_Q.mT
    with pytest.raises(IndexError, match="layer 2 out of range"):
        model.W_Q[2]


def test_config_that_contradicts_the_shards_is_refused(tmp_path):
    folder, _ = save(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 4  # the shards hold 2 key/value heads
    (folder / "config.json").write_text(json.dumps(config))
    # refused on the headers, before any weight is read, naming the shard, the key and config.json
    with pytest.raises(pcw.CheckpointError, match=r"model-0000\d-of-0000\d\.safetensors: model\.layers\.0\.self_attn"
                                                  r"\.k_proj\.(bias|weight) has shape .*config\.json gives"):
        pcw.from_safetensors(folder)


def test_non_finite_weight_is_refused_naming_it(tmp_path):
    def poison(hf):
        hf.model.layers[1].self_attn.v_proj.weight[3, 5] = float("nan")

    folder, _ = save(tmp_path, "llama", mutate=poison)
    model = pcw.from_safetensors(folder)  # layer 1 is read by the first analysis that needs it
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight in model-0000\d-of-0000\d"
                                         r"\.safetensors has 1 non-finite"):
        pcw.composition_scores(model, "V")


def test_folder_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        pcw.from_safetensors(tmp_path)
    folder, _ = save(tmp_path, "llama")
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        pcw.from_safetensors(folder)


@pytest.mark.parametrize("placement", ["cpu", "disk offload"])
def test_from_hf_reads_a_device_mapped_model_where_accelerate_placed_it(tmp_path, placement):
    folder, hf = save(tmp_path, "llama")
    if placement == "cpu":
        device_map, extra = {"": "cpu"}, {}
    else:  # layer 0, the final norm and the unembedding on disk, the rest on the CPU
        device_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
                      "model.norm": "disk", "model.rotary_emb": "cpu", "lm_head": "disk"}
        extra = {"offload_folder": tmp_path / "offload"}
    placed = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, dtype=torch.float32,
                                                               attn_implementation="eager", **extra)
    if placement != "cpu":
        assert placed.model.layers[0].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    ours, ref = pcw.from_hf(placed), pcw.from_hf(hf)  # verified against the placed model's own forward
    assert ours.metadata["verified"] is not None
    for name in ("W_E", "W_U", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_out"):
        assert_within(getattr(ours, name), getattr(ref, name), fold_tol(hf, name))
    tokens = torch.tensor([[3, 17, 5, 99, 3, 17]])
    logits, cache = ours.run_with_cache(tokens)
    with torch.no_grad():
        expected = placed(tokens).logits
    assert_within(logits, expected, logit_tol(ours, cache, tokens.shape[1]))  # two float32 forwards


def test_a_folder_is_named_by_its_own_name_never_its_path_and_a_user_can_name_it(tmp_path):
    """Issue 55 item 4: captions, stores and pages name a model by ``cfg.name``; a folder's path (the
    author's machine) reaches none of them, and ``name=`` sets it."""
    folder, _ = save(tmp_path / "home" / "me" / "models", "llama")
    for model in (pcw.from_safetensors(folder), pcw.from_hf(str(folder), verify=False)):
        assert model.cfg.name == "llama" and str(tmp_path) not in repr(model.cfg)
    assert pcw.from_safetensors(folder, name="my llama").cfg.name == "my llama"
    assert pcw.from_hf(str(folder), verify=False, name="my llama").cfg.name == "my llama"
    with pytest.raises(ValueError, match="name must be a non-empty one-line string"):
        pcw.from_safetensors(folder, name="")
    with pytest.raises(ValueError, match="name must be a non-empty one-line string"):
        pcw.from_hf(str(folder), verify=False, name=3)
