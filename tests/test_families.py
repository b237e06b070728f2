"""from_hf on every decoder family (``tests/family_configs.py``: tiny random models built from
configs, eager attention, no download), verification at load, and the refusals.

Oracles: Hugging Face's own logits and attention probabilities on identical weights; its rope
initialisers (``ROPE_INIT_FUNCTIONS``) for the rotary frequencies. Both forwards run in float32 and
round differently (and differently again on another CPU's kernels): they are compared within the
rounding-error bounds of ``tests/tolerance.py`` (``logit_tol``, ``pattern_tol``), derived from the
reduction lengths and magnitudes of each run, not from one machine's observed error.
"""

import copy
import dataclasses

import pytest
import torch
import transformers

import pycircuits_widgets as pcw
from family_configs import CONFIGS, REFUSED, probe_tokens, reference, tiny_model
from pycircuits_widgets.models.adapters import families as families_module
from pycircuits_widgets.models.adapters.verify import TranslationError
from pycircuits_widgets.models.circuit_model import CircuitModel
from pycircuits_widgets.models.rotary import rotary_frequencies
from tolerance import logit_tol, pattern_tol, reduction_tol

EXACT = sorted(set(CONFIGS) - set(REFUSED))
ROPE_ROUNDINGS = 10
"""float32 roundings in computing a rotary frequency, ours or Hugging Face's: the exponent's
division, the power (1 ulp: 2 roundings), the reciprocal, and up to 6 for a rope type's rescaling
(llama3's blend, YaRN's ramp)."""


def assert_same_forward(model, ours, cache, logits, patterns, tokens):
    """Ours and the reference's float32 forwards agree within their rounding bounds (``tolerance.py``:
    two float32 chains of ``forward_length`` roundings; on these models about 6e-4 for the logits,
    whose sums are about 20 in size, and 1e-4 to 1e-3 for the patterns, whose scores spread 6 to 90)."""
    assert float((ours - logits).abs().max()) <= logit_tol(model, cache, tokens.shape[1])
    assert float((cache.patterns - patterns).abs().max()) <= pattern_tol(model.cfg, tokens.shape[1], patterns)


def assert_verified(model):
    """The load's own probe compared the patterns and found both errors within its bounds (``verify.py``)."""
    verified = model.metadata["verified"]
    assert verified["patterns_checked"]
    assert verified["max_logit_error"] <= verified["logit_tolerance"]
    assert verified["max_pattern_error"] <= verified["pattern_tolerance"]


@pytest.mark.parametrize("name", EXACT)
def test_logits_and_patterns_match_hugging_face(name):
    hf = tiny_model(name)
    model = pcw.from_hf(hf)
    tokens = probe_tokens()
    logits, patterns = reference(hf, tokens)
    ours, cache = model.run_with_cache(tokens)
    assert_same_forward(model, ours, cache, logits, patterns, tokens)
    assert_verified(model)


def test_the_features_are_read_from_the_config():
    """Each feature the families switch on reaches the config (so the tests above exercise it)."""
    cfg = {name: pcw.from_hf(tiny_model(name), verify=False).cfg for name in
           ("gemma2", "gemma3_text", "olmo2", "smollm3", "gpt_neo", "bloom", "llama_llama3", "phi", "exaone4",
            "mixtral")}
    assert (cfg["mixtral"].n_experts, cfg["mixtral"].experts_per_token, cfg["mixtral"].d_mlp) == (4, 2, 4 * 96)
    assert (cfg["gemma2"].attn_softcap, cfg["gemma2"].final_softcap, cfg["gemma2"].window) == (5.0, 3.0, [5, None])
    assert cfg["gemma2"].attn_scale == 24 ** 0.5 and cfg["gemma2"].post_norms
    assert [r["rope_theta"] for r in cfg["gemma3_text"].layer_rope] == [1e4, 1e6]
    assert (cfg["olmo2"].qk_norm, cfg["olmo2"].qk_norm_heads, cfg["olmo2"].pre_norm) == ("rmsnorm", False, False)
    assert cfg["smollm3"].rotary_layers == [True, False]
    assert cfg["exaone4"].rotary_layers == [True, False] and cfg["exaone4"].window == [5, None]
    assert (cfg["gpt_neo"].attn_scale, cfg["gpt_neo"].window) == (1.0, [None, 5])
    assert cfg["bloom"].positional == "none" and len(cfg["bloom"].alibi_slopes) == 4
    assert cfg["llama_llama3"].rope["rope_type"] == "llama3"
    assert cfg["phi"].rotary_dim == 8 and cfg["phi"].parallel_attn_mlp and cfg["phi"].qk_norm == "layernorm"
    assert cfg["gemma2"].nonlinear_features == ("post_norms", "attn_softcap", "final_softcap")


