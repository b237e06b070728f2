"""Dataset examples (``pcw.DatasetExamples``, the explorer's "examples" section) on a real sweep of the
shipped 2-layer model over 64 windows of 64 tokens of the Python stdlib corpus (k = 8).

Oracles, written here independently of the view: each row's tokens are the sweep's window tokens
around the destination; the attention shown is the window re-run alone through ``run_with_cache``
(float32, compared within ``pattern_tol``); a neuron's activations are the window's ``mlp_post``
recomputed the same way; a window's document is counted from the end-of-text separators of the
windows before it."""

import pytest
import torch
import traitlets

import pycircuits_widgets as pcw
from pycircuits_widgets import DatasetExamples
from pycircuits_widgets.corpus import Corpus
from pycircuits_widgets.models import load_pretrained
from pycircuits_widgets.widgets.core import offline
from pycircuits_widgets.widgets.views import dataset_examples
from pycircuits_widgets.widgets.views.dataset_examples import AFTER, ATTENTION_DECIMALS, BEFORE
from random_models import custom_model
from tolerance import chain_tol, model_forward_length, pattern_tol

T, N, K = 64, 64, 8


@pytest.fixture(scope="module")
def model():
    return load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def swept(model, tmp_path_factory):
    return pcw.sweep(model, Corpus.python_stdlib(), tmp_path_factory.mktemp("sweep") / "store", seq_len=T, k=K,
                     max_windows=N, progress=False)


@pytest.fixture(scope="module")
def other_model(model):
    """Random weights of another shape, the shipped tokenizer."""
    m = custom_model(dtype=torch.float32, n_layers=1, n_heads=2, d_model=32, d_head=16,
                     d_vocab=model.cfg.d_vocab, n_ctx=T, seed=5)
    m.tokenizer = model.tokenizer
    return m


def test_the_explorer_takes_a_sweep_of_its_model_and_refuses_another_models_by_name(model, swept, other_model):
    explorer = pcw.CircuitExplorer(model, "def f(x):\n    return x", sweep=swept)
    try:
        assert explorer.sweep is swept
    finally:
        explorer.close()
    with pytest.raises(ValueError, match="made with model 'attn-only-2l', not with this model"):
        pcw.CircuitExplorer(other_model, "def f(x):", sweep=swept)
    with pytest.raises(TypeError, match="sweep must be a pcw.Sweep"):
        pcw.CircuitExplorer(model, "def f(x):", sweep=str(swept.path))


ROUNDING = 5e-4
"""A value shown has 4 significant digits: within ``ROUNDING * |value|`` of the number computed."""


@pytest.fixture(scope="module")
def examples(model, swept):
    view = DatasetExamples(swept, model, layer=1, head=0)
    yield view
    view.close()


def oracle_documents(swept) -> torch.Tensor:
    """The document of every token of every window: the separators before it in the concatenated windows."""
    flat = swept.windows.reshape(-1)
    before = torch.cumsum((flat == model_separator(swept)).long(), 0) - (flat == model_separator(swept)).long()
    return before.view(swept.windows.shape)


def model_separator(swept) -> int:
    return swept.manifest["tokenization"]["separator"]


