"""AttentionPatterns: payloads, validation and trait sync (Python side; the view is tested in
tests/browser/test_attention_browser.py)."""

import zlib

import numpy as np
import pytest
import torch
import traitlets
from ipywidgets.widgets.widget import _remove_buffers

import pycircuits_widgets as pcw
from attention_data import causal_softmax, toks
from pycircuits_widgets.widgets.core.payload import max_pool, pack_causal, unpack_causal
from pycircuits_widgets.widgets.views.attention import OVERVIEW_MAX


def wire(w, name: str) -> dict:
    """The payload the browser gets for trait ``name`` (and a saved page stores)."""
    return w.get_state([name])[name]


def patterns_of(w, name: str):
    """[..., n, n] uint8 of a patterns trait as sent (causal ones travel as their lower triangle)."""
    payload = wire(w, name)
    data = bytes(payload["view"])
    if payload.get("encoding") == "deflate":
        data = zlib.decompress(data, -15)
    data = np.frombuffer(data, payload["dtype"]).reshape(payload["shape"])
    return unpack_causal(data, payload["n"]) if payload["layout"] == "causal" else data


@pytest.fixture(scope="module")
def tiny_model():
    from pycircuits_widgets.models import (
        CHECKPOINT_DIR,
        AttnOnlyTransformer,
        Tokenizer,
        attn_only_config,
        from_attn_only,
    )

    tok = Tokenizer.load(CHECKPOINT_DIR / "tokenizer.json")
    cfg = attn_only_config(2, n_heads=3, d_model=32, d_head=8, d_vocab=tok.vocab_size, n_ctx=48)
    return from_attn_only(AttnOnlyTransformer(cfg, seed=0), tok)


# -- payloads ------------------------------------------------------------------------------
def test_short_context_ships_every_head_once_as_uint8():
    A = causal_softmax(2, 3, 10)
    w = pcw.AttentionPatterns(tokens=toks(10), patterns=A)
    ov = patterns_of(w, "overview")
    assert w.overview["factor"] == 1 and ov.dtype == np.uint8 and ov.shape == (2, 3, 10, 10)
    assert np.abs(ov / 255.0 - A).max() <= 1 / 510 + 1e-7
    assert w.full == {} and w._detail == {}  # the overview already is full resolution
    _state, paths, buffers = _remove_buffers(w.get_state())
    attention = [bytes(b) for p, b in zip(paths, buffers) if p[0] != "_offline"]
    assert len(attention) == 1 and wire(w, "overview")["encoding"] == "deflate"  # saved with the page: deflated
    assert len(zlib.decompress(attention[0], -15)) == 2 * 3 * 10 * 11 // 2  # one byte per value of the causal half, nothing twice


def test_causal_packing_is_the_lower_triangle_by_rows_and_round_trips():
    x = np.arange(2 * 16).reshape(2, 4, 4)
    packed = pack_causal(x)
    assert packed.tolist()[1] == [16, 20, 21, 24, 25, 26, 28, 29, 30, 31]
    assert np.array_equal(unpack_causal(packed, 4), np.tril(x))


