"""Constructor arguments of the views: bad ones are clear errors naming the argument, and the
circuit views say which embedding their token circuits read (in the real bundle too)."""

import numpy as np
import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.circuits import embedding_note
from test_circuit_widgets import tiny_model


def test_colored_tokens_refuses_values_that_overflow_float32():
    """1e39 passes a float64 finiteness check but would arrive as Infinity (identical colours)."""
    with pytest.raises(ValueError, match=r"^values must fit in float32 \(\|value\| <= 3\.403e\+38\); "
                                         r"too large at token positions \[1\]$"):
        pcw.ColoredTokens(["a", "b", "c"], [0.5, 1e39, -2.0])
    w = pcw.ColoredTokens(["a", "b"], [3.0e38, -3.0e38])  # the largest float32 values still pass
    assert np.isfinite(w.values).all()


def test_colored_tokens_takes_bfloat16_values_exactly():
    values = torch.tensor([0.5, -1.25, 3.0], dtype=torch.bfloat16)
    w = pcw.ColoredTokens(["a", "b", "c"], values)
    assert w.values.tolist() == [0.5, -1.25, 3.0]


def test_attention_patterns_without_heads_is_a_clear_error():
    model = pcw.load_pretrained("attn-only-0l")
    n = len(model.to_str_tokens("a b"))
    message = (rf"^patterns have no heads to show \(shape \[n_layers, n_heads, dest, src\] = \[0, 8, {n}, {n}\]\); "
               r"expected at least one layer and one head \(a 0-layer model has no attention\)$")
    with pytest.raises(ValueError, match=message):
        pcw.AttentionPatterns(model, "a b")
    with pytest.raises(ValueError, match="no heads to show"):
        pcw.AttentionPatterns(tokens=["a", "b"], patterns=np.zeros((1, 0, 2, 2)))


def test_eigenvalue_plot_scores_must_be_a_dict():
    with pytest.raises(TypeError, match=r"^scores must be a dict \{name: \[n_layers, n_heads\] array\} "
                                        r"\(e\.g\. pcw\.head_scores\(model\)\) or None, got list$"):
        pcw.EigenvaluePlot(tiny_model(1), scores=[[0.1, 0.2, 0.3, 0.4]])


@pytest.mark.browser
def test_circuit_views_say_which_embedding_they_read(show):
    m1, m2 = tiny_model(1), tiny_model(2, seed=1)
    table, plot = pcw.SkipTrigramTable(m1), pcw.EigenvaluePlot(m2, scores={})
    assert table._embedding_note == embedding_note(m1) and "exact" in table._embedding_note
    assert plot._embedding_note == embedding_note(m2) and "later layers read the raw W_E" in plot._embedding_note
    view = show(table, plot)
    notes = view.page.get_by_test_id("embedding-note")
    view.wait_until(lambda: notes.count() == 2, what="two embedding notes")
    assert notes.all_inner_texts() == [embedding_note(m1), embedding_note(m2)]


def test_a_raw_hugging_face_model_or_a_hub_name_points_to_from_hf():
    import transformers  # a test dependency (tests/test_adapters_hf.py)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8, bos_token_id=0,
                                  eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(TypeError, match=r"weight view .*GPT2LMHeadModel is a Hugging Face model: read it through "
                                        r"pcw\.from_hf\(model, tokenizer\)"):
        pcw.EigenvaluePlot(hf)
    with pytest.raises(TypeError, match=r"got str without .*use pcw\.from_hf\('gpt2'\)"):
        pcw.CircuitExplorer("gpt2", "some text")
    with pytest.raises(ValueError, match=r"unknown pretrained model 'gpt2'; valid names: .*use pcw\.from_hf\('gpt2'\)"):
        pcw.load_pretrained("gpt2")
    with pytest.raises(TypeError, match=r"takes the name of a shipped model .*got GPT2LMHeadModel.*pcw\.from_hf"):
        pcw.load_pretrained(hf)