@pytest.mark.parametrize("name", ["llama_linear", "llama_dynamic", "llama_yarn", "llama_llama3", "llama_longrope",
                                  "gemma3_text"])
def test_rotary_frequencies_are_hugging_faces(name):
    """``rotary_frequencies`` against the source's rotary module (its buffers after a forward of
    ``n`` tokens: dynamic NTK and LongRoPE change with the length)."""
    hf = tiny_model(name)
    model = pcw.from_hf(hf, verify=False)
    rotary = hf.model.rotary_emb
    for n in (8, 24):
        with torch.no_grad():
            hf(torch.zeros(1, n, dtype=torch.long))
        for layer in range(2):
            layer_type = hf.config.layer_types[layer] if name == "gemma3_text" else None
            prefix = f"{layer_type}_" if layer_type else ""
            inv, scaling = rotary_frequencies(model.cfg, layer, n)
            expected = getattr(rotary, f"{prefix}inv_freq")
            # relative: gamma of each side's roundings, float32 tensors; the scaling is Python floats
            torch.testing.assert_close(inv, expected, atol=0, rtol=reduction_tol(ROPE_ROUNDINGS, 1.0, computations=2))
            assert scaling == pytest.approx(getattr(rotary, f"{prefix}attention_scaling"),
                                            rel=reduction_tol(ROPE_ROUNDINGS, 1.0, torch.float64, computations=2))


