"""CircuitModel weight view: shapes, cache consistency, circuits, bad input, pretrained models.

Tolerances (``tests/tolerance.py``): the shipped models are float32; sums of the residual stream within
``stream_tol`` (the sums' lengths times the size of what was summed), products within ``product_tol``,
recomputed patterns and logits within ``pattern_tol``/``logit_tol``, rotary scores within
``rotary_table_tol``.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pycircuits_widgets as pcw
from pycircuits_widgets.models import PRETRAINED, CircuitModel, ModelConfig, load_pretrained
from pycircuits_widgets.models.circuit_model import weight_shapes
from tolerance import assert_within, gamma, logit_tol, pattern_tol, product_tol, reduction_tol, rotary_table_tol


@pytest.fixture(scope="module")
def model():
    return load_pretrained("attn-only-2l")


TEXT = "def add(a, b):\n\treturn a + b  # sum\n\nprint(add(1, 2))\n"


def written(model, cache, layers) -> torch.Tensor:
    """``sum |z| |W_O|`` over the heads of ``layers`` ``[b, pos, d_model]`` (float64): the size of what they wrote."""
    z, W_O = cache.z[:, layers].double().abs(), model.W_O[layers].double().abs()
    return torch.einsum("blhpe,lhed->bpd", z, W_O)


def stream_tol(model, cache, layers, *parts) -> torch.Tensor:
    """Bound on the stream's sum over ``layers`` two ways, the forward's (each layer's heads in one
    ``H d_head``-term product, then up to three additions to the stream) and a sum of the cache's parts
    (``head_out`` over layers and heads, ``b_O``, ``mlp_out``): ``reduction_tol`` of the longer,
    ``H d_head + L H + 3 L + 1`` terms, times the size of everything summed (``parts``: the other
    terms' absolute values), for each side."""
    L, H = len(range(model.cfg.n_layers)[layers]), model.cfg.n_heads
    magnitude = written(model, cache, layers) + sum(p.double().abs() for p in parts)
    return reduction_tol(H * model.cfg.d_head + L * H + 3 * L + 1, magnitude, computations=2)


@pytest.mark.parametrize("name", PRETRAINED)
def test_load_pretrained_gives_the_documented_shapes(name):
    m = pcw.load_pretrained(name)
    c = m.cfg
    assert c.name == name and c.n_layers == int(name[-2]) and c.attn_only and c.positional == "shortformer"
    assert m.W_E.shape == (c.d_vocab, c.d_model) and m.W_U.shape == (c.d_model, c.d_vocab)
    assert m.W_pos.shape == (c.n_ctx, c.d_model)
    for W in (m.W_Q, m.W_K, m.W_V):
        assert W.shape == (c.n_layers, c.n_heads, c.d_model, c.d_head)
    assert m.W_O.shape == (c.n_layers, c.n_heads, c.d_head, c.d_model)
    assert m.W_in is None and m.W_out is None and c.d_mlp is None
    assert m.W_E.dtype == torch.float32
    logits = m("import os\n")
    assert logits.shape == (1, len(m.to_tokens("import os\n")), c.d_vocab)
    assert m.metadata["corpus_sha256"] and m.metadata["val_loss"] > 0


def test_unknown_pretrained_name_lists_valid_names():
    with pytest.raises(ValueError, match="attn-only-0l, attn-only-1l, attn-only-2l"):
        load_pretrained("gpt2")


def test_head_outputs_and_embedding_sum_to_the_residual_stream(model):
    _, cache = model.run_with_cache(TEXT)
    L = model.cfg.n_layers
    for layer in range(L):
        # (the stream after the layer was rounded once, and the difference once more)
        assert_within(cache.resid[:, layer + 1] - cache.resid[:, layer], cache.head_out[:, layer].sum(1),
                      stream_tol(model, cache, slice(layer, layer + 1), cache.resid[:, layer + 1]))
    assert torch.equal(cache.resid[:, 0], cache.embed)  # the same values, no arithmetic between
    assert_within(cache.resid[:, L], cache.embed + cache.head_out.sum((1, 2)),
                  stream_tol(model, cache, slice(None), cache.embed))


def test_cache_matches_a_dense_recomputation_from_the_weights(model):
    """Patterns, head outputs and logits recomputed from (resid, ln_scale) and the weights."""
    logits, cache = model.run_with_cache(TEXT)
    pos, d, dh = cache.tokens.shape[1], model.cfg.d_model, model.cfg.d_head
    causal = torch.ones(pos, pos, dtype=torch.bool).tril()
    for layer in range(model.cfg.n_layers):
        x = cache.resid[0, layer]
        scale = (x - x.mean(-1, keepdim=True)).pow(2).mean(-1).add(model.cfg.eps).sqrt()
        # each side's sigma within half of gamma(d + 6) (the variance's roundings) plus its square root's
        torch.testing.assert_close(cache.ln_scale[0, layer], scale, rtol=gamma(d + 8), atol=0)
        xn = (x - x.mean(-1, keepdim=True)) / cache.ln_scale[0, layer, :, None]
        for h in range(model.cfg.n_heads):
            q = (xn + model.W_pos[:pos]) @ model.W_Q[layer, h]
            k = (xn + model.W_pos[:pos]) @ model.W_K[layer, h]
            scores = (q @ k.T / dh ** 0.5).masked_fill(~causal, float("-inf"))
            # a part of the forward's chain recomputed: within the whole chain's bound (pattern_tol)
            assert_within(cache.patterns[0, layer, h], scores.softmax(-1), pattern_tol(model.cfg, pos, cache.patterns))
            p = cache.patterns[0, layer, h]
            head = p @ xn @ model.OV.AB[layer, h]
            # the chain p xn W_V W_O (pos + d_model + d_head terms) and the normalised stream's two roundings
            magnitude = (p.double() @ xn.double().abs() @ model.W_V[layer, h].double().abs()
                         @ model.W_O[layer, h].double().abs())
            assert_within(cache.head_out[0, layer, h], head, reduction_tol(pos + d + dh + 2, magnitude, computations=2))
    # logits are linear in the stream's components once ln_scale is frozen (writers are centered)
    final = (cache.embed + cache.head_out.sum((1, 2))) / cache.ln_scale[:, -1, :, None]
    assert_within(logits, final @ model.W_U, logit_tol(model, cache, pos))


def test_head_out_refuses_weights_changed_after_the_run():
    """head_out is computed from z on first read: after an in-place edit of W_O it would describe
    weights the run never used, so it refuses, naming the fix (a run after the edit works)."""
    m = load_pretrained("attn-only-1l")
    _, cache = m.run_with_cache(TEXT)
    m.W_O[0, 0].mul_(2.0)
    with pytest.raises(RuntimeError, match="W_O was modified in place after this run; run the model again"):
        cache.head_out
    _, fresh = m.run_with_cache(TEXT)
    assert_within(fresh.head_out[0, 0, 0], fresh.z[0, 0, 0] @ m.W_O[0, 0], product_tol(fresh.z[0, 0, 0], m.W_O[0, 0]))


def test_residual_stream_carries_token_identity_alone(model):
    """Shortformer: positions enter only Q and K, so the stream is the same at every position
    holding the same token (before the first layer) and the embedding is W_E's row."""
    tokens = torch.tensor([7, 300, 7, 300, 7])
    _, cache = model.run_with_cache(tokens)
    assert torch.equal(cache.resid[0, 0], model.W_E[tokens])  # copied rows, no arithmetic
    assert torch.equal(cache.resid[0, 0, 0], cache.resid[0, 0, 4])


def test_ov_and_qk_are_the_factored_products(model):
    assert_within(model.OV.AB, model.W_V @ model.W_O, product_tol(model.W_V, model.W_O))
    W_K_T = model.W_K.transpose(-1, -2)
    assert_within(model.QK.AB, model.W_Q @ W_K_T, product_tol(model.W_Q, W_K_T))
    assert model.OV.AB.shape == (2, model.cfg.n_heads, model.cfg.d_model, model.cfg.d_model)


def test_batched_and_unbatched_forward_agree(model):
    tokens = model.to_tokens(["import os", "import re"])
    assert tokens.shape[0] == 2
    one, cache = model.run_with_cache(tokens[1])
    # a batch may take other kernels: two float32 forwards
    assert_within(model(tokens)[1], one[0], logit_tol(model, cache, tokens.shape[1]))


def test_loss_matches_cross_entropy(model):
    tokens = model.to_tokens(TEXT)
    logits = model(tokens)[0]
    # two float32 cross-entropies of the same logits: each a log-sum-exp over d_vocab terms (exp's and
    # log's roundings) less the target's logit, then a mean over positions; terms up to max|logit|
    V, n = model.cfg.d_vocab, tokens.shape[0]
    magnitude = 2 * float(logits.abs().max()) + np.log(V) + 1
    torch.testing.assert_close(model.loss(tokens), F.cross_entropy(logits[:-1], tokens[1:]), rtol=0,
                               atol=reduction_tol(V + n + 4, magnitude, computations=2))


def test_str_tokens_show_whitespace(model):
    strs = model.to_str_tokens("a b\n\tc")
    assert "".join(strs) == "a·b↵→c"
    assert model.to_str_tokens(model.to_tokens("a b")) == model.to_str_tokens("a b")
    assert len(model.token_strings) == model.cfg.d_vocab


@pytest.mark.parametrize("bad, error, message", [
    (lambda m: torch.tensor([1, m.cfg.d_vocab]), ValueError, "out of range"),
    (lambda m: torch.tensor([-1, 2]), ValueError, "out of range"),
    (lambda m: torch.zeros(m.cfg.n_ctx + 1, dtype=torch.long), ValueError, "longer than n_ctx"),
    (lambda m: "", ValueError, "empty text"),
    (lambda m: torch.zeros(0, dtype=torch.long), ValueError, "empty token sequence"),
    (lambda m: torch.tensor([1.0, 2.0]), TypeError, "integer tensor"),
    (lambda m: torch.zeros(1, 1, 3, dtype=torch.long), ValueError, r"\[pos\] or \[batch, pos\]"),
    (lambda m: 3.5, TypeError, "tokens must be text .* got float$"),
    (lambda m: ["import os", "x"], ValueError, "different lengths"),
])
def test_bad_input_is_a_clear_error(model, bad, error, message):
    with pytest.raises(error, match=message):
        model.run_with_cache(bad(model))


def _random_model(**cfg_changes):
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=16, d_head=4, d_vocab=23, n_ctx=10, **cfg_changes)
    g = torch.Generator().manual_seed(0)
    shapes = {k: s for k, s in weight_shapes(cfg).items() if s is not None}
    return CircuitModel(cfg, **{k: torch.randn(*s, generator=g) * 0.5 for k, s in shapes.items()})