def test_overview_is_block_max_of_the_quantised_pattern():
    n = 300  # factor 3, m = 100: a padded last block
    A = causal_softmax(1, 2, n, seed=1)
    w = pcw.AttentionPatterns(tokens=toks(n), patterns=A)
    f = w.overview["factor"]
    assert f == -(-n // OVERVIEW_MAX) == 3
    ov = patterns_of(w, "overview")
    q = np.rint(A * 255)
    for h in range(2):
        for i in (0, 5, 99):
            for j in (0, 4, 99):
                block = q[0, h, i * f:(i + 1) * f, j * f:(j + 1) * f]
                assert ov[0, h, i, j] == block.max()


@pytest.mark.parametrize("n, factor", [(12, 3), (13, 3), (14, 4), (5, 1), (7, 7), (9, 8)])
def test_max_pool_takes_every_block_max_including_a_smaller_last_block(n, factor):
    x = np.random.default_rng(n).random((2, 3, n, n), dtype=np.float32)
    m = -(-n // factor)
    expected = np.empty((2, 3, m, m), np.float32)
    for i in range(m):  # the oracle: each block sliced out and reduced on its own
        for j in range(m):
            expected[..., i, j] = x[..., i * factor:(i + 1) * factor, j * factor:(j + 1) * factor].max(axis=(-2, -1))
    np.testing.assert_array_equal(max_pool(x, factor), expected)


def test_full_resolution_for_all_heads_within_budget_else_only_the_selected_head():
    n = 200
    A = causal_softmax(2, 2, n, seed=2)
    within = pcw.AttentionPatterns(tokens=toks(n), patterns=A)
    assert patterns_of(within, "full").shape == (2, 2, n, n) and within._detail == {}
    assert np.array_equal(patterns_of(within, "full"), np.rint(A * 255))
    over = pcw.AttentionPatterns(tokens=toks(n), patterns=A, full_budget=4 * n * (n + 1) // 2 - 1, layer=1, head=0)
    assert over.full == {}
    detail = patterns_of(over, "_detail")
    assert (over._detail["layer"], over._detail["head"]) == (1, 0)
    assert np.array_equal(detail, np.rint(A[1, 0] * 255))
    over.head = 1  # a selection change brings that head at full resolution
    assert (over._detail["layer"], over._detail["head"]) == (1, 1)
    assert np.array_equal(patterns_of(over, "_detail"), np.rint(A[1, 1] * 255))


def test_exact_row_request_is_answered_with_float32_row():
    A = causal_softmax(2, 2, 12, seed=3)
    w = pcw.AttentionPatterns(tokens=toks(12), patterns=A)
    sent = []
    w.send = lambda content, buffers=None: sent.append((content, buffers))
    w._handle_custom_msg({"type": "row", "layer": 1, "head": 0, "dest": 7}, [])
    w._handle_custom_msg({"type": "row", "layer": 5, "head": 0, "dest": 7}, [])  # out of range: ignored
    assert len(sent) == 1
    content, buffers = sent[0]
    assert content == {"type": "row", "layer": 1, "head": 0, "dest": 7}
    assert np.array_equal(np.frombuffer(buffers[0], np.float32), A[1, 0, 7].astype(np.float32))


# -- accepted inputs ---------------------------------------------------------------------
def test_accepts_three_four_and_batched_five_dim_torch_patterns():
    A = causal_softmax(2, 3, 6)
    three = pcw.AttentionPatterns(tokens=toks(6), patterns=torch.from_numpy(A[1]))
    assert (three.n_layers, three.n_heads) == (1, 3)
    four = pcw.AttentionPatterns(tokens=toks(6), patterns=torch.from_numpy(A))
    five = pcw.AttentionPatterns(tokens=toks(6), patterns=torch.from_numpy(A)[None])
    assert (four.n_layers, four.n_heads) == (five.n_layers, five.n_heads) == (2, 3)
    assert np.array_equal(patterns_of(four, "overview"), patterns_of(five, "overview"))


def test_bidirectional_patterns_need_causal_false():
    rng = np.random.default_rng(0)
    A = rng.random((1, 2, 5, 5)).astype(np.float32)
    A /= A.sum(-1, keepdims=True)
    with pytest.raises(ValueError, match=r"above the diagonal.*causal=False"):
        pcw.AttentionPatterns(tokens=toks(5), patterns=A)
    w = pcw.AttentionPatterns(tokens=toks(5), patterns=A, causal=False)
    assert w.causal is False and w.warning == ""


# -- rejected inputs ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda A: A[..., :5], r"\[\.\.\., 6, 5\] do not match the 6 tokens"),
        (lambda A: A[0, 0, 0], r"shape \[n_heads, dest, src\]"),
        (lambda A: np.where(np.arange(6) == 2, np.nan, A), r"NaN.*\[0, 0, 2, 2\]|NaN"),
        (lambda A: A - 0.5, r"must be >= 0.*scores before the softmax"),
        (lambda A: A * 3, r"<= 1"),
    ],
)
def test_bad_patterns_raise_clear_errors(corrupt, message):
    A = causal_softmax(1, 2, 6)
    with pytest.raises(ValueError, match=message):
        pcw.AttentionPatterns(tokens=toks(6), patterns=corrupt(A))


def test_weight_above_diagonal_names_its_position():
    A = causal_softmax(2, 2, 6)
    A[1, 0, 2, 4] = 0.1
    with pytest.raises(ValueError, match=r"above the diagonal.*\[1, 0, 2, 4\]"):
        pcw.AttentionPatterns(tokens=toks(6), patterns=A)


def test_rows_not_summing_to_one_are_shown_with_a_warning():
    A = causal_softmax(1, 2, 6)
    A[0, 1, 3] *= 0.5
    w = pcw.AttentionPatterns(tokens=toks(6), patterns=A)
    assert "layer 0, head 1, dest 3" in w.warning and "0.5000" in w.warning


def test_constructor_argument_errors():
    A = causal_softmax(1, 1, 3)
    with pytest.raises(TypeError, match="tokens= and patterns="):
        pcw.AttentionPatterns(tokens=toks(3))
    with pytest.raises(TypeError, match="text needs a model"):
        pcw.AttentionPatterns(text="hi", tokens=toks(3), patterns=A)
    with pytest.raises(TypeError, match="list of strings"):
        pcw.AttentionPatterns(tokens="abc", patterns=A)
    with pytest.raises(TypeError, match="'heads'"):
        pcw.AttentionPatterns(tokens=toks(3), patterns=A, heads=2)


# -- selection traits --------------------------------------------------------------------
@pytest.mark.parametrize(
    "trait, bad, good",
    [("layer", 2, 1), ("head", -1, 2), ("dest_position", 7, 6), ("src_position", -2, -1), ("position", 7, 0)],
)
def test_selection_out_of_range_is_rejected_naming_the_range(trait, bad, good):
    w = pcw.AttentionPatterns(tokens=toks(7), patterns=causal_softmax(2, 3, 7))
    with pytest.raises(traitlets.TraitError, match=trait):
        setattr(w, trait, bad)
    setattr(w, trait, good)
    assert getattr(w, trait) == good


def test_browser_selection_out_of_range_sets_error_and_keeps_last_good_value():
    w = pcw.AttentionPatterns(tokens=toks(4), patterns=causal_softmax(2, 2, 4), layer=1)
    w.set_state({"layer": 9})
    assert w.layer == 1 and "layer must be in 0..1, got 9" in w.error
    w.set_state({"layer": 0, "head": 1})
    assert (w.layer, w.head, w.error) == (0, 1, "")


def test_set_patterns_clamps_selection_to_the_new_sizes():
    w = pcw.AttentionPatterns(tokens=toks(8), patterns=causal_softmax(2, 4, 8), layer=1, head=3,
                              dest_position=7, src_position=2, position=6)
    w.set_patterns(toks(5), causal_softmax(1, 2, 5))
    assert (w.layer, w.head, w.dest_position, w.src_position, w.position) == (0, 1, -1, 2, -1)
    assert patterns_of(w, "overview").shape == (1, 2, 5, 5)


def test_text_is_only_editable_with_a_model():
    w = pcw.AttentionPatterns(tokens=toks(3), patterns=causal_softmax(1, 1, 3))
    with pytest.raises(traitlets.TraitError, match="built from a model"):
        w.text = "hello"


# -- from a model --------------------------------------------------------------------------
def test_model_and_text_show_the_models_own_patterns(tiny_model):
    text = "def f(x):\n    return x"
    w = pcw.AttentionPatterns(tiny_model, text)
    _, cache = tiny_model.run_with_cache(tiny_model.to_tokens(text))
    expected = cache.patterns[0].detach().numpy()
    assert w.tokens == tiny_model.to_str_tokens(text)
    assert (w.n_layers, w.n_heads) == (2, 3) and w.editable
    assert np.abs(patterns_of(w, "overview") / 255.0 - expected).max() <= 1 / 510 + 1e-6


def test_editing_text_reruns_the_model_and_a_failing_text_keeps_the_last_view(tiny_model):
    w = pcw.AttentionPatterns(tiny_model, "import os", position=1)
    w.text = "x = 1\ny = 2"
    assert w.tokens == tiny_model.to_str_tokens("x = 1\ny = 2") and w.error == ""
    shown = (list(w.tokens), bytes(wire(w, "overview")["view"]))
    with pytest.raises(traitlets.TraitError, match="n_ctx"):
        w.text = "x " * 200  # longer than n_ctx = 48: refused, the last good text kept
    assert w.text == "x = 1\ny = 2"
    assert (list(w.tokens), bytes(wire(w, "overview")["view"])) == shown
    w.set_state({"text": "x " * 200})  # from the browser: shown in the view
    assert "n_ctx" in w.error and w.text == "x = 1\ny = 2"
    assert (list(w.tokens), bytes(wire(w, "overview")["view"])) == shown
