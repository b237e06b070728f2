"""analysis.cache: results kept per model equal fresh computations (dense float64 oracles), a weight
edit in place invalidates them, the byte budget holds, models never share entries.

Tolerances: the models are float64 and so are their spectra and Grams (fixed float64 margins, or
``product_tol`` in float64); the skip-trigram factors are float32, within ``centred_product_tol`` of
their chains."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pycircuits_widgets.analysis import cache
from pycircuits_widgets.analysis.circuits import embedding
from pycircuits_widgets.analysis.composition import composition_detail, composition_scores
from pycircuits_widgets.analysis.eigen import eigenvalues, token_gram
from pycircuits_widgets.analysis.skip_trigrams import centred_factors, copied_tokens
from random_models import paper_model
from tolerance import assert_within, centred_product_tol, product_tol


@pytest.fixture
def budget():
    """Restores the default budget after a test that changes it."""
    yield cache.set_budget
    cache.set_budget(cache.BUDGET_BYTES)


def dense_ov(model, layer: int, head: int) -> torch.Tensor:
    """Full OV circuit ``W_E W_V W_O W_U [d_vocab, d_vocab]`` in float64, the embedding as the layer reads it."""
    W_E = embedding(model, layer, torch.float64)
    return W_E @ model.W_V[layer, head].double() @ model.W_O[layer, head].double() @ model.W_U.double()


def check_ov_spectra(model, eigs: torch.Tensor) -> None:
    """Each head's spectrum has the dense circuit's trace and trace of the square (power sums). Float64:
    eigenvalues with backward errors ~1e-13 of the circuit's norm, far below the 1e-9 margins."""
    for layer in range(model.cfg.n_layers):
        for head in range(model.cfg.n_heads):
            M = dense_ov(model, layer, head)
            e = eigs[layer, head]
            torch.testing.assert_close(e.sum().real, torch.trace(M), rtol=1e-9, atol=1e-9)
            torch.testing.assert_close((e ** 2).sum().real, torch.trace(M @ M), rtol=1e-9, atol=1e-9)


def dense_copies(model, layer: int, head: int, n: int):
    """Top ``n`` of the row-centred full OV circuit's diagonal, dense, and the bound on ours at those tokens
    (float32 factors: ``centred_product_tol`` of ``W_E W_V W_O W_U``)."""
    M = dense_ov(model, layer, head)
    values, ids = torch.topk(torch.diagonal(M - M.mean(1, keepdim=True)), n)
    chain = (embedding(model, layer, torch.float64), model.W_V[layer, head], model.W_O[layer, head], model.W_U)
    return values, ids, centred_product_tol(*chain).diagonal()[ids]