@pytest.mark.parametrize("changes", [
    {"positional": "learned", "normalization": "rmsnorm", "attn_only": False, "d_mlp": 32, "act_fn": "gelu_new"},
    {"positional": "rotary", "normalization": None, "attn_only": False, "d_mlp": 32, "act_fn": "silu", "gated_mlp": True},
    {"positional": "none", "normalization": "layernorm"},
])
def test_general_configs_keep_the_residual_sum_identity(changes):
    m = _random_model(**changes)
    logits, cache = m.run_with_cache(torch.arange(10) % 23)
    total = cache.embed + cache.head_out.sum((1, 2)) + m.b_O.sum(0)
    parts = [cache.embed, m.b_O.abs().sum(0)]
    if cache.mlp_out is not None:
        total = total + cache.mlp_out.sum(1)
        parts.append(cache.mlp_out.abs().sum(1))
        assert cache.ln_scale_mlp.shape == (1, 2, 10)
    assert_within(cache.resid[:, -1], total, stream_tol(m, cache, slice(None), *parts))
    assert logits.shape == (1, 10, 23) and cache.ln_scale.shape == (1, 3, 10)


def test_rotary_scores_depend_only_on_relative_position():
    m = _random_model(positional="rotary", normalization=None)
    q, k = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    same_q, same_k = q[..., :1, :].expand_as(q), k[..., :1, :].expand_as(k)
    scores = m._rotate(same_q) @ m._rotate(same_k).transpose(-1, -2)
    # float32 tables at each position: two scores, each within its rotary_table_tol of the exact one, and
    # each score's own arithmetic (2 roundings per rotated entry, a 4-term dot product: gamma(6) of
    # sum |R q| |R k| <= 4 ||q|| ||k||)
    qk = float(q[0, 0, 0].norm() * k[0, 0, 0].norm())
    for (t, s), (t2, s2) in [((3, 1), (4, 2)), ((5, 5), (0, 0))]:
        tol = 2 * (rotary_table_tol(t) + rotary_table_tol(s) + rotary_table_tol(t2) + rotary_table_tol(s2)) * qk
        assert abs(float(scores[0, 0, t, s] - scores[0, 0, t2, s2])) <= tol + 2 * gamma(6) * 4 * qk


