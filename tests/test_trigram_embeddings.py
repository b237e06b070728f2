"""The skip-trigram view read through a chosen embedding (``SkipTrigramTable(embedding=)``, issue "Circuits
at depth"): a head of layer >= 1 read through ``W_E`` + block 0 or the corpus stream gets the table
``head_table(..., embedding=)`` gives (the analysis, checked against dense float64 circuits in
``test_effective_embedding.py``), a layer-0 head keeps ``W_E`` (exact there) whatever the choice, the
view says what it read, and a choice it cannot make is refused by name."""

import json

import numpy as np
import pytest
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