@pytest.mark.parametrize("layer, head", [(0, 0), (0, 5), (1, 0), (1, 7)])
def test_a_heads_rows_are_its_sweep_examples_in_context_with_the_attention_of_its_window_read_again(
        model, swept, examples, layer, head):
    examples.layer, examples.head = layer, head
    assert examples.wait()
    assert examples.shown == [layer, head, -1, "norm"]
    table = swept.head_examples(layer, head)
    assert [(r["window"], r["position"]) for r in examples.rows] == list(zip(table["window"], table["position"]))
    documents = oracle_documents(swept)
    for r, (_, want) in zip(examples.rows, table.iterrows()):
        w, p = r["window"], r["position"]
        assert r["score"] == pytest.approx(float(want["score"]), rel=ROUNDING)
        assert (r["source"], r["document"]) == (int(want["source"]), int(documents[w, p]))
        lo, hi = max(0, p - BEFORE), min(T, p + AFTER + 1)
        spans = [(s["start"], s["start"] + len(s["ids"])) for s in r["segments"]]
        source = int(want["source"])
        assert spans == ([(max(0, source - 1), min(lo, source + 2))] if source < lo else []) + [(lo, hi)]
        _, cache = model.run_with_cache(swept.windows[w], logits=False)  # the window alone
        pattern = cache.patterns[0, layer, head, p].double()
        tol = pattern_tol(model.cfg, T, cache.patterns)
        for s in r["segments"]:
            assert s["ids"] == swept.windows[w, s["start"]:s["start"] + len(s["ids"])].tolist()
            for t, v in enumerate(s["values"]):
                assert abs(v - pattern[s["start"] + t]) <= tol + 0.5 * 10 ** -ATTENTION_DECIMALS
        assert r["attention"] == pytest.approx(float(pattern[source]), abs=tol + ROUNDING)
    strings = model.token_strings
    assert all(examples.strings[str(i)] == strings[i] for r in examples.rows for s in r["segments"] for i in s["ids"])


@pytest.mark.parametrize("rank_by", ["induction", "previous_token", "duplicate_token"])
def test_a_heads_rows_by_a_role_are_its_sweeps_examples_by_that_role_with_the_target_attended(model, swept, rank_by):
    view = DatasetExamples(swept, model, layer=1, head=6, rank_by=rank_by)
    assert view.wait() and view.shown == [1, 6, -1, rank_by]
    table = swept.head_examples(1, 6, by=rank_by)
    assert [(r["window"], r["position"]) for r in view.rows] == list(zip(table["window"], table["position"]))
    assert [r["source"] for r in view.rows] == table["source"].tolist()
    for r, want in zip(view.rows, table[rank_by]):
        assert r["score"] == pytest.approx(float(want), rel=ROUNDING)
    view.rank_by = "norm"  # back to the output norm: the rows of head_examples(by="norm")
    assert view.wait() and view.shown == [1, 6, -1, "norm"]
    assert [r["window"] for r in view.rows] == swept.head_examples(1, 6)["window"].tolist()
    with pytest.raises(traitlets.TraitError):
        view.rank_by = "copying"
    view.close()
    with pytest.raises(ValueError, match="rank_by must be one of 'norm', 'previous_token'"):
        DatasetExamples(swept, model, rank_by="copying")


def test_a_head_shown_before_answers_with_its_values_at_once(model, swept):
    """A revisit runs no window again: its first update already carries the values it showed."""
    view = DatasetExamples(swept, model, layer=1, head=0)
    assert view.wait()
    shown = view.rows
    view.head = 3
    assert view.wait()
    updates = []
    view.observe(lambda change: updates.append(change["new"]), ["rows"])
    view.head = 0
    assert view.wait()
    assert updates == [shown]  # one update, the rows with their values
    view.close()


def test_bad_arguments_are_refused_naming_what_was_expected(model, swept, other_model):
    with pytest.raises(ValueError, match=r"layer must be an int in 0\.\.1, got 2"):
        DatasetExamples(swept, model, layer=2, head=0)
    with pytest.raises(ValueError, match=r"head must be an int in 0\.\.7, got 8"):
        DatasetExamples(swept, model, layer=0, head=8)
    with pytest.raises(ValueError, match="attention-only: it has no MLP neurons"):
        DatasetExamples(swept, model, layer=0, neuron=3)
    with pytest.raises(ValueError, match="made with model 'attn-only-2l', not with this model"):
        DatasetExamples(swept, other_model, layer=0, head=0)
    with pytest.raises(ValueError, match=rf"k must be an int in 1\.\.{K}"):
        DatasetExamples(swept, model, k=K + 1)
    with pytest.raises(TypeError, match="sweep must be a pcw.Sweep"):
        DatasetExamples(str(swept.path), model)