@pytest.mark.parametrize("name, change, message", [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("opt", {"do_layer_norm_before": False}, r"do_layer_norm_before=False \(post-norm OPT\)"),
    ("falcon", {"alibi": True}, "alibi"),
    ("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
    ("gpt_bigcode", {"multi_query": False}, "multi_query=False"),
])
def test_missing_features_are_refused_by_name(name, change, message):
    hf = tiny_model(name)
    for key, value in change.items():  # after building: the refusal reads the config alone
        setattr(hf.config, key, value)
    with pytest.raises(ValueError, match=f"from_hf: {hf.config.model_type} with .*{message}.* is not supported"):
        pcw.from_hf(hf)


def test_mpt_qk_ln_is_refused():
    """transformers' MPT ignores ``qk_ln``: its forward, the probe's oracle, is not the checkpoint's."""
    hf = tiny_model("mpt")
    hf.config.attn_config.qk_ln = True
    with pytest.raises(ValueError, match=r"mpt with attn_config.qk_ln \(which transformers' MPT does not apply\)"):
        pcw.from_hf(hf)


def test_a_config_contradicting_the_modules_is_refused_naming_both():
    """GPT-2 built with 4 heads, then told it has 8: the same weights would split into 8 heads of
    d_head 8 without a shape error (and logits off by 0.1); refused before any probe."""
    hf = tiny_model("gpt2")
    hf.config.n_head = 8
    with pytest.raises(TranslationError, match=r"config\.n_head gives n_heads=8, but layer 0's attention module "
                                               r"has num_heads=4"):
        pcw.from_hf(hf, verify=False)


def test_projection_shapes_that_contradict_the_config_are_refused():
    hf = tiny_model("llama")
    hf.config.num_key_value_heads = 4  # the k/v projections hold 2 heads
    with pytest.raises(TranslationError, match=r"query/key/value weights are .*\(64, 32\).*n_kv_heads=4"):
        pcw.from_hf(hf, verify=False)


def test_the_probe_refuses_a_dropped_feature_naming_the_layer_and_its_features(monkeypatch):
    """Gemma 2 with its attention soft-cap taken out of the description: the probe finds layer 0's
    patterns wrong and names that layer's features; verify=False lets the wrong model in."""
    family = families_module.FAMILIES["gemma2"]
    dropped = dataclasses.replace(family, features=lambda c: {**family.features(c), "attn_softcap": None})
    monkeypatch.setitem(families_module.FAMILIES, "gemma2", dropped)
    hf = tiny_model("gemma2")
    with pytest.raises(TranslationError, match=r"the gemma2 translation disagrees .* 16-token probe: max logit "
                                               r"error .*first disagreeing attention pattern: layer 0 .*likely "
                                               r"feature: rotary .*sliding window 5"):
        pcw.from_hf(hf)
    wrong = pcw.from_hf(hf, verify=False)
    logits, _ = reference(hf, probe_tokens())
    ours, cache = wrong.run_with_cache(probe_tokens())
    assert float((ours - logits).abs().max()) > logit_tol(wrong, cache, probe_tokens().shape[1])


def test_the_probe_names_qk_norm_when_the_forward_loses_it(monkeypatch):
    monkeypatch.setattr(CircuitModel, "_qk_norm", lambda self, layer, x, which, heads=None: x)
    with pytest.raises(TranslationError, match=r"qwen3 translation disagrees.*layer 0.*QK-norm \(rmsnorm, per head\)"):
        pcw.from_hf(tiny_model("qwen3"))


def test_the_probe_names_features_after_attention_when_patterns_agree(monkeypatch):
    family = families_module.FAMILIES["granite"]
    dropped = dataclasses.replace(family, features=lambda c: {**family.features(c), "logit_scale": 1.0})
    monkeypatch.setitem(families_module.FAMILIES, "granite", dropped)
    with pytest.raises(TranslationError, match=r"granite translation disagrees.*attention patterns agree; likely "
                                               r"feature: MLP \(gated silu\).*folded embed_scale 3"):
        pcw.from_hf(tiny_model("granite"))


def test_meta_and_mixed_dtype_models_are_refused_at_construction():
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(*[CONFIGS["llama"][0]], **CONFIGS["llama"][1]))
    with pytest.raises(ValueError, match="is on the meta device"):
        pcw.from_hf(meta)
    mixed = tiny_model("llama")
    mixed.model.layers[1].mlp.to(torch.float64)
    with pytest.raises(ValueError, match=r"mix dtypes or devices .*W_in float64"):
        pcw.from_hf(mixed)


def test_a_saved_folder_loads_by_name(tmp_path):
    """``from_hf(path)``: the string route (from_pretrained, eager, the saved dtype) on a local folder."""
    hf = tiny_model("qwen3")
    hf.save_pretrained(tmp_path)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer(), unk_token="<unk>")
    tok.save_pretrained(tmp_path)
    model = pcw.from_hf(str(tmp_path))
    tokens = probe_tokens()
    logits, patterns = reference(hf, tokens)
    assert_same_forward(model, *model.run_with_cache(tokens), logits, patterns, tokens)
    assert model.to_str_tokens("w3 w5") == ["w3", "w5"]
    with pytest.raises(TypeError, match="dtype applies when loading by name or folder"):
        pcw.from_hf(hf, dtype=torch.bfloat16)


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<unk>"] + [f"w{i}" for i in range(1, 128)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def test_bfloat16_forward_is_at_least_as_accurate_as_hugging_faces():
    """Llama in bfloat16 (4 seeds): our max logit errors against the float32 forward of the same
    (bfloat16-rounded) weights sum to at most those of Hugging Face's own bfloat16 forward (ours:
    folding in float32, norms, scores and softmax in float32, the residual stream summed in float32)."""
    ours = theirs = 0.0
    for seed in range(4):
        source = tiny_model("llama", seed=seed).to(torch.bfloat16)
        tokens = probe_tokens(seed)
        truth, _ = reference(copy.deepcopy(source).float(), tokens)
        model = pcw.from_hf(source)
        assert model.dtype == torch.bfloat16 and model.metadata["verified"]["patterns_checked"] is False
        ours += float((model(tokens).float() - truth).abs().max())
        theirs += float((reference(source, tokens)[0].float() - truth).abs().max())
    assert ours <= theirs


