"""Path expansion on every decoder family (``tests/family_configs.py``: tiny random Hugging Face models
built from configs, no download): the terms sum to the model's own logits (before a final soft-cap),
or the expansion is refused naming the feature that is not linear on the text, and the explorer's
paths section says so instead of showing terms.

Oracles: the weight view's own forward (``model(tokens)``, itself checked against each family's
Hugging Face forward in ``test_families.py``), dense float64 products written here from the cached
activations, and the clamp-free forward (a ``clip_qkv`` model refused only where the clamp changes
its logits).

Tolerance (float64, every comparison): ``tolerance.path_expansion_tol``, the rounding of the terms'
products and of their sum, from the sizes of the terms (they can cancel).
"""

import dataclasses

import pytest
import torch

import pycircuits_widgets as pcw
from family_configs import CONFIGS, probe_tokens, tiny_model
from pycircuits_widgets.analysis import NonlinearFeatureError, path_expansion
from pycircuits_widgets.models.circuit_model import CircuitModel
from pycircuits_widgets.widgets.sharing import pictures
from random_models import custom_model
from tolerance import path_expansion_tol


def weight_view(name: str, dtype=torch.float64) -> CircuitModel:
    """``name``'s tiny model as a weight view in ``dtype`` (the translation is verified in test_families)."""
    return pcw.from_hf(tiny_model(name), verify=False).to(dtype)


def without_clamp(model) -> CircuitModel:
    weights = {name: getattr(model, name) for name in ("W_E", "W_U", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_out",
                                                      "W_gate", "b_Q", "b_K", "b_V", "b_O", "b_in", "b_out", "b_U")}
    return CircuitModel(dataclasses.replace(model.cfg, clip_qkv=None), **weights)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_terms_sum_to_the_logits_or_the_feature_is_refused(name):
    model = weight_view(name)
    tokens = probe_tokens()
    logits = model(tokens)
    try:
        pe = path_expansion(model, tokens)
    except NonlinearFeatureError as err:
        # refused only for a clamp that bites on this text: without it the logits differ
        assert err.feature == "clip_qkv" and "clip_qkv" in str(err) and model.cfg.clip_qkv is not None
        assert float((without_clamp(model)(tokens) - logits).abs().max()) > 1e-3 * float(logits.abs().max())
        return
    tol = path_expansion_tol(model, pe)
    assert float((pe.capped(pe.total()) - logits).abs().max()) <= tol  # the model's own output
    assert float((pe.total() - pe.logits).abs().max()) <= tol
    if model.cfg.final_softcap is None:
        assert pe.logits is logits or torch.equal(pe.logits, logits)
    else:  # the sum is the logits before the cap: c * atanh(logits / c), where the cap does not saturate
        cap = model.cfg.final_softcap
        inside = logits.abs() < 0.9 * cap  # atanh's slope there is <= 1 / (1 - 0.81): the bound grows 5.3x
        before = cap * torch.atanh(logits / cap)
        assert inside.float().mean() > 0.5
        assert float((pe.total() - before)[inside].abs().max()) <= tol / (1 - 0.9 ** 2)
    if model.cfg.clip_qkv is not None:  # where the clamp does not bite, the same as without it
        torch.testing.assert_close(logits, without_clamp(model)(tokens), rtol=0, atol=tol)


@pytest.mark.parametrize("name", ["gemma2", "olmo2"])
def test_a_head_term_passes_the_post_norm_with_its_division_frozen(name):
    """One head of layer 0 and one virtual head, written out in float64 from the cache: the head's
    write divided by the post-attention norm's rms (recomputed here from the heads' outputs), times
    its scale, read by the next layer (OLMo 2 has no pre-norms) and by the final norm and unembedding."""
    model = weight_view(name)
    tokens = probe_tokens()
    pe = path_expansion(model, tokens)
    _, cache = model.run_with_cache(tokens)
    c = model.cfg
    b_O = model.b_O if model.b_O is not None else torch.zeros(c.n_layers, c.d_model, dtype=torch.float64)
    attn_out = cache.head_out.sum(2) + b_O[None, :, None]  # [b, L, pos, d]
    post = (attn_out.pow(2).mean(-1) + c.eps).sqrt()  # rmsnorm of the layer's whole output
    torch.testing.assert_close(cache.post_scale_attn, post)
    pre = cache.ln_scale if c.pre_norm else torch.ones_like(cache.ln_scale)
    x = cache.embed

    def head(layer, h, src):
        moved = cache.patterns[:, layer, h] @ (src / pre[:, layer, :, None]) @ model.W_V[layer, h] @ model.W_O[layer, h]
        return moved / post[:, layer, :, None] * model.w_post_attn[layer]

    def unembed(y):
        return y / cache.ln_scale[:, -1, :, None] @ model.W_U

    by_name = {t.name: i for i, t in enumerate(pe.terms)}
    tol = path_expansion_tol(model, pe)
    one = unembed(head(0, 2, x))
    virtual = unembed(head(1, 3, head(0, 1, x)))
    torch.testing.assert_close(pe.term_logits(by_name["L0.H2"]), one, rtol=0, atol=tol)
    torch.testing.assert_close(pe.term_logits(by_name["L0.H1 → L1.H3"]), virtual, rtol=0, atol=tol)


