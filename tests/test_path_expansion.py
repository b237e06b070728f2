"""Path expansion: the terms sum back to the logits; orders and ablations are consistent.

Tolerances: the random models are float64; assert_close's float64 defaults (1e-7 relative) stand far
above the expansion's rounding (``tolerance.path_expansion_tol``, ~1e-13 at these sizes)."""

import pytest
import torch
import torch.nn.functional as F

from pycircuits_widgets import FactoredMatrix
from pycircuits_widgets.analysis import path_expansion
from random_models import custom_model, paper_model

TOKENS = torch.tensor([[4, 11, 29, 4, 11, 2, 36, 29], [1, 2, 3, 1, 2, 3, 0, 9]])


@pytest.mark.parametrize("n_layers", [0, 1, 2])
def test_terms_sum_back_to_the_logits(n_layers):
    m = paper_model(n_layers=n_layers, d_vocab=40)
    pe = path_expansion(m, TOKENS)
    assert len(pe.terms) == 4 ** n_layers  # prod over layers of (1 + n_heads)
    torch.testing.assert_close(pe.total(), m.forward(TOKENS))
    assert [t.order for t in pe.terms].count(n_layers) == 3 ** n_layers


def test_uncentred_writers_and_learned_positions_are_still_exact():
    # weights not folded: the layer-norm centering must be kept as a projection in the terms
    m = custom_model(positional="learned", n_layers=2)
    torch.testing.assert_close(path_expansion(m, TOKENS).total(), m.forward(TOKENS))


def test_one_head_and_virtual_head_terms_are_what_the_paper_writes():
    m = paper_model(n_layers=2, d_vocab=40)
    pe = path_expansion(m, TOKENS)
    _, cache = m.run_with_cache(TOKENS)
    s = cache.ln_scale
    x = cache.embed
    by_name = {t.name: i for i, t in enumerate(pe.terms)}
    # direct: x / s_final @ W_U
    torch.testing.assert_close(pe.term_logits(by_name["direct"]), x / s[:, 2, :, None] @ m.W_U)
    # one head in layer 1: what the head wrote from x alone, read by the unembedding
    A = cache.patterns[:, 1, 2]
    one = (A @ (x / s[:, 1, :, None]) @ m.W_V[1, 2] @ m.W_O[1, 2]) / s[:, 2, :, None] @ m.W_U
    torch.testing.assert_close(pe.term_logits(by_name["L1.H2"]), one)
    # ... computed through d_model: W_OV W_U stays factored (a dense [d_model, d_vocab] per term is
    # 154 MB at GPT-2 size, 26 GB for its 170 terms)
    W = pe.terms[by_name["L1.H2"]].term.W
    assert isinstance(W, FactoredMatrix) and W.shape == (m.cfg.d_model, m.cfg.d_vocab) and W.mdim == m.cfg.d_model
    # virtual head L0.H1 → L1.H0: A^{h2} D A^{h1} D x W_OV1 W_OV2 W_U
    h1_out = cache.patterns[:, 0, 1] @ (x / s[:, 0, :, None]) @ m.W_V[0, 1] @ m.W_O[0, 1]
    virt = (cache.patterns[:, 1, 0] @ (h1_out / s[:, 1, :, None]) @ m.W_V[1, 0] @ m.W_O[1, 0]) / s[:, 2, :, None] @ m.W_U
    torch.testing.assert_close(pe.term_logits(by_name["L0.H1 → L1.H0"]), virt)


def test_loss_by_order_and_term_importance():
    m = paper_model(n_layers=2, d_vocab=40)
    pe = path_expansion(m, TOKENS)
    losses = pe.loss_by_order()
    assert losses.shape == (3,)
    logits = m.forward(TOKENS)
    full = F.cross_entropy(logits[:, :-1].reshape(-1, 40), TOKENS[:, 1:].reshape(-1))
    torch.testing.assert_close(losses[-1], full)
    direct = pe.term_logits(0)
    torch.testing.assert_close(losses[0], F.cross_entropy(direct[:, :-1].reshape(-1, 40), TOKENS[:, 1:].reshape(-1)))
    imp = pe.term_importance()
    assert imp.shape == (16,)
    i = 5
    ablated = logits - pe.term_logits(i)
    expected = F.cross_entropy(ablated[:, :-1].reshape(-1, 40), TOKENS[:, 1:].reshape(-1)) - full
    torch.testing.assert_close(imp[i], expected)


def test_max_order_truncates_without_losing_exactness():
    """A path with max_order heads reads the whole stream at its first head: with max_order=1 each
    layer-1 head's term is its whole output (what it read from layer 0's heads included)."""
    m = paper_model(n_layers=2, d_vocab=40)
    pe = path_expansion(m, TOKENS, max_order=1)
    assert len(pe.terms) == 1 + 3 + 3 and max(t.order for t in pe.terms) == 1
    torch.testing.assert_close(pe.total(), m.forward(TOKENS))
    _, cache = m.run_with_cache(TOKENS)
    whole = cache.head_out[:, 1, 2] / cache.ln_scale[:, 2, :, None] @ m.W_U
    torch.testing.assert_close(pe.term_logits([t.name for t in pe.terms].index("L1.H2")), whole)
    with pytest.raises(ValueError, match="max_order must be an int in 1..2"):
        path_expansion(m, TOKENS, max_order=3)
