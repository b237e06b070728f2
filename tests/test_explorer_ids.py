"""The explorer on token ids (models without a tokenizer), and tokenizers that do not fit the model."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import run
from random_models import custom_model
from tolerance import COPY

IDS = [5, 9, 2, 5, 9, 2, 31]


@pytest.fixture(scope="module")
def bare():
    model = custom_model(positional="rotary", attn_only=False, d_mlp=16, act_fn="gelu", dtype=torch.float32)
    model.tokenizer = None
    return model


@pytest.mark.parametrize("ids", [IDS, torch.tensor(IDS), np.array(IDS), torch.tensor([IDS])],
                         ids=["list", "tensor", "numpy", "batch of one"])
def test_ids_give_a_model_without_a_tokenizer_every_view(bare, ids):
    e = pcw.CircuitExplorer(bare, ids)
    assert e.token_ids == IDS and e.tokens == [f"<id {i}>" for i in IDS] and e.text == "5 9 2 5 9 2 31"
    assert not e.notices and e.model.W_E is bare.W_E  # a view of the same weights, not a copy
    expected = run(bare, torch.tensor(IDS))
    np.testing.assert_allclose(e.mean_loss, float(expected.loss), **COPY)  # run's own loss, copied
    assert e.attention.tokens == e.tokens and e.loss.tokens == e.tokens[1:]
    e.text = "9 9 31"  # a reader edits the ids
    assert e.token_ids == [9, 9, 31] and e.tokens == ["<id 9>", "<id 9>", "<id 31>"]


def test_bad_ids_and_text_without_a_tokenizer_are_refused_clearly(bare):
    with pytest.raises(ValueError, match="no tokenizer, and reading text needs a tokenizer .* or pass token ids"):
        pcw.CircuitExplorer(bare, "hello")
    with pytest.raises(ValueError, match=r"token id 40 out of range: token ids must lie in 0..39"):
        pcw.CircuitExplorer(bare, [1, 40])
    with pytest.raises(ValueError, match="reads one sequence"):
        pcw.CircuitExplorer(bare, [[1, 2], [3, 4]])
    e = pcw.CircuitExplorer(bare, [1, 2])
    e.set_state({"text": "1 two"})
    assert "'two' is not an id" in e.error and e.token_ids == [1, 2]


def _hf_tokenizer(size):
    vocab = {f"t{i}": i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_tokenizer_that_does_not_fit_the_vocabulary_is_refused_with_both_sizes():
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                                              n_head=2)).eval()
    for size in (40, 60):  # another model's tokenizer: fewer ids, or ids past the model's
        model = pcw.from_hf(hf, _hf_tokenizer(size))
        with pytest.raises(ValueError, match=f"the tokenizer has {size} tokens but the model's vocabulary has 50"):
            pcw.CircuitExplorer(model, "t1 t2")
    assert pcw.CircuitExplorer(pcw.from_hf(hf, _hf_tokenizer(50)), "t1 t2 t3").token_ids == [1, 2, 3]
    padded = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                                                  n_head=2)).eval()
    # an embedding padded to a multiple of 64 (as Pythia's, Qwen's) fits a smaller tokenizer
    assert pcw.CircuitExplorer(pcw.from_hf(padded, _hf_tokenizer(50)), "t4 t5").token_ids == [4, 5]


def test_notices_and_the_header_name_the_model_as_its_user_does():
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2,
                                                              n_head=2)).eval()
    hf.config._name_or_path = "/usr/lib/python3/site-packages/somepkg/models/tiny-gpt2/"
    model = pcw.from_hf(hf)
    assert pcw.CircuitExplorer(model, [1, 2, 3]).model_name == "tiny-gpt2"
    with pytest.raises(ValueError) as refusal:
        pcw.skip_trigrams(model, 0, 0)
    assert "'tiny-gpt2' has 2 layers and MLPs" in str(refusal.value) and "site-packages" not in str(refusal.value)


def test_a_large_vocabulary_rotary_explorer_reads_skip_trigrams_over_a_shorter_window(bare, monkeypatch):
    from pycircuits_widgets.widgets.views import registry
    monkeypatch.setattr(pcw.SkipTrigramTable, "partial_above", 16)  # "large": the tiny model's 40 tokens
    monkeypatch.setattr(registry, "LARGE_VOCAB_TRIGRAM_OFFSETS", 3)
    e = pcw.CircuitExplorer(bare, IDS)
    assert e.trigrams.offsets == [0, 1, 2] and e.composition.offsets == list(range(len(IDS)))
