"""Layer-norm folding: helpers against dense layer norm; folded model == unfolded model.

Tolerances (``tests/tolerance.py``): float64 helpers at assert_close's float64 defaults; float32 folds
within ``centred_mean_tol`` (a centred row's mean) and ``reduction_tol``, forwards within ``logit_tol``."""

import pytest
import torch

from pycircuits_widgets.models import (
    CHECKPOINT_DIR,
    AttnOnlyTransformer,
    attn_only_config,
    from_attn_only,
    load_attn_only,
)
from pycircuits_widgets.models.folding import (
    center_writing_weights,
    fold_bias_into_reader,
    fold_scale_into_reader,
)
from tolerance import assert_within, centred_mean_tol, gamma, logit_tol, reduction_tol


def dense_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def test_scale_and_bias_fold_into_the_reader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=g, dtype=torch.float64)
    w, b = torch.rand(12, generator=g, dtype=torch.float64) + 0.5, torch.randn(12, generator=g, dtype=torch.float64)
    W, b0 = torch.randn(12, 7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    expected = dense_layer_norm(x, w, b) @ W + b0
    xc = x - x.mean(-1, keepdim=True)
    normed = xc / torch.sqrt((xc ** 2).mean(-1, keepdim=True) + 1e-5)
    folded = normed @ fold_scale_into_reader(w, W) + fold_bias_into_reader(b, W, b0)
    torch.testing.assert_close(folded, expected)


def test_centering_writers_makes_layer_norm_centering_a_no_op():
    g = torch.Generator().manual_seed(1)
    W_E, W_O = torch.randn(9, 6, generator=g) + 2.0, torch.randn(3, 4, 6, generator=g)
    r = torch.randn(2, 4, generator=g)
    resid = center_writing_weights(W_E)[[1, 4]] + (r @ center_writing_weights(W_O[0]))
    # each centred writer's rows average to zero within centred_mean_tol, and r @ W_O's rows to r @ those
    # means; the product (4 terms), the sum and the test's mean (6 + 1 terms) round what they add up
    parts = W_E[[1, 4]].abs() + r.abs() @ W_O[0].abs()
    bound = (centred_mean_tol(W_E)[[1, 4]] + r.double().abs() @ centred_mean_tol(W_O[0])
             + 2 * gamma(4 + 2 + W_E.shape[-1] + 1) * parts.double().mean(-1))
    assert_within(resid.mean(-1), torch.zeros(2), bound)
    assert not torch.allclose(W_E.mean(-1), torch.zeros(9))


@pytest.mark.parametrize("n_layers", [0, 1, 2])
def test_folded_logits_equal_unfolded_logits(n_layers):
    cfg = attn_only_config(n_layers, n_heads=4, d_model=32, d_head=8, d_vocab=97, n_ctx=24)
    model = AttnOnlyTransformer(cfg, seed=n_layers)
    g = torch.Generator().manual_seed(10 + n_layers)
    with torch.no_grad():  # make every folded part matter: uncentered writers, a non-trivial scale
        model.W_E.add_(torch.randn(97, 1, generator=g) + 1.0)
        model.W_O.add_(0.3)
        model.ln_final_w.mul_(torch.rand(32, generator=g) * 2 + 0.1)
    tokens = torch.randint(0, 97, (3, 24), generator=g)
    with torch.no_grad():
        expected = model(tokens)
    folded = from_attn_only(model)
    ours, cache = folded.run_with_cache(tokens)
    assert_within(ours, expected, logit_tol(folded, cache, tokens.shape[1]))  # two float32 forwards
    # the folded view really is folded: writers centered, the scale moved into W_U (then centred: it reads
    # only the layer-normed stream)
    assert_within(folded.W_E.mean(-1), torch.zeros(97), centred_mean_tol(model.W_E.detach()))
    scaled = model.ln_final_w.detach()[:, None] * model.W_U.detach()
    # each side: the scale's product, the column mean's d_model terms and division, the subtraction
    size = scaled.double().abs()
    assert_within(folded.W_U, scaled - scaled.mean(0), reduction_tol(32 + 3, size + size.mean(0), computations=2))


def test_shipped_two_layer_model_folds_exactly():
    raw, _, tok = load_attn_only(CHECKPOINT_DIR / "attn-only-2l.safetensors", CHECKPOINT_DIR / "attn-only-2l.json",
                                 CHECKPOINT_DIR / "tokenizer.json")
    folded = from_attn_only(raw, tok)
    tokens = folded.to_tokens("import os\nimport sys\n\ndef main(argv):\n    return os.path.join(sys.prefix, argv[0])\n")
    with torch.no_grad():
        expected = raw(tokens[None])
    ours, cache = folded.run_with_cache(tokens[None])
    # two float32 forwards (the raw module's, the folded view's): tolerance.logit_tol
    assert_within(ours, expected, logit_tol(folded, cache, tokens.shape[0]))


def test_readers_of_the_layer_normed_stream_are_centred_except_where_positions_are_read():
    cfg = attn_only_config(2, n_heads=4, d_model=32, d_head=8, d_vocab=97, n_ctx=24)
    raw = AttnOnlyTransformer(cfg, seed=0)
    folded = from_attn_only(raw)
    before = {"W_V": raw.W_V.detach(), "W_U": raw.ln_final_w.detach()[:, None] * raw.W_U.detach()}
    for name in ("W_V", "W_U"):  # read only the layer-normed (mean-zero) stream
        mean = getattr(folded, name).mean(-2)
        # centred_mean_tol of the reader before centring; W_U's folded scale rounds each entry once more
        scale_rounding = gamma(1) * before[name].double().abs().mean(-2) if name == "W_U" else 0
        assert_within(mean, torch.zeros_like(mean), centred_mean_tol(before[name], -2) + scale_rounding)
    # W_Q, W_K also read the Shortformer table, added after the norm: centring them would change the model
    assert folded.W_Q.mean(-2).abs().max() > 1e-3 and folded.W_K.mean(-2).abs().max() > 1e-3
