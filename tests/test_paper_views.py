"""PathExpansion, InductionMechanism, PositionalQK, VirtualHeads, BigramTable: every number a view
embeds equals the analysis function's (and a dense oracle where the analysis tests have none);
selection validation; bad input shows an error and keeps the last good state.

Tolerances (``tests/tolerance.py``): a view's numbers against the analysis's own results within ``COPY``
(one float32 copy's rounding); the path-expansion contributions are saved as float16 (``gamma(2)`` in
float16: a float16 copy, perhaps through float32) against a float64 dense oracle, and their sum against
the float64 logits within ``path_expansion_tol`` plus each term's float16 rounding."""

import numpy as np
import pytest
import torch
import traitlets

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import path_expansion, run
from pycircuits_widgets.analysis.bigrams import bigram_top
from pycircuits_widgets.analysis.induction import induction_pair
from pycircuits_widgets.analysis.positional import attention_by_offset, positional_scores_by_offset
from pycircuits_widgets.analysis.virtual_heads import top_virtual_heads
from pycircuits_widgets.widgets.core.selection import pair_key
from random_models import custom_model, paper_model
from tolerance import COPY, gamma, path_expansion_tol

TEXT = "t1 t5 t9 t2 t1 t5 t9 t2 t7 t3"


@pytest.fixture(scope="module")
def m2():
    return paper_model(n_layers=2, n_heads=3, d_vocab=40, n_ctx=16, seed=2)


# -- PathExpansion --------------------------------------------------------------------------
def test_path_expansion_embeds_ladder_importance_and_next_token_contributions(m2):
    w = pcw.PathExpansion(m2, TEXT)
    pe = path_expansion(m2, TEXT)
    assert [t["name"] for t in w.terms] == [t.name for t in pe.terms]
    assert len(w.terms) == (1 + 3) ** 2 and {"name": "L0.H2 → L1.H1", "heads": [[0, 2], [1, 1]], "order": 2} in w.terms
    ladder = [r["loss"] for r in w.ladder]
    assert [r["label"] for r in w.ladder] == ["direct path only", "+ single heads", "+ virtual heads", "full model"]
    np.testing.assert_allclose(ladder[:3], pe.loss_by_order().numpy(), **COPY)
    assert ladder[3] == pytest.approx(float(run(m2, TEXT).loss), rel=COPY["rtol"], abs=0)  # the full model, not the expansion
    np.testing.assert_allclose(w.importance, pe.term_importance().numpy(), **COPY)
    # dense oracle for the contributions: the direct path is x0 / s_final @ W_U, centred over the vocab
    _, cache = m2.run_with_cache(pe.tokens)
    direct = (cache.embed / cache.ln_scale[:, -1, :, None] @ m2.W_U)[0, :-1]
    nxt = pe.tokens[0, 1:]
    ref = direct[torch.arange(len(nxt)), nxt] - direct.mean(-1)
    contributions = w.contributions
    assert contributions.shape == (16, 9)
    assert contributions.dtype == np.float16  # saved with the page: float16, 2^-11 relative rounding
    # float64 model: the two routes differ by float64 rounding (< 1e-12 here), far below float16's; a
    # float16 subnormal (below 2^-14) is within half its spacing 2^-24
    np.testing.assert_allclose(contributions[0], ref.numpy(), rtol=gamma(2, torch.float16), atol=2**-25 + 1e-12)
    # all terms together: the sum of contributions is the full model's centred next-token logit
    logits = pe.logits[0, :-1]
    full = logits[torch.arange(len(nxt)), nxt] - logits.mean(-1)
    total, full = contributions.astype(np.float64).sum(0), full.double().numpy()
    rounding = np.abs(contributions.astype(np.float64)).sum(0) * 2**-11  # each term's float16 rounding, at most
    assert np.all(np.abs(total - full) <= path_expansion_tol(m2, pe) + rounding)