def test_an_explorer_without_a_sweep_has_no_examples_section(model):
    explorer = pcw.CircuitExplorer(model, "def f(x):")
    try:
        assert explorer.examples is None and "examples" not in explorer.notices
        assert "examples" not in [s["name"] for s in explorer.sections]
    finally:
        explorer.close()


def test_an_example_opened_in_the_explorer_is_its_windows_exact_tokens_and_every_view_follows(model, swept):
    explorer = pcw.CircuitExplorer(model, "def f(x):\n    return x", sweep=swept, layer=1, head=5)
    try:
        explorer.wait()
        assert explorer.examples.shown == [1, 5, -1, "norm"]
        row = explorer.examples.rows[2]
        window, position = row["window"], row["position"]
        explorer.examples.set_state({"opened": [window, position]})  # the page's click
        assert explorer.wait() and not explorer.error and not explorer.examples.error
        start = T - len(explorer.token_ids)
        assert 0 <= start <= position and explorer.token_ids == swept.windows[window, start:].tolist()
        assert explorer.position == position - start
        assert explorer.attention.text == explorer.text and explorer.loss.tokens == explorer.tokens[1:]
        # the explorer's attention there is the sweep's: the same tokens read by the same model
        assert (explorer.layer, explorer.head) == (1, 5)
        with pytest.raises(ValueError, match=rf"window must be an int in 0\.\.{N - 1}, got {N}"):
            explorer.open_example(N, 0)
    finally:
        explorer.close()


@pytest.fixture(scope="module")
def mlp_model(model):
    """Random weights with GELU MLPs, the shipped tokenizer (to read the corpus)."""
    m = custom_model(dtype=torch.float32, n_layers=2, n_heads=4, d_model=64, d_head=16, d_vocab=model.cfg.d_vocab,
                     n_ctx=T, attn_only=False, d_mlp=128, act_fn="gelu", seed=3)
    m.tokenizer = model.tokenizer
    return m


@pytest.fixture(scope="module")
def mlp_swept(mlp_model, tmp_path_factory):
    return pcw.sweep(mlp_model, Corpus.python_stdlib(), tmp_path_factory.mktemp("sweep") / "mlp", seq_len=T, k=K,
                     max_windows=16, progress=False)


def test_a_neurons_rows_carry_its_activation_on_every_token_and_the_explorer_follows_the_neurons_section(
        mlp_model, mlp_swept):
    view = DatasetExamples(mlp_swept, mlp_model, layer=1, neuron=17)
    # two float32 forwards (the view's batch, this one window) differ by the pre-activation's error:
    # its terms are at most sqrt(d_model) (a normalized stream) times |W_in| (no norm weight, no bias),
    # and GELU's slope is below 1.13
    assert mlp_model.b_in is None
    pre = mlp_model.cfg.d_model ** 0.5 * float(mlp_model.W_in[1, :, 17].abs().sum())
    tol = chain_tol(model_forward_length(mlp_model.cfg, T), 1.13 * pre)
    try:
        table = mlp_swept.neuron_examples(1, 17)
        assert [(r["window"], r["position"]) for r in view.rows] == list(zip(table["window"], table["position"]))
        for r in view.rows:
            assert len(r["segments"]) == 1 and r["source"] is None and r["attention"] is None
            _, cache = mlp_model.run_with_cache(mlp_swept.windows[r["window"]], mlp_post=True, logits=False)
            post = cache.mlp_post[0, 1, :, 17].double()
            s = r["segments"][0]
            for t, v in enumerate(s["values"]):
                assert abs(v - float(post[s["start"] + t])) <= tol + ROUNDING * abs(v)
            assert abs(r["score"] - float(post[r["position"]])) <= tol + ROUNDING * abs(r["score"])
    finally:
        view.close()
    explorer = pcw.CircuitExplorer(mlp_model, "def f(x):\n    return x", sweep=mlp_swept)
    try:
        explorer.compute("neurons")
        explorer.neurons.set_state({"layer": 1, "neuron": 17})
        assert explorer.wait() and explorer.examples.shown == [1, explorer.head, 17, "norm"]
        explorer.attention.set_state({"layer": 0, "head": 2})  # a head click: the head's examples again
        assert explorer.wait() and explorer.examples.shown == [0, 2, -1, "norm"]
    finally:
        explorer.close()


