"""The positional view's window follows the head (issue 43): on a text whose tokens repeat with a period
longer than the old fixed window of 16 offsets, the shipped model's induction head attends period - 1
back, and its chart covers that offset and reports it as the peak, not the window's edge."""

import numpy as np
import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.views.positional_qk import MIN_WINDOW, WINDOW_SHARE, head_windows

SEGMENT = " apple river stone cloud table music paper light"  # 24 tokens for the shipped tokenizer
TEXT = SEGMENT * 2  # the second copy attends period - 1 back (a third would also attend 2 periods back)


@pytest.fixture(scope="module")
def model():
    return pcw.load_pretrained("attn-only-2l")


def mean_attention_by_offset(pattern: np.ndarray) -> np.ndarray:
    """``[n, n]`` -> ``[n]``: mean of ``pattern[i, i - k]`` over ``i >= k``, in float64 (the oracle)."""
    n = pattern.shape[0]
    return np.array([np.mean([pattern[i, i - k] for i in range(k, n)]) for k in range(n)], dtype=np.float64)


def test_the_induction_head_s_window_covers_its_offset_past_16(model):
    ids = model.to_tokens(TEXT).tolist()
    period = len(model.to_tokens(SEGMENT))
    assert period > MIN_WINDOW and all(ids[i] == ids[i + period] for i in range(len(ids) - period))
    head = int(pcw.head_scores(model)["induction"][1].argmax())
    oracle = mean_attention_by_offset(pcw.run(model, TEXT).patterns[0, 1, head].double().numpy())
    assert int(oracle.argmax()) == period - 1  # what the head does on this text: period - 1 back

    view = pcw.PositionalQK(model, TEXT, layer=1, head=head)
    last = int(view.window[1, head])
    shown = np.asarray(view.measured[1, head, : last + 1], dtype=np.float64)
    assert last > period - 1  # the peak is inside the window, not its edge
    assert int(shown.argmax()) == period - 1
    mass = oracle * (len(ids) - np.arange(len(ids)))  # all the attention paid k back
    held = np.nonzero(mass >= WINDOW_SHARE * mass.max())[0]
    assert last == held.max() + 1  # every offset where the head's attention is, and one more
    assert last < len(ids) - 1  # not the whole text: the first token's few far-offset looks do not count
    # float32 means of at most n softmax weights against the float64 oracle
    tol = len(ids) * np.finfo(np.float32).eps
    np.testing.assert_allclose(shown, oracle[: last + 1], atol=tol)


def test_a_previous_token_head_keeps_the_short_window():
    measured = torch.zeros(1, 3, 60)  # mean attention by offset on a 60-token text
    measured[0, 0, 1] = 0.9  # previous-token head
    measured[0, 0, 30] = 0.01  # under the share of its largest mass: not a place it attends
    measured[0, 1, 40] = 0.5  # attends 40 back
    measured[0, 2, 1], measured[0, 2, 59] = 0.9, 1.0  # the one position 59 back (the first token): little mass
    assert head_windows(measured, 60).tolist() == [[MIN_WINDOW, 41, MIN_WINDOW]]
    assert head_windows(measured[..., :8], 60).tolist() == [[7, 7, 7]]  # fewer offsets computed: all of them