def test_path_expansion_selection_and_bad_text_keep_the_last_good_state(m2):
    w = pcw.PathExpansion(m2, TEXT, position=3)
    w.selected_pair = [0, 2, 1, 1]
    assert (w.layer, w.head) == (1, 1)  # a virtual term selects the pair and its later head
    with pytest.raises(traitlets.TraitError, match="at least 2"):
        w.text = "t3"
    assert w.text == TEXT and len(w.tokens) == 10
    w.set_state({"text": "t1 t2 t99"})  # from the browser: shown as an error, not applied
    assert "text refused" in w.error and w.text == TEXT
    w.text = "t1 t2 t3"
    assert len(w.tokens) == 3 and w.contributions.shape == (16, 2) and w.position == -1
    for bad in ({"position": 3}, {"selected_pair": [1, 0, 0, 1]}, {"layer": 2}):
        w.set_state(bad)
        assert w.error and w.position == -1 and w.selected_pair == [0, 2, 1, 1] and w.layer == 1
    with pytest.raises(TypeError, match="unexpected keyword"):
        pcw.PathExpansion(m2, TEXT, postion=2)
    # with MLPs: each MLP's output is a source; the terms still sum to the logits
    mlp_model = custom_model(attn_only=False, d_mlp=8, act_fn="relu")
    pm = pcw.PathExpansion(mlp_model, TEXT)
    assert pm.wait(30) and not pm.error and "MLP" in pm.expansion_note
    ref = path_expansion(mlp_model, mlp_model.to_tokens(TEXT))
    assert [t["name"] for t in pm.terms] == [t.name for t in ref.terms] and "MLP0 → L1.H2" in [t.name for t in ref.terms]
    np.testing.assert_allclose(pm.importance, ref.term_importance().numpy(), **COPY)


# -- InductionMechanism ---------------------------------------------------------------------
def test_induction_view_embeds_every_verdict_and_the_tables_it_names(m2):
    w = pcw.InductionMechanism(m2, k=6, n_tables=2)
    assert len(w.pairs) == 9 and len(w.tables) == 2
    best = max(w.pairs, key=lambda key: w.pairs[key]["k_score"])
    assert w.selected_pair == [int(x) for x in best.split(",")] and (w.layer, w.head) == tuple(w.selected_pair[2:])
    for key, info in w.pairs.items():
        l1, h1, l2, h2 = map(int, key.split(","))
        ref = induction_pair(m2, (l1, h1), (l2, h2), k=6)
        copied = pytest.approx([ref.qk_positivity, ref.ov_positivity, ref.k_score], rel=COPY["rtol"], abs=0)
        assert [info["qk_positivity"], info["ov_positivity"], info["k_score"]] == copied
        assert (info["kind"], info["sentence"]) == (ref.kind, ref.sentence)
        if key in w.tables:
            t = w.tables[key]
            np.testing.assert_allclose(t["values"], ref.top_values.numpy(), **COPY)
            assert t["tokens"].tolist() == [ref.top_dest.tolist(), ref.top_src.tolist()]
            assert t["diagonal_rank"] == pytest.approx(ref.diagonal_rank, rel=COPY["rtol"], abs=0)
            assert all(w.strings[str(i)] == f"t{i}" for i in t["tokens"].reshape(-1).tolist())
    missing = next(k for k in w.pairs if k not in w.tables)
    w.selected_pair = [int(x) for x in missing.split(",")]  # the kernel computes the table on selection
    assert missing in w.tables and len(w.tables) == 3
    w.set_state({"selected_pair": [0, 0, 0, 1]})
    assert "selected_pair must be" in w.error and w.selected_pair == [int(x) for x in missing.split(",")]
    with pytest.raises(ValueError, match="at least 2 layers"):
        pcw.InductionMechanism(paper_model(n_layers=1))
    # rotary: each pair at the offset of its largest K-composition QK positivity, named in its verdict
    rot = pcw.InductionMechanism(custom_model(positional="rotary", normalization="rmsnorm"), offsets=range(0, 4), n_tables=1)
    assert rot.wait(30) and not rot.error and "at the strongest of query - key offsets 0..3" in rot.offset_note
    key = pair_key(rot.selected_pair)
    ref = induction_pair(rot.model, tuple(rot.selected_pair[:2]), tuple(rot.selected_pair[2:]), k=12, offset=range(0, 4))
    assert rot.pairs[key]["offset"] == ref.offset and rot.pairs[key]["sentence"].startswith(f"At query - key offset {ref.offset}")
    assert rot.pairs[key]["qk_positivity"] == pytest.approx(ref.qk_positivity, rel=COPY["rtol"], abs=0)
    np.testing.assert_allclose(rot.tables[key]["values"], ref.top_values.numpy(), **COPY)


# -- PositionalQK ---------------------------------------------------------------------------
def test_positional_view_embeds_both_curves_for_every_head(m2):
    w = pcw.PositionalQK(m2, TEXT, max_offset=4, layer=1, head=2)
    out = run(m2, TEXT)
    np.testing.assert_allclose(w.positional, positional_scores_by_offset(m2, 10, 4).numpy(), **COPY)
    np.testing.assert_allclose(w.measured, attention_by_offset(out.patterns[0], 4).numpy(), **COPY)
    assert w.n_tokens == 10 and "W_pos" in w.rule
    w.text = "t1 t2 t3"  # offsets clip to the text's length
    assert w.measured.shape == (2, 3, 3)
    w.set_state({"text": "t1"})
    assert "text refused" in w.error and w.text == "t1 t2 t3"
    rot = custom_model(positional="rotary")
    wr = pcw.PositionalQK(rot, TEXT, max_offset=3)
    assert "rotary rule" in wr.rule
    np.testing.assert_allclose(wr.positional,
                               positional_scores_by_offset(rot, 10, 3, cache=run(rot, TEXT).cache).numpy(), **COPY)
    with pytest.raises(ValueError, match="no positional information"):
        pcw.PositionalQK(custom_model(positional="none"), TEXT)