def test_wrong_weight_shapes_are_rejected():
    cfg = ModelConfig(n_layers=1, n_heads=2, d_model=8, d_head=4, d_vocab=5, n_ctx=4, positional="none")
    good = {"W_E": torch.zeros(5, 8), "W_U": torch.zeros(8, 5), "W_Q": torch.zeros(1, 2, 8, 4),
                "W_K": torch.zeros(1, 2, 8, 4), "W_V": torch.zeros(1, 2, 8, 4), "W_O": torch.zeros(1, 2, 4, 8)}
    CircuitModel(cfg, **good)
    with pytest.raises(ValueError, match=r"W_O has shape \(1, 2, 8, 4\), expected \(1, 2, 4, 8\)"):
        CircuitModel(cfg, **{**good, "W_O": torch.zeros(1, 2, 8, 4)})
    with pytest.raises(ValueError, match="W_Q is required"):
        CircuitModel(cfg, **{k: v for k, v in good.items() if k != "W_Q"})
    with pytest.raises(TypeError, match="unknown weights"):
        CircuitModel(cfg, W_X=torch.zeros(1), **good)


def _good_weights():
    cfg = ModelConfig(n_layers=1, n_heads=2, d_model=8, d_head=4, d_vocab=5, n_ctx=4, positional="none")
    g = torch.Generator().manual_seed(0)
    shapes = {k: s for k, s in weight_shapes(cfg).items() if s is not None and not k.startswith("b_")}
    return cfg, {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("name, bad, error, message", [
    ("W_Q", lambda w: w.index_put((torch.tensor(0), torch.tensor(1), torch.tensor(2), torch.tensor(3)),
                                  torch.tensor(float("nan"))),
     ValueError, (r"^CircuitModel: W_Q has 1 non-finite values \(NaN or inf\), first at index \(0, 1, 2, 3\); "
                 r"weights must be finite$")),
    ("W_U", lambda w: w.fill_(float("inf")), ValueError, r"W_U has 40 non-finite values"),
    ("W_E", lambda w: w.to(torch.int8), TypeError,
     (r"^CircuitModel: W_E has dtype int8; expected a real floating-point tensor \(float16, bfloat16, float32 or "
     r"float64\)$")),
    ("W_V", lambda w: w > 0, TypeError, "W_V has dtype bool; expected a real floating-point tensor"),
    ("W_O", lambda w: w.to(torch.complex64), TypeError, "W_O has dtype complex64; expected a real floating-point"),
    ("W_K", lambda w: w.numpy(), TypeError, r"^CircuitModel: W_K must be a torch.Tensor, got ndarray$"),
    ("W_K", lambda w: w.double(), ValueError,
     (r"^CircuitModel: weights mix dtypes \(W_E float32, W_U float32, W_Q float32, W_K float64, W_V float32, "
     r"W_O float32\); expected one floating dtype for all")),
])
def test_bad_weights_are_refused_naming_the_tensor(name, bad, error, message):
    cfg, weights = _good_weights()
    CircuitModel(cfg, **weights)
    weights[name] = bad(weights[name].clone())
    with pytest.raises(error, match=message):
        CircuitModel(cfg, **weights)


@pytest.mark.parametrize("bad, message", [
    (None, "got NoneType"),
    (bytearray(b"\x01\x02"), "got bytearray"),
    (b"\x01\x02", "got bytes"),
    ({1, 2}, "got set"),
])
def test_run_names_what_tokens_must_be(model, bad, message):
    expected = (r"^tokens must be text \(str or list of str\) or token ids \(list of int, or an integer "
                rf"tensor/array of shape \[pos\] or \[batch, pos\]\), {message}$")
    with pytest.raises(TypeError, match=expected):
        pcw.run(model, bad)


def test_run_takes_ids_and_numpy_ids_on_a_model_without_tokenizer(model):
    """Oracle: the same model with its tokenizer, run on the same ids."""
    bare = CircuitModel(model.cfg, **{k: getattr(model, k) for k in ("W_E", "W_U", "W_pos", "W_Q", "W_K", "W_V", "W_O")})
    assert bare.tokenizer is None
    ids = [5, 17, 300, 5, 17]
    out = pcw.run(bare, ids)
    torch.testing.assert_close(out.logits, pcw.run(model, ids).logits, atol=0, rtol=0)
    assert out.str_tokens == [["<id 5>", "<id 17>", "<id 300>", "<id 5>", "<id 17>"]]
    torch.testing.assert_close(pcw.run(bare, np.array([ids])).logits, out.logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="has no tokenizer; pass token ids instead of text"):
        pcw.run(bare, "def")
    with pytest.raises(TypeError, match="integer array, got numpy dtype float64"):
        pcw.run(bare, np.array(ids, dtype=float))


@pytest.mark.parametrize("weight", ["W_E", "W_V"])
def test_weights_made_non_finite_after_loading_never_give_numbers(weight):
    """Weights are checked where they enter; a tensor edited in place afterwards is caught where
    the analysis reads it, instead of eig's NaN becoming positivity 0.0 or top-k an empty list."""
    m = load_pretrained("attn-only-1l")
    getattr(m, weight).view(-1)[5] = float("nan")
    with pytest.raises(ValueError, match=rf"^the OV circuits are not finite: weight {weight} \(.*\) holds 1 NaN/inf entries$"):
        pcw.eigenvalue_positivity(m, "OV")
    with pytest.raises(ValueError, match=r"^the circuits of L0\.H0 are not finite"):
        pcw.skip_trigrams(m, 0, 0)


@pytest.mark.parametrize("changes, message", [
    ({"n_heads": True}, r"^ModelConfig.n_heads must be an int, got True \(bool\)$"),
    ({"n_kv_heads": False}, r"ModelConfig.n_kv_heads must be an int, got False \(bool\)"),
    ({"attn_scale": 0.0}, r"ModelConfig.attn_scale must be a finite number > 0 \(at most 1e15\), got 0.0"),
    ({"attn_scale": float("nan")}, "ModelConfig.attn_scale must be a finite number > 0"),
    ({"attn_scale": float("inf")}, "ModelConfig.attn_scale must be a finite number > 0"),
    ({"eps": -1e-5}, r"ModelConfig.eps must be a finite number >= 0 \(at most 1e15\), got -1e-05"),
    ({"eps": float("nan")}, "ModelConfig.eps must be a finite number >= 0"),
    ({"pos_scale": 0.0}, "ModelConfig.pos_scale must be a finite number > 0"),
    ({"pos_scale": 1e30}, r"ModelConfig.pos_scale must be a finite number > 0 \(at most 1e15\), got 1e\+30"),
    ({"pos_scale": True}, "ModelConfig.pos_scale must be a finite number > 0"),
    ({"attn_only": "yes"}, "ModelConfig.attn_only must be a bool, got 'yes'"),
    ({"attn_softcap": -3.0}, "ModelConfig.attn_softcap must be a finite number > 0"),
    ({"window": [4]}, r"ModelConfig.window must be a list of one entry per layer \(2\), got \[4\]"),
    ({"window": [4, 0]}, r"ModelConfig.window entries must be int \(or None\)"),
    ({"alibi_slopes": [0.5] * 3}, r"ModelConfig.alibi_slopes needs one slope per head \(4\), got 3"),
    ({"positional": "rotary", "rotary_dim": 3}, "ModelConfig.rotary_dim must be even and in 2..d_head=4, got 3"),
    ({"positional": "rotary", "rope": {"rope_type": "ntk"}}, "rope_type 'ntk' is not supported"),
    ({"qk_norm": "l2"}, r"ModelConfig.qk_norm must be one of \('rmsnorm', 'layernorm', None\), got 'l2'"),
    ({"attn_only": False, "d_mlp": 30, "act_fn": "silu", "n_experts": 4, "experts_per_token": 2},
     r"a mixture of n_experts=4 needs MLPs, d_mlp=30 a multiple of it"),
    ({"attn_only": False, "d_mlp": 32, "act_fn": "silu", "n_experts": 4, "experts_per_token": 5}, r"got 5\)"),
])
def test_config_values_that_cannot_work_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{"n_layers": 2, "n_heads": 4, "d_model": 16, "d_head": 4, "d_vocab": 23, "n_ctx": 10, **changes})


def test_weights_on_the_meta_device_are_refused_at_construction():
    cfg, weights = _good_weights()
    weights["W_Q"] = weights["W_Q"].to("meta")
    with pytest.raises(ValueError, match=r"^CircuitModel: W_Q is on the meta device \(shapes only, no values\)"):
        CircuitModel(cfg, **weights)


def test_a_bfloat16_model_sums_its_stream_in_float32_and_returns_its_dtype():
    m = _random_model(positional="rotary", attn_only=False, d_mlp=32, act_fn="silu", gated_mlp=True)
    half = m.to(torch.bfloat16)
    logits, cache = half.run_with_cache(torch.arange(10) % 23)
    assert logits.dtype == cache.resid.dtype == cache.patterns.dtype == torch.bfloat16
    rounded = CircuitModel(m.cfg, **{k: getattr(half, k).double() for k in weight_shapes(m.cfg) if getattr(half, k)
                                     is not None})(torch.arange(10) % 23)
    # what the bfloat16 weights compute in float64, to within a few bfloat16 roundings of the activations
    assert float((logits.double() - rounded).abs().max()) <= 0.03 * float(rounded.abs().max())