def test_a_saved_page_keeps_every_heads_examples_within_the_budget_and_says_when_it_cut(model, swept, monkeypatch):
    view = DatasetExamples(swept, model, layer=1, head=3)
    try:
        state = offline.fill(view)
        assert len(offline.rules(state)) == 1 and state["kernel"] == {"opened": offline.NEEDS_KERNEL["opened"]}
        rule = offline.rules(state)[0]
        assert rule["on"] == ["layer", "head", "rank_by"]
        # every head of the model in the current ranking, and the current head in the three others
        assert set(rule["patches"]) == ({offline.key(l, h, "norm") for l in range(2) for h in range(8)}
                                        | {offline.key(1, 3, r) for r in ("induction", "previous_token", "duplicate_token")})
        assert len(state["rules"]["view"]) + len(state["data"]) <= offline.BUDGET
        for layer, head, by in [(1, 3, "norm"), (0, 6, "norm"), (1, 3, "induction")]:
            saved = rule["patches"][offline.key(layer, head, by)]["rows"]
            table = swept.head_examples(layer, head, by=by)
            assert [(r["window"], r["position"]) for r in saved] == list(zip(table["window"], table["position"]))
            assert all(s["values"] is not None for r in saved for s in r["segments"])
        assert view.cut == ""
    finally:
        view.close()
    monkeypatch.setattr(dataset_examples, "SAVED", 3)
    view = DatasetExamples(swept, model, layer=1, head=3)
    try:
        rule = offline.rules(offline.fill(view))[0]
        assert {len(p["rows"]) for p in rule["patches"].values()} == {3}
        assert view.cut == (f"Without a kernel this page keeps 3 of the {K} examples of each head (all of the head "
                            "shown when it was saved).")
    finally:
        view.close()


def test_hostile_corpus_text_is_inert_in_the_picture(model, tmp_path):
    hostile = ("<script>alert(1)</script> \u202eevil\u202c <img src=x onerror=alert(2)> \ud800 " * 4
               + "x" * 100_000)
    corpus = Corpus.from_texts([hostile] * 3, errors="replace")  # the lone surrogate kept as U+FFFD
    swept = pcw.sweep(model, corpus, tmp_path / "hostile", seq_len=T, k=4, max_windows=16, progress=False)
    view = DatasetExamples(swept, model, layer=0, head=1)
    try:
        shown = {view.strings[str(i)] for r in view.rows for s in r["segments"] for i in s["ids"]}
        assert any("<" in s for s in shown)  # the rows hold the hostile text's tokens
        page = view._fallback_html()
        assert "<script" not in page and "<img" not in page and "&lt;img" in page  # shown as text
        assert not any(c in page for c in "\u202e\u202c\ud800\ufffd")
        assert 'data-pcw-figure="dataset-examples"' in page
    finally:
        view.close()


def test_the_explorers_picture_shows_the_selected_heads_top_examples(model, swept):
    explorer = pcw.CircuitExplorer(model, "def f(x):\n    return x", sweep=swept, layer=1, head=2)
    try:
        explorer.wait()
        page = explorer._fallback_html()
        assert 'data-pcw-figure="dataset-examples"' in page and "Dataset examples of head L1.H2" in page
        table = swept.head_examples(1, 2)
        assert f"w{table['window'][0]}:{table['position'][0]}" in page
    finally:
        explorer.close()