def test_hits_return_the_stored_result_which_equals_a_fresh_computation():
    model = paper_model(n_layers=2, n_heads=3)
    calls = [
        lambda: token_gram(model, "QK", 0),
        lambda: token_gram(model, "OV"),
        lambda: eigenvalues(model, "OV"),
        lambda: eigenvalues(model, "QK"),
        lambda: composition_scores(model, "K", baseline=False),
        lambda: composition_detail(model, "V", (0, 1), (1, 2)),
        lambda: centred_factors(model, 1, 2),
        lambda: copied_tokens(model, 1, 2, 5),
    ]
    first = [call() for call in calls]
    again = [call() for call in calls]
    for a, b in zip(first[:-1], again[:-1]):  # served from the store, not recomputed
        assert all(x is y for x, y in zip(a, b)) if isinstance(a, tuple) else a is b
    cache.clear(model)
    fresh = [call() for call in calls]
    for a, b in zip(first, fresh):
        if isinstance(a, torch.Tensor):
            assert a is not b
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # (NaN: l1 >= l2 compositions)
    torch.testing.assert_close(first[5].eigenvalues, fresh[5].eigenvalues, rtol=0, atol=0)
    assert first[5].score == fresh[5].score
    for a, b in zip(first[6] + first[7], fresh[6] + fresh[7]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and against the dense oracle
    E0 = embedding(model, 0, torch.float64)
    assert_within(first[0], E0.T @ E0, product_tol(E0.T, E0))
    check_ov_spectra(model, first[2])
    values, ids, bound = dense_copies(model, 1, 2, 5)
    assert first[7][0].tolist() == ids.tolist()
    assert_within(first[7][1], values, bound)


def test_a_weight_edit_in_place_or_a_new_weight_invalidates():
    model = paper_model(n_layers=2, n_heads=3)
    eigs, (_, values) = eigenvalues(model, "OV"), copied_tokens(model, 1, 0, 4)
    gram_before = token_gram(model, "OV")
    with torch.no_grad():
        model.W_V[1, 0] *= -3.0  # in place: bumps the tensor's version counter
    edited = eigenvalues(model, "OV")
    assert edited is not eigs
    check_ov_spectra(model, edited)
    assert not torch.allclose(edited[1, 0], eigs[1, 0])
    new_values, new_ids, bound = dense_copies(model, 1, 0, 4)
    ids2, values2 = copied_tokens(model, 1, 0, 4)
    assert ids2.tolist() == new_ids.tolist()
    assert_within(values2, new_values, bound)
    assert not torch.allclose(values2, values)
    assert token_gram(model, "OV") is not gram_before  # every entry went, not only the edited head's
    old_W_U = model.W_U
    model.W_U = old_W_U * 2.0  # a new tensor in place of the old one (which stays alive)
    # doubling is exact in binary floating point: the same float64 sums, doubled (1e-12: a float64 margin)
    torch.testing.assert_close(token_gram(model, "OV"), 2.0 * gram_before, rtol=1e-12, atol=1e-12)
    check_ov_spectra(model, eigenvalues(model, "OV"))


def factor_keys(layer: int, head: int) -> list[tuple]:
    """Cache keys of one head's centred factors, in the order they are computed."""
    return [("ov_factors", layer, head), ("qk_factors", layer, head)]


def test_the_byte_budget_holds_and_the_least_recently_used_entry_goes_first(budget):
    model = paper_model(n_layers=2, n_heads=3, d_vocab=200)
    one_head = cache.nbytes(centred_factors(model, 0, 0)) + 2 * cache.ENTRY_OVERHEAD  # its QK and OV factors
    cache.clear(model)
    eigenvalues(model, "OV")  # model-level (with its token Grams): the oldest entries, yet the factors go first
    model_level, spectra = cache.keys(model), cache.stored_bytes(model)
    assert ("eigenvalues", "OV", None, True) in model_level
    budget(2 * one_head + spectra)
    for head in range(3):
        centred_factors(model, 0, head)
        assert cache.stored_bytes(model) <= cache.budget()
    assert cache.keys(model) == [*model_level, *factor_keys(0, 1), *factor_keys(0, 2)]
    centred_factors(model, 0, 1)  # used again: now the newest
    centred_factors(model, 1, 0)
    assert cache.keys(model) == [*model_level, *factor_keys(0, 1), *factor_keys(1, 0)]
    assert cache.stored_bytes(model) == 2 * one_head + spectra
    budget(one_head - 1)  # smaller than a head's entry: those go at once, and no new one is kept
    assert cache.keys(model) == model_level and cache.stored_bytes(model) == spectra
    _q, _k, v, _u = centred_factors(model, 1, 1)
    assert cache.keys(model) == model_level
    budget(0)
    assert cache.keys(model) == [] and cache.stored_bytes(model) == 0
    W_E = embedding(model, 1, torch.float64)  # the result is still right when not kept
    assert_within(v, W_E @ model.W_V[1, 1], centred_product_tol(W_E, model.W_V[1, 1], centre=False))  # float32 v
    with pytest.raises(ValueError, match="non-negative int of bytes"):
        budget(-1)


def test_two_models_never_share_entries_and_a_dropped_model_takes_its_entries():
    a, b = paper_model(seed=1), paper_model(seed=2)  # same shapes, same config values
    ea, eb = eigenvalues(a, "OV"), eigenvalues(b, "OV")
    assert not torch.allclose(ea, eb)
    check_ov_spectra(a, ea)
    check_ov_spectra(b, eb)
    copied_tokens(a, 0, 1, 3)
    assert ("ov_diagonal", 0, 1) in cache.keys(a) and ("ov_diagonal", 0, 1) not in cache.keys(b)
    gone = weakref.ref(a)
    del a, ea
    gc.collect()
    assert gone() is None  # the cache holds no reference that keeps a model alive
    assert eigenvalues(b, "OV") is eb


def test_large_factors_go_before_the_small_results_computed_from_them(budget):
    model = paper_model(n_layers=2, n_heads=3, d_vocab=200)
    copied_tokens(model, 0, 0, 3)  # the head's OV factors, then its OV diagonal
    assert cache.keys(model) == [("ov_factors", 0, 0), ("ov_diagonal", 0, 0)]
    centred_factors(model, 0, 0)  # adds the QK factors
    one_head = cache.nbytes(centred_factors(model, 0, 0)) + 2 * cache.ENTRY_OVERHEAD
    budget(cache.stored_bytes(model))  # room for one head's factors next to the diagonal
    centred_factors(model, 0, 1)
    centred_factors(model, 0, 2)
    assert cache.keys(model) == [("ov_diagonal", 0, 0), *factor_keys(0, 2)]
    assert cache.stored_bytes(model) <= cache.budget() < cache.stored_bytes(model) + one_head


def test_a_weight_namespace_without_weak_references_is_computed_every_time():
    # the analyses run on duck-typed weight holders too (benchmarks build types.SimpleNamespace ones)
    import types
    holder, calls = types.SimpleNamespace(W_E=torch.ones(2)), []
    for _ in range(2):
        assert cache.cached(holder, ("k",), lambda: calls.append(1) or torch.zeros(1)).shape == (1,)
    assert len(calls) == 2
