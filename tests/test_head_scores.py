"""Head scores: against TransformerLens's detection patterns, a dense loop, and the induction
criteria of the shipped 2-layer model.

Tolerances: the scores are sums of nonnegative attention weights (float32): relative errors ``gamma`` of
their lengths, on each side."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformer_lens import head_detector as tl

from pycircuits_widgets.analysis.head_scores import head_scores, repeated_random_tokens
from pycircuits_widgets.models import load_pretrained
from tolerance import gamma, gamma_tilde

TL_PATTERNS = {
    "previous_token": tl.get_previous_token_head_detection_pattern,
    "duplicate_token": tl.get_duplicate_token_head_detection_pattern,
    "induction": tl.get_induction_head_detection_pattern,
}


@pytest.fixture(scope="module")
def model():
    return load_pretrained("attn-only-2l")


def test_scores_agree_with_transformer_lens_detector(model):
    """TL's "mul" score divides by all positions; ours by positions that have a target."""
    tokens = repeated_random_tokens(model, seq_len=20, n_repeats=3, batch=1, seed=3)[0]
    tokens[5] = tokens[2]  # a chance repeat inside the first block too
    ours = head_scores(model, tokens)
    _, cache = model.run_with_cache(tokens)
    pos = len(tokens)
    # ours: a row's sum, then the mean over rows; theirs: sums over the whole pattern, of the product and
    # of the pattern itself (its rows sum to 1 within the softmax's gamma(pos + 2)): nonnegative terms
    rel = 2 * gamma_tilde(pos * pos + 2 * pos + 4)
    for name, detection in TL_PATTERNS.items():
        target = detection(tokens[None].cpu())
        n_with_target = int((target.sum(-1) > 0).sum())
        for layer in range(model.cfg.n_layers):
            for head in range(model.cfg.n_heads):
                theirs = tl.compute_head_attention_similarity_score(
                    cache.patterns[0, layer, head].clone(), target,
                    exclude_bos=False, exclude_current_token=False, error_measure="mul")
                assert ours[name][layer, head].item() * n_with_target / pos == pytest.approx(theirs, rel=rel)


def test_scores_match_a_dense_loop_on_text(model):
    text = "for x in xs:\n    print(x)\nfor y in ys:\n    print(y)\n"
    ours = head_scores(model, text)
    _, cache = model.run_with_cache(text)
    t = cache.tokens[0].tolist()
    rel = 2 * gamma(2 * len(t) + 2)  # two float32 sums of nonnegative weights (a row's, the rows' mean)
    for layer in range(model.cfg.n_layers):
        for head in range(model.cfg.n_heads):
            A = cache.patterns[0, layer, head]
            prev = [A[i, i - 1] for i in range(1, len(t))]
            dup = [sum(A[i, j] for j in range(i) if t[j] == t[i]) for i in range(len(t)) if t[i] in t[:i]]
            ind = [sum(A[i, j] for j in range(1, i + 1) if t[j - 1] == t[i]) for i in range(len(t)) if t[i] in t[:i]]
            for name, values in (("previous_token", prev), ("duplicate_token", dup), ("induction", ind)):
                assert ours[name][layer, head].item() == pytest.approx(float(sum(values) / len(values)), rel=rel)


def test_score_without_targets_is_nan(model):
    scores = head_scores(model, torch.arange(1, 9))
    assert torch.isnan(scores["duplicate_token"]).all() and not torch.isnan(scores["previous_token"]).any()


def test_shipped_two_layer_model_has_induction(model):
    """Second repeat of random tokens: loss at most half the first; an induction head and a
    previous-token head with score >= 0.5."""
    seq_len = 50
    tokens = repeated_random_tokens(model, seq_len=seq_len, n_repeats=2, batch=8, seed=0)
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    first, second = loss[:, : seq_len - 1].mean().item(), loss[:, seq_len:].mean().item()
    assert second <= 0.5 * first, (first, second)
    scores = head_scores(model)
    assert scores["induction"][1].max() >= 0.5
    assert scores["previous_token"][0].max() >= 0.5
    assert not math.isnan(scores["duplicate_token"].max())


def test_one_layer_model_has_no_induction_head():
    """Induction needs K-composition with an earlier previous-token head: one layer cannot."""
    scores = head_scores(load_pretrained("attn-only-1l"))
    assert scores["induction"].max() < 0.5


def test_shipped_two_layer_model_has_the_five_induction_heads_the_readme_names(model):
    """README and notebook 03: L1.H6, L1.H5, L1.H7, L1.H3, L1.H2 score 0.65-0.73, the rest < 0.01."""
    induction = head_scores(model)["induction"]
    strong = {(l, h) for l in range(2) for h in range(8) if induction[l, h] > 0.5}
    assert strong == {(1, 6), (1, 5), (1, 7), (1, 3), (1, 2)}
    assert 0.65 <= float(induction[1, 2]) <= float(induction[1].max()) <= 0.73
    assert float(induction[1, [0, 1, 4]].max()) < 0.01 and float(induction[0].max()) < 0.01


def repeat_loss_ratio(model, seq_len: int, seed: int) -> float:
    tokens = repeated_random_tokens(model, seq_len=seq_len, n_repeats=2, batch=8, seed=seed)
    with torch.no_grad():
        loss = F.cross_entropy(model(tokens)[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    return loss[:, seq_len:].mean().item() / loss[:, : seq_len - 1].mean().item()


def test_repeat_loss_ratio_depends_on_the_sequence_length(model):
    """README: 0.47-0.49 at 5 tokens, 0.37-0.42 at 50 (seeds 0-2): the ratio is not one number."""
    short = [repeat_loss_ratio(model, 5, seed) for seed in range(3)]
    long = [repeat_loss_ratio(model, 50, seed) for seed in range(3)]
    assert all(0.45 <= r <= 0.51 for r in short), short
    assert all(0.35 <= r <= 0.44 for r in long), long
    assert min(short) - max(long) > 0.03


def test_the_random_tokens_arguments_are_refused_with_tokens_given_and_checked_without(model):
    # with tokens given seq_len was ignored (seq_len=0 gave the scores of the whole text, no error)
    with pytest.raises(TypeError, match=r"head_scores: seq_len, batch are for the random tokens .tokens=None.; got "
                                        r"seq_len=0, batch=3 with tokens"):
        head_scores(model, "def f(x): return x", seq_len=0, batch=3)
    for kwargs, error, message in (({"seq_len": 0}, ValueError, "seq_len must be a positive int, got 0"),
                                   ({"seq_len": "8"}, ValueError, "seq_len must be a positive int, got '8'"),
                                   ({"batch": 0}, ValueError, "batch must be a positive int, got 0"),
                                   ({"n_repeats": 1.5}, ValueError, "n_repeats must be a positive int, got 1.5"),
                                   ({"seed": "0"}, TypeError, "seed must be an int, got '0'")):
        with pytest.raises(error, match=message):
            head_scores(model, **kwargs)