def _bridge(hf):
    """A TransformerLens 4.x bridge around ``hf`` (built in place: no download)."""
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module
    return build_bridge_from_module(hf, type(hf).__name__, hf_config=hf.config)


@pytest.mark.parametrize("name", ["gpt_neo", "gpt_neox", "mistral", "qwen3", "starcoder2", "granite", "smollm3", "glm"])
def test_transformer_lens_bridges_the_issue_found_wrong_are_exact(name):
    """TransformerLens 4.3's stacked weights lose these families' features (logits off by 3-6);
    from_transformer_lens translates the Hugging Face model under the bridge and verifies it
    against the bridge's own forward and hook_pattern."""
    hf = tiny_model(name)
    bridge = _bridge(hf)
    model = pcw.from_transformer_lens(bridge)
    tokens = probe_tokens()
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(tokens)
    patterns = torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(2)], 1)
    ours, ours_cache = model.run_with_cache(tokens)
    assert_same_forward(model, ours, ours_cache, logits, patterns, tokens)
    assert_verified(model)


def test_transformer_lens_route_refuses_a_disagreement(monkeypatch):
    monkeypatch.setattr(CircuitModel, "_qk_norm", lambda self, layer, x, which, heads=None: x)
    with pytest.raises(TranslationError, match=r"from_transformer_lens: the qwen3 translation disagrees.*QK-norm"):
        pcw.from_transformer_lens(_bridge(tiny_model("qwen3")))


def test_a_model_loaded_with_sdpa_is_probed_with_eager_attention_and_given_back():
    model_type, kwargs = CONFIGS["mistral"]
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **kwargs)).eval()
    assert hf.config._attn_implementation == "sdpa"


def test_a_model_in_training_mode_is_probed_without_dropout_and_left_training():
    model_type, kwargs = CONFIGS["gpt2"]
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **kwargs))
    assert hf.training and hf.config.attn_pdrop > 0
    pcw.from_hf(hf)
    assert hf.training
    assert_verified(pcw.from_hf(hf))
    assert hf.config._attn_implementation == "sdpa"


def test_a_bridge_around_a_refused_configuration_is_refused_naming_the_feature():
    hf = tiny_model("gpt2")
    bridge = _bridge(hf)
    hf.config.scale_attn_by_inverse_layer_idx = True
    with pytest.raises(ValueError, match="gpt2 with scale_attn_by_inverse_layer_idx is not supported"):
        pcw.from_transformer_lens(bridge)


@pytest.mark.parametrize("name", ["gemma3_text", "llama_longrope", "bloom", "olmo2"])
def test_configs_with_features_round_trip_through_json(name):
    import json
    cfg = pcw.from_hf(tiny_model(name), verify=False).cfg
    assert pcw.models.ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_a_family_entry_with_an_unknown_layout_is_refused_when_written():
    with pytest.raises(ValueError, match=r"Family.qkv_layout must be one of \('separate', 'concat'"):
        families_module.Family(body="model", qkv_layout="fused")
    with pytest.raises(ValueError, match="do not fit the layouts 'concat' / 'gated'"):
        families_module.Family(body="model", qkv_layout="concat")


@pytest.mark.parametrize("name, field, value", [
    ("olmo", "clip_qkv", None), ("mpt", "clip_qkv", None), ("gemma2", "attn_softcap", None),
    ("mixtral", "experts_per_token", 4), ("mistral", "window", None), ("smollm3", "rotary_layers", None)])
