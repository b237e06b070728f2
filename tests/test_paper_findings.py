"""The paper's findings, reproduced on the shipped checkpoints (trained offline on CPython text).

Printed tables (run with ``-s``) are what the README quotes.
"""

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import composition_detail, composition_scores, positional_qk_circuit


@pytest.fixture(scope="module")
def one_layer():
    return pcw.load_pretrained("attn-only-1l")


@pytest.fixture(scope="module")
def two_layer():
    return pcw.load_pretrained("attn-only-2l")


def test_one_layer_most_heads_copy(one_layer):
    pos = pcw.eigenvalue_positivity(one_layer, "OV")
    print("\n1-layer OV positivity per head:", [round(float(p), 2) for p in pos[0]])
    assert (pos > 0).float().mean() > 0.5


@pytest.fixture(scope="module")
def common_tokens(one_layer):
    """Token ids seen at least 20 times in CPython's pydoc topics (part of the training corpus):
    never-seen tokens keep near-initial embeddings, and their circuits are noise."""
    from pydoc_data.topics import topics

    ids = torch.tensor(one_layer.tokenizer.encode("\n".join(topics[k] for k in sorted(topics))))
    counts = torch.bincount(ids, minlength=one_layer.cfg.d_vocab)
    return torch.nonzero(counts >= 20).squeeze(1)


def test_one_layer_skip_trigrams_are_text_patterns(one_layer, common_tokens):
    # the paper's two kinds of skip-trigram: copying ("[a] ... [b] -> [a]": out is the source)
    # and same-token attention ("[a] ... [a] -> [b]": the current token seen earlier); text
    # is compared up to the visible leading space
    H = one_layer.cfg.n_heads
    copies = 0
    for h in range(H):
        tri = pcw.skip_trigrams(one_layer, 0, h, k=8, vocab=common_tokens)
        assert len(tri) == 8 and all(t.score > 0 for t in tri)
        print(f"\nL0H{h}:", " | ".join(f"{t.source_str!r} ... {t.destination_str!r} -> {t.out_str!r}" for t in tri[:5]))
        same = [t.source_str.strip("·") in (t.out_str.strip("·"), t.destination_str.strip("·")) for t in tri]
        copies += sum(same)
    assert copies >= H  # on average at least one such triple per head among the top 8


def test_two_layer_induction_heads_k_compose_with_a_previous_token_head(two_layer):
    scores = pcw.head_scores(two_layer)
    induction, prev = scores["induction"], scores["previous_token"]
    ind_head = int(induction[1].argmax())
    print(f"\ninduction scores L1: {[round(float(x), 2) for x in induction[1]]}")
    print(f"previous-token scores L0: {[round(float(x), 2) for x in prev[0]]}")
    assert induction[1, ind_head] > 0.3  # a real induction head exists in layer 1
    k_comp = composition_scores(two_layer, "K")[0, :, 1, ind_head]  # over layer-0 heads
    partner = int(k_comp.argmax())
    print(f"K-composition into L1H{ind_head} from L0 heads: {[round(float(x), 3) for x in k_comp]}")
    assert prev[0, partner] > 0.3 and prev[0, partner] >= prev[0].max() - 0.15
    detail = composition_detail(two_layer, "K", (0, partner), (1, ind_head))
    print(f"K-composition term L0H{partner} -> L1H{ind_head}: score {detail.score:.3f} "
          f"(erratum {detail.erratum_scores['erratum_left']:.3f}, baseline {detail.baseline:.3f}), positivity {detail.positivity:.3f}")
    assert detail.positivity > 0.5
    # the induction head copies (OV positivity near +1) as the paper reports
    ov = pcw.eigenvalue_positivity(two_layer, "OV")[1, ind_head]
    print(f"OV positivity of L1H{ind_head}: {float(ov):.3f}")
    assert ov > 0.5


def test_two_layer_previous_token_head_shows_the_sub_diagonal(two_layer):
    prev = pcw.head_scores(two_layer)["previous_token"]
    head = int(prev[0].argmax())
    P = positional_qk_circuit(two_layer, 0, head).dense()[:64, :64]
    P = P.masked_fill(~torch.ones_like(P, dtype=torch.bool).tril(), float("-inf"))
    hits = (P[1:].argmax(1) == torch.arange(63)).float().mean()
    print(f"\nL0H{head} positional QK: argmax at p-1 for {float(hits):.0%} of positions 1..63")
    assert hits > 0.5
