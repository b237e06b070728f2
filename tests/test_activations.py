"""run(): tokens, strings, logits, loss and patterns against the model's own forward pass."""

import pytest
import torch
import torch.nn.functional as F

from pycircuits_widgets.analysis import run
from pycircuits_widgets.models import CHECKPOINT_DIR, Tokenizer
from random_models import paper_model


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=2, d_vocab=40, dtype=torch.float32)


def test_run_on_token_ids_matches_forward_and_cross_entropy(model):
    tokens = torch.tensor([[3, 9, 27, 3, 9, 1], [5, 5, 0, 39, 12, 7]])
    out = run(model, tokens)
    assert out.tokens.tolist() == tokens.tolist()
    torch.testing.assert_close(out.logits, model.forward(tokens))
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 40), tokens[:, 1:].reshape(-1), reduction="none")
    torch.testing.assert_close(out.token_loss, expected.reshape(2, 5))
    torch.testing.assert_close(out.loss, expected.mean())
    assert out.patterns.shape == (2, 2, 3, 6, 6)
    torch.testing.assert_close(out.patterns.sum(-1), torch.ones(2, 2, 3, 6))
    assert torch.all(out.patterns.triu(1) == 0)  # causal
    assert out.str_tokens[1][:2] == ["t5", "t5"]
    assert run(model, [3, 9, 27]).tokens.shape == (1, 3)


def test_run_on_text_uses_the_model_tokenizer(model):
    tok = Tokenizer.load(CHECKPOINT_DIR / "tokenizer.json")
    m = paper_model(n_layers=1, d_vocab=tok.vocab_size, dtype=torch.float32)
    m.tokenizer, m._token_strings = tok, None
    out = run(m, "def f(x):\n    return x")
    assert out.tokens[0].tolist() == tok.encode("def f(x):\n    return x")
    assert "".join(out.str_tokens[0]).replace("·", " ").replace("↵", "\n").startswith("def")
    assert out.logits.shape == (1, out.tokens.shape[1], tok.vocab_size)


def test_bad_inputs_are_named(model):
    with pytest.raises(ValueError, match="n_ctx"):
        run(model, torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="0..39"):
        run(model, [1, 40])
    with pytest.raises(TypeError, match="integers"):
        run(model, torch.zeros(1, 3))