# -- VirtualHeads and BigramTable -----------------------------------------------------------
def test_virtual_heads_view_lists_the_analysis_rows_and_selects_pairs(m2):
    w = pcw.VirtualHeads(m2, k=5, n_copies=3)
    ref = top_virtual_heads(m2, 5, 3)
    assert [r["pair"] for r in w.heads] == [[*v.h1, *v.h2] for v in ref]
    assert [r["norm"] for r in w.heads] == pytest.approx([v.norm for v in ref], rel=COPY["rtol"], abs=0)
    assert [r["positivity"] for r in w.heads] == pytest.approx([v.positivity for v in ref], rel=COPY["rtol"], abs=0)
    assert [[c["id"] for c in r["copies"]] for r in w.heads] == [[i for i, _ in v.copies] for v in ref]
    w.set_state({"selected_pair": w.heads[1]["pair"]})
    assert not w.error and (w.layer, w.head) == tuple(w.heads[1]["pair"][2:])


def test_bigram_table_embeds_every_row_for_small_vocabularies_and_computes_others_on_selection(monkeypatch):
    m0 = pcw.load_pretrained("attn-only-0l")
    w = pcw.BigramTable(m0, k=4, token=17)
    values, ids = bigram_top(m0, 4)
    assert w.complete and w.rows == [] and w.row_tokens() == list(range(m0.cfg.d_vocab)) and w.vocab == list(m0.token_strings)
    np.testing.assert_array_equal(w.top_ids, ids.numpy())
    np.testing.assert_allclose(w.top_logits, values.numpy(), rtol=gamma(1, torch.float16))  # a float16 copy in the page
    from pycircuits_widgets.widgets.views import bigram_table
    monkeypatch.setattr(bigram_table, "EMBED_ALL_MAX_VOCAB", 100)  # a "large" vocabulary: rows on demand
    w = pcw.BigramTable(m0, k=4, token=17)
    assert not w.complete and w.rows == [17]
    w.token = 300
    assert w.rows == [17, 300]
    np.testing.assert_array_equal(w.top_ids, ids[[17, 300]].numpy())
    w.set_state({"token": m0.cfg.d_vocab})
    assert "token must be" in w.error and w.token == 300
    # as the explorer builds it (inactive): a selected token's row still comes from the kernel
    idle = pcw.BigramTable(m0, k=4, active=False)
    idle.set_state({"token": 300})
    assert idle.wait(10) and not idle.active and idle.rows == [300]
    np.testing.assert_array_equal(idle.top_ids, ids[[300]].numpy())
    monkeypatch.setattr(bigram_table, "EMBED_ALL_MAX_VOCAB", m0.cfg.d_vocab)  # small: the click starts the table
    small = pcw.BigramTable(m0, k=4, active=False)
    small.set_state({"token": 5})
    assert small.wait(10) and small.active and small.complete and small.row_tokens() == list(range(m0.cfg.d_vocab))


def test_bigram_rows_computed_by_a_superseded_request_are_shown_by_the_next(monkeypatch):
    """A token clicked, then "compute": the first request's rows, computed but its answer dropped as
    stale, are what the second answers with (it computed nothing new and had answered nothing)."""
    m0 = pcw.load_pretrained("attn-only-0l")
    from pycircuits_widgets.widgets.views import bigram_table
    monkeypatch.setattr(bigram_table, "EMBED_ALL_MAX_VOCAB", 100)
    w = pcw.BigramTable(m0, k=4, active=False)
    for _ in w._rows_steps([300]):  # the first request ran to the end; its answer never applied
        pass
    answers = list(w._rows_steps([300]))
    _, ids = bigram_top(m0, 4)
    assert len(answers) == 1 and answers[0]["rows"] == [300]
    np.testing.assert_array_equal(answers[0]["top_ids"], ids[[300]].numpy())


def test_the_readme_paper_views_example_runs_as_written():
    """The README's "Path expansion ..." block is self-contained: it defines what it uses."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Path expansion, the induction mechanism, positions\n", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(block, "README.md (paper views example)", "exec"), namespace)
    assert isinstance(namespace["model"], pcw.models.CircuitModel)