def test_each_feature_tested_changes_the_logits_here(name, field, value):
    """The exactness tests can fail: the same weights without the feature (or, for the mixture of
    experts, with every expert chosen) give other logits."""
    hf = tiny_model(name)
    model = pcw.from_hf(hf, verify=False)
    without = CircuitModel(dataclasses.replace(model.cfg, **{field: value}),
                           **{k: getattr(model, k) for k in pcw.models.circuit_model._WEIGHTS})
    logits, _ = reference(hf, probe_tokens())
    ours, cache = without.run_with_cache(probe_tokens())
    # past what the exactness test allows (its rounding bound), so that test would fail
    assert float((ours - logits).abs().max()) > logit_tol(without, cache, probe_tokens().shape[1])


@pytest.mark.parametrize("n_heads", [4, 6, 12, 20])
def test_alibi_slopes_are_bloom_and_mpt_slopes_for_any_head_count(n_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor
    bloom = build_alibi_tensor(torch.ones(1, 2), n_heads, torch.float32)[:, 0, 1]
    mpt = -build_mpt_alibi_tensor(n_heads, 2)[:, 0, 0]
    torch.testing.assert_close(torch.tensor(families_module.alibi_slopes(n_heads), dtype=torch.float32), bloom)
    torch.testing.assert_close(torch.tensor(families_module.alibi_slopes(n_heads, 8.0, interleave_extra=True),
                                            dtype=torch.float32), mpt)


def test_a_dynamic_rope_length_raised_after_building_is_the_sources_rule_past_it():
    """Built for 20 positions, then told 30: Hugging Face's rotary module keeps its built length, but
    its dynamic update re-reads the config as it grows, so its forward is the config's rule; exact at
    every length up to n_ctx, past both the built and the edited length. (The 31-token probe must leave
    the source's rotary state as it was: else its 21-token forward keeps the 31-token frequencies.)"""
    hf = tiny_model("llama_dynamic", max_position_embeddings=20)
    hf.config.max_position_embeddings = 30
    model = pcw.from_hf(hf)
    assert model.cfg.rope["max_position_embeddings"] == 30 and model.metadata["verified"]["tokens"] == 31
    for n in (21, 31, 50):
        tokens = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
        logits, _ = reference(hf, tokens)
        # the families' float32 translation bound (test_logits_and_patterns_match_hugging_face)
        assert float((model(tokens) - logits).abs().max()) <= 1e-4 * float(logits.abs().max())


def test_a_dynamic_rope_length_lowered_after_building_is_refused_by_the_module_check_and_the_long_probe(monkeypatch):
    """Built for 30 positions, then told 20: the source keeps its built frequencies up to 30 tokens, the
    config's rule grows them from 21 (0.56 x max|logit| apart at 30 tokens), beyond a 16-token probe."""
    hf = tiny_model("llama_dynamic", max_position_embeddings=30)
    hf.config.max_position_embeddings = 20
    with pytest.raises(TranslationError, match=r"rotary embedding 'model.rotary_emb' \(layer 0\) was built for "
                                               r"max_position_embeddings=30 .* config's 20"):
        pcw.from_hf(hf, verify=False)
    # the second guard alone: the probe one token past the rule's threshold (21 tokens)
    from pycircuits_widgets.models.adapters import hf as hf_adapter
    monkeypatch.setattr(hf_adapter, "check_rotary_modules", lambda model, cfg: None)
    with pytest.raises(TranslationError, match=r"disagrees with the source model's own forward on a 21-token probe"):
        pcw.from_hf(hf)


def test_rope_parameters_edited_after_building_are_refused_naming_the_frequencies():
    hf = tiny_model("llama_yarn")
    hf.config.rope_parameters["factor"] = 8.0  # the module was built with 4
    with pytest.raises(TranslationError, match=r"was built with inverse frequencies \[1, .*\] \(8\), but the config's "
                                               r"rotary rule \('yarn', base 10000, rotary_dim 16\) gives"):
        pcw.from_hf(hf, verify=False)