@pytest.mark.parametrize("pre_norm", [True, False])
@pytest.mark.parametrize("mlp", [False, True])
def test_layer_norm_post_norms_with_biases_are_exact(pre_norm, mlp):
    """No family has these: layer-norm post-norms (their centering kept as a projection), attention
    biases passing through them (a source that varies with the position's division), with and
    without pre-norms and MLPs; random unfolded float64 weights."""
    extra = {"attn_only": False, "d_mlp": 32, "act_fn": "gelu"} if mlp else {}
    model = custom_model(normalization="layernorm", post_norms=True, pre_norm=pre_norm, positional="learned",
                         biases=True, **extra)
    tokens = torch.tensor([[1, 5, 9, 2, 1, 5, 9, 2], [3, 3, 0, 7, 12, 3, 3, 0]])
    pe = path_expansion(model, tokens)
    assert {"bias L0", "bias L1"} <= {t.name for t in pe.terms}
    torch.testing.assert_close(pe.total(), model(tokens), rtol=0, atol=path_expansion_tol(model, pe))


def test_the_final_soft_cap_applies_to_each_sum_in_the_losses():
    model = weight_view("gemma2")
    tokens = probe_tokens()
    pe = path_expansion(model, tokens)
    assert pe.final_softcap == 3.0
    # the full ladder rung is the model's own loss (on its capped logits)
    torch.testing.assert_close(pe.loss_by_order()[-1], model.loss(tokens))
    direct = 3.0 * torch.tanh(pe.term_logits(0) / 3.0)
    nll = -direct[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None]).mean()
    torch.testing.assert_close(pe.loss_by_order()[0], nll)


def test_a_clamp_that_bites_is_refused_by_name_and_the_explorer_shows_why():
    model = weight_view("mpt", torch.float32)
    tokens = probe_tokens()[0]
    with pytest.raises(NonlinearFeatureError, match=r"path expansion refused: clip_qkv: on this text \d+ values "
                                                    r"of layer 0 .* reach the clamp at ±2") as info:
        path_expansion(model, tokens)
    assert info.value.feature == "clip_qkv" and isinstance(info.value, ValueError)
    e = pcw.CircuitExplorer(model, tokens.tolist())
    try:
        e.compute("paths")
        assert e.wait(120)
        view = e.paths
        assert view.refusal == str(info.value) and view.terms == [] and view.importance is None
        assert not view.error  # a refusal, not a failure
        picture = pictures.path_expansion(view)
        assert "clip_qkv" in picture and "not computed yet" not in picture
    finally:
        e.close()


def test_the_explorer_note_says_what_the_terms_sum_to():
    gemma = pcw.CircuitExplorer(weight_view("gemma2", torch.float32), probe_tokens()[0].tolist())
    olmo = pcw.CircuitExplorer(weight_view("olmo2", torch.float32), probe_tokens()[0].tolist())
    try:
        assert "sum exactly to the model's logits before its final soft-cap (3 · tanh(logits / 3))" in \
            gemma.paths.expansion_note
        assert "post-norms' divisions are frozen" in olmo.paths.expansion_note
        assert olmo.paths.expansion_note.endswith("The terms sum exactly to the model's logits.")
        olmo.compute("paths")
        assert olmo.wait(120) and olmo.paths.terms and not olmo.paths.refusal
    finally:
        gemma.close()
        olmo.close()
