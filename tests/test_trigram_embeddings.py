"""The skip-trigram view read through a chosen embedding (``SkipTrigramTable(embedding=)``, issue "Circuits
at depth"): a head of layer >= 1 read through ``W_E`` + block 0 or the corpus stream gets the table
``head_table(..., embedding=)`` gives (the analysis, checked against dense float64 circuits in
``test_effective_embedding.py``), a layer-0 head keeps ``W_E`` (exact there) whatever the choice, the
view says what it read, and a choice it cannot make is refused by name."""

import json

import numpy as np
import pytest
import torch
import traitlets

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.skip_trigrams import head_table
from pycircuits_widgets.models.corpus import corpus_documents


@pytest.fixture(scope="module")
def model():
    return pcw.load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def sweep(model, tmp_path_factory):
    corpus = pcw.Corpus.from_texts(corpus_documents("pydoc")[:4])
    return pcw.sweep(model, corpus, tmp_path_factory.mktemp("sweep"), seq_len=32, max_windows=8, progress=False)


def columns(trigrams) -> dict:
    return {name: np.asarray(trigrams[name]) for name in ("src", "dest", "out", "score")}


def same_table(view, table) -> bool:
    shown = columns(view.trigrams)
    return all(np.array_equal(shown[a], table[b].numpy().astype(shown[a].dtype)) for a, b in
               (("src", "source"), ("dest", "destination"), ("out", "out"), ("score", "score")))


def as_table(t):
    return {"source": t.source, "destination": t.destination, "out": t.out, "score": t.score}


def test_a_deeper_head_read_through_block_0_is_head_table_through_it(model):
    view = pcw.SkipTrigramTable(model, layer=1, head=6, k=12)
    assert view.read_through == "W_E"
    raw = columns(view.trigrams)
    view.embedding = "mlp0"
    expected = head_table(model, 1, 6, 12, approximate=True, embedding="mlp0")
    assert same_table(view, as_table(expected))
    assert view.read_through.startswith("W_E + block 0: ") and "left out" in view.read_through
    assert not all(np.array_equal(raw[c], columns(view.trigrams)[c]) for c in raw)  # another reading
    view.layer = 0  # a layer-0 head reads the embedding itself: W_E, whatever the choice
    assert same_table(view, as_table(head_table(model, 0, 6, 12, approximate=True)))
    assert view.read_through == "W_E (a layer-0 head reads the embedding itself)"


def test_the_corpus_stream_needs_a_sweep_and_reads_its_mean_streams(model, sweep):
    alone = pcw.SkipTrigramTable(model, layer=1, head=6, k=8)
    with pytest.raises(traitlets.TraitError, match="the corpus stream needs a sweep"):
        alone.embedding = "corpus"
    assert alone.embedding == "raw" and "needs a sweep" in alone.embedding_kinds["corpus"]
    view = pcw.SkipTrigramTable(model, layer=1, head=6, k=8, sweep=sweep, embedding="corpus")
    emb = pcw.effective_embedding(model, 1, "corpus", sweep=sweep)
    assert same_table(view, as_table(head_table(model, 1, 6, 8, approximate=True, embedding=emb)))
    assert view.read_through.startswith(f"the corpus stream at layer 1 ({len(emb.tokens):,} tokens seen)")
    assert set(np.asarray(view.trigrams["src"]).tolist()) <= set(emb.tokens.tolist())  # only tokens it saw


def test_the_explorer_offers_the_choice_in_its_trigram_section_and_a_page_keeps_the_shown_table(model, tmp_path):
    explorer = pcw.CircuitExplorer(model, "def f(x):\n    return x\n", layer=1, head=6)
    trigrams = explorer.trigrams
    trigrams.set_state({"embedding": "mlp0"})  # as the section's buttons write it
    assert trigrams.error == "" and trigrams.read_through.startswith("W_E + block 0")
    page = explorer.save_html(tmp_path / "page.html").read_text()
    assert json.dumps(trigrams.read_through)[1:-1] in page  # the page says what its table read


def centred_ov_diagonal(model, layer: int, head: int, vectors, tokens):
    """Float64, dense: the diagonal of ``E W_V W_O W_U[:, tokens]`` with each row centred over ``tokens``."""
    full = vectors.double() @ model.W_V[layer, head].double() @ model.W_O[layer, head].double() \
        @ model.W_U[:, tokens].double()
    return (full - full.mean(1, keepdim=True)).diagonal()


def test_the_eigenvalue_plot_reads_every_deeper_head_through_the_chosen_embedding(model, sweep):
    """The scatter is ``eigenvalue_positivity(embedding=)`` (checked against dense spectra in
    ``test_effective_embedding.py``), layer 0 keeps W_E, and the detail's copied tokens are the top of the
    dense centred OV diagonal over the embedding's tokens (within float32 rounding of the products)."""
    view = pcw.EigenvaluePlot(model, sweep=sweep, layer=1, head=6, n_copies=8)
    raw = np.asarray(view.ov_positivity).copy()
    assert view.read_through == ""
    for kind in ("mlp0", "corpus"):
        view.embedding = kind
        assert view.wait() and view.error == ""
        for circuit, shown in (("OV", view.ov_positivity), ("QK", view.qk_positivity)):
            want = pcw.eigenvalue_positivity(model, circuit, embedding=kind, sweep=sweep if kind == "corpus" else None)
            np.testing.assert_array_equal(np.asarray(shown), want.numpy())
        np.testing.assert_array_equal(np.asarray(view.ov_positivity)[0], raw[0])  # layer 0 reads W_E itself
        assert not np.array_equal(np.asarray(view.ov_positivity)[1], raw[1])
        assert view.read_through.startswith({"mlp0": "W_E + block 0", "corpus": "the corpus stream"}[kind])
        emb = pcw.effective_embedding(model, 1, kind, sweep=sweep if kind == "corpus" else None)
        diagonal = centred_ov_diagonal(model, 1, 6, emb.vectors, emb.tokens)
        copies = view.detail["copies"]
        got = [c["id"] for c in copies]
        assert len(got) == 8 and set(got) <= set(emb.tokens.tolist())
        shown = torch.tensor([c["score"] for c in copies], dtype=torch.float64)
        at = torch.searchsorted(emb.tokens, torch.tensor(got))
        magnitude = (emb.vectors.double().abs() @ model.W_V[1, 6].double().abs() @ model.W_O[1, 6].double().abs()
                     @ model.W_U[:, emb.tokens].double().abs())
        scale = (magnitude.diagonal() + magnitude.mean(1))[at]  # the entry and the row mean centring subtracts
        # float32 products of reduction lengths d_model, d_head and d_model, each computed two ways
        n = 2 * model.cfg.d_model + model.cfg.d_head
        tol = 2 * n * torch.finfo(torch.float32).eps * scale
        assert torch.all((shown - diagonal[at]).abs() <= tol)
        kth = diagonal.topk(8).values[-1]
        assert torch.all(diagonal[at] >= kth - 2 * tol.max())  # the top 8 of the dense diagonal
    alone = pcw.EigenvaluePlot(model)
    with pytest.raises(traitlets.TraitError, match="the corpus stream needs a sweep: EigenvaluePlot"):
        alone.embedding = "corpus"
    view.close()
    alone.close()
