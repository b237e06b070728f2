"""Skip-trigrams counted over a sweep's windows (``pcw.trigram_counts``) on a real sweep of the shipped
2-layer model (64 windows of 64 tokens of the Python stdlib corpus, k=8).

Oracle, written here: plain Python loops over every window and destination position (source at an
earlier position of the window, out right after the destination; one count per destination), and the
head's attention from ``run_with_cache`` of the model on that one window, summed over the earlier
copies of the source. Counts are exact integers; the attention of two float32 forwards (one window
against the batches the counter runs) differs within ``T * pattern_tol`` (``tolerance.py``: a sum of
at most ``T`` pattern entries) plus the float32 rounding of the counter's sum less its diagonal.
"""

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.skip_trigrams import head_table
from pycircuits_widgets.models import load_pretrained
from tolerance import pattern_tol, reduction_tol

N, T = 64, 64


@pytest.fixture(scope="module")
def model():
    return load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def swept(model, tmp_path_factory):
    return pcw.sweep(model, pcw.Corpus.python_stdlib(), tmp_path_factory.mktemp("sweep"), seq_len=T, k=8,
                     max_windows=N, progress=False)


@pytest.fixture(scope="module")
def patterns(model, swept):
    """``[N, L, H, T, T]``: each window run alone (as the oracle reads it)."""
    return torch.cat([model.run_with_cache(w[None], logits=False)[1].patterns for w in swept.windows])


def brute_force(windows: torch.Tensor, patterns: torch.Tensor, layer: int, head: int, triple, only=None) -> tuple:
    """(count, mean attention or None) of ``triple`` by loops over every window (``only``: those windows)
    and position."""
    src, dest, out = triple
    count, total = 0, 0.0
    for w, row in enumerate(windows.tolist()):
        if only is not None and w not in only:
            continue
        for d in range(len(row) - 1):
            if row[d] == dest and row[d + 1] == out and src in row[:d]:
                count += 1
                total += sum(float(patterns[w, layer, head, d, s]) for s in range(d) if row[s] == src)
    return count, (total / count if count else None)


def triples_of(model, windows: torch.Tensor, layer: int, head: int) -> list:
    """Triples that occur (taken from the windows: a far source, a near one, a source repeated before the
    destination, a source equal to the destination), the head's own top skip-trigrams, and triples that
    never occur (a source the sweep never holds; ids the corpus never puts in that order)."""
    W = windows.tolist()
    taken = [(W[0][3], W[0][10], W[0][11]), (W[5][20], W[5][21], W[5][22]), (W[9][0], W[9][62], W[9][63])]
    for w, row in enumerate(W):  # a source seen several times before its destination, and src == dest
        for d in range(2, T - 1):
            if row[:d].count(row[0]) >= 3 and len(taken) < 4:
                taken.append((row[0], row[d], row[d + 1]))
            if row[d] in row[:d] and len(taken) < 5 and w > 10:
                taken.append((row[d], row[d], row[d + 1]))
    table = head_table(model, layer, head, 12, approximate=True)
    weights = list(zip(table.source.tolist(), table.destination.tolist(), table.out.tolist()))
    unseen = min(set(range(model.cfg.d_vocab)) - set(windows.flatten().tolist()))
    never = [(unseen, W[0][10], W[0][11]), (W[1][5], W[1][6], W[1][5]), (W[2][40], W[2][30], W[2][31])]
    return taken + weights + never


@pytest.mark.parametrize("layer,head", [(0, 0), (0, 7), (1, 4), (1, 6)])
def test_counts_and_mean_attention_against_brute_force(model, swept, patterns, layer, head):
    windows = swept.windows
    triples = triples_of(model, windows, layer, head)
    got = pcw.trigram_counts(swept, model, layer, head, triples, batch_size=5)
    assert got.windows == N and (got.layer, got.head) == (layer, head)
    tol = T * pattern_tol(model.cfg, T, patterns) + reduction_tol(T, 1.0, computations=2)
    seen = 0
    for i, triple in enumerate(triples):
        count, attention = brute_force(windows, patterns, layer, head, triple)
        assert (int(got.source[i]), int(got.destination[i]), int(got.out[i])) == triple
        assert int(got.count[i]) == count, f"{triple}: counted {int(got.count[i])}, brute force {count}"
        if count == 0:
            assert got.attention[i] is None, triple
        else:
            seen += 1
            assert abs(got.attention[i] - attention) <= tol, f"{triple}: {got.attention[i]} vs {attention}"
    assert seen >= 5 and seen < len(triples)  # both kinds were checked
    assert got.count[len(triples) - 3] == 0 and got.attention[len(triples) - 3] is None  # a source never swept
    windows_holding = sorted({w for w, row in enumerate(windows.tolist()) for (s, d, o) in triples
                              for p in range(1, T - 1) if row[p] == d and row[p + 1] == o and s in row[:p]})
    assert got.windows_run == got.windows_holding == len(windows_holding)  # only those windows are run again
    assert got.measured.tolist() == got.count.tolist()

    cut = pcw.trigram_counts(swept, model, layer, head, triples, max_windows=3)  # attention on 3 windows
    assert cut.count.tolist() == got.count.tolist() and cut.windows_run == 3
    for i, triple in enumerate(triples):
        measured, attention = brute_force(windows, patterns, layer, head, triple, only=windows_holding[:3])
        assert int(cut.measured[i]) == measured
        assert (cut.attention[i] is None) if measured == 0 else abs(cut.attention[i] - attention) <= tol


def test_a_revisited_head_answers_from_the_cache_and_an_edit_recomputes(model, swept):
    W = swept.windows
    triple = [(W[0][3].item(), W[0][10].item(), W[0][11].item())]
    first = pcw.trigram_counts(swept, model, 1, 4, triple)
    assert pcw.trigram_counts(swept, model, 1, 4, triple) is first
    assert pcw.trigram_counts(swept, model, 1, 4, torch.tensor(triple)) is first
    assert pcw.trigram_counts(swept, model, 1, 4, []).count.shape == (0,)


def test_bad_input_is_refused_naming_what_was_wrong(model, swept, tmp_path):
    V = model.cfg.d_vocab
    with pytest.raises(ValueError, match=rf"outside the vocabulary 0\.\.{V - 1}: \(1, {V}, 2\)"):
        pcw.trigram_counts(swept, model, 0, 0, [(1, V, 2)])
    with pytest.raises(ValueError, match=r"outside the vocabulary .*\(-1, 2, 3\)"):
        pcw.trigram_counts(swept, model, 0, 0, [(1, 2, 3), (-1, 2, 3)])
    with pytest.raises(TypeError, match=r"\[n, 3\] ints"):
        pcw.trigram_counts(swept, model, 0, 0, [(1.5, 2, 3)])
    with pytest.raises(TypeError, match=r"\[n, 3\] ints"):
        pcw.trigram_counts(swept, model, 0, 0, [(1, 2)])
    with pytest.raises(TypeError, match="list of .source, destination, out. token ids"):
        pcw.trigram_counts(swept, model, 0, 0, 5)
    with pytest.raises(ValueError, match=r"head must be in 0\.\.7, got 8"):
        pcw.trigram_counts(swept, model, 0, 8, [(1, 2, 3)])
    with pytest.raises(TypeError, match="sweep must be a pcw.Sweep"):
        pcw.trigram_counts(str(swept.path), model, 0, 0, [(1, 2, 3)])
    other = load_pretrained("attn-only-1l")
    with pytest.raises(ValueError, match="made with model 'attn-only-2l', not with this model 'attn-only-1l'"):
        pcw.trigram_counts(swept, other, 0, 0, [(1, 2, 3)])
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        pcw.trigram_counts(swept, model, 0, 0, [(1, 2, 3)], batch_size=0)
    with pytest.raises(ValueError, match="max_windows must be a positive int, got 0"):
        pcw.trigram_counts(swept, model, 0, 0, [(1, 2, 3)], max_windows=0)


def test_the_table_shows_each_triples_corpus_count_and_mean_attention(model, swept):
    table = pcw.SkipTrigramTable(model, layer=1, head=4, k=30, sweep=swept)
    table.wait()
    shown = table.trigrams
    assert table.corpus == {"windows": N, "seq_len": T, "model": "attn-only-2l"}
    triples = torch.stack([torch.as_tensor(shown[c]).long() for c in ("src", "dest", "out")], 1)
    counts = pcw.trigram_counts(swept, model, 1, 4, triples, max_windows=table.attention_windows)
    assert shown["count"].tolist() == counts.count.tolist() and shown["measured"].tolist() == counts.measured.tolist()
    assert (shown["windows_run"], shown["windows_holding"]) == (counts.windows_run, counts.windows_holding)
    expected = [float("nan") if a is None else a for a in counts.attention]
    assert torch.equal(torch.as_tensor(shown["attention"]).isnan(), torch.tensor(expected).isnan())
    assert torch.allclose(torch.as_tensor(shown["attention"]).nan_to_num(-1),
                          torch.tensor(expected, dtype=torch.float32).nan_to_num(-1))
    table.head = 6  # another head: counted for its own triples
    table.wait()
    assert table.trigrams["head"] == 6 and len(table.trigrams["count"]) == len(table.trigrams["src"])
    plain = pcw.SkipTrigramTable(model, layer=1, head=4, k=30)
    assert plain.corpus == {} and "count" not in plain.trigrams


def test_the_eigenvalue_plot_colours_by_the_corpus_head_scores(model, swept):
    plot = pcw.EigenvaluePlot(model, sweep=swept, color_by="induction")
    for name, value in swept.head_scores().items():
        assert torch.equal(torch.as_tensor(plot.scores[name]), value.float()), name
    assert plot.scores_note == "attention to its target, 0 to 1, pooled over the corpus sweep (64 windows of 64 tokens)"
    assert pcw.EigenvaluePlot(model).scores_note == ""
    with pytest.raises(TypeError, match="pass scores or sweep"):
        pcw.EigenvaluePlot(model, scores={}, sweep=swept)


def test_the_explorer_passes_its_sweep_to_the_table_and_the_plot(model, swept):
    e = pcw.CircuitExplorer(model, "def f(x):\n    return x", sweep=swept, layer=1, head=4)
    e.trigrams.wait()
    assert e.trigrams.corpus["windows"] == N and "count" in e.trigrams.trigrams
    assert e.eigen.scores_note.endswith("(64 windows of 64 tokens)")


def test_the_views_refuse_a_sweep_of_another_model(model, swept):
    other = load_pretrained("attn-only-1l")
    for view in (pcw.SkipTrigramTable, pcw.EigenvaluePlot):
        with pytest.raises(ValueError, match=f"{view.__name__}: the sweep .* was made with model 'attn-only-2l'"):
            view(other, sweep=swept)
        with pytest.raises(TypeError, match=f"{view.__name__}: sweep must be a pcw.Sweep"):
            view(model, sweep=str(swept.path))
