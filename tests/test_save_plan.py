"""A saved page that plans (``widgets/core/save_plan.py``): before any work the save estimates what each
section costs at the model's size and keeps, in order of value, what fits its seconds and bytes; the page
states its size and budgets and names what it left out, each with its cost.

Real explorers of the shipped 2-layer model with a real sweep (64 windows of 64 tokens of the Python
stdlib, k = 8), and of a 30 x 9-head model (SmolLM2-135M's heads, narrow widths) with 20 examples of
each head. Oracles: the plan's own order and estimates read back from the page and the views' saved
answers, the sweep's own example tables."""

import re

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.corpus import Corpus
from pycircuits_widgets.models import load_pretrained
from pycircuits_widgets.widgets.core import offline, save_plan
from pycircuits_widgets.widgets.core.save_plan import CHOSEN, EXAMPLES, MEASURED, REST, WEIGHTS
from pycircuits_widgets.widgets.sharing.standalone import page_plan
from pycircuits_widgets.widgets.views.dataset_examples import SAVED, UNSHADED
from random_models import custom_model

TEXT = "def f(x):\n    return x + 1\n"


@pytest.fixture(scope="module")
def model():
    return load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def swept(model, tmp_path_factory):
    return pcw.sweep(model, Corpus.python_stdlib(), tmp_path_factory.mktemp("sweep") / "store", seq_len=64, k=8,
                     max_windows=64, progress=False)


@pytest.fixture
def explorer(model, swept):
    e = pcw.CircuitExplorer(model, TEXT, sweep=swept)
    yield e
    e.close()


class Notes:
    """A save bar that keeps what it is told (``progress.Progress``'s ``note``/``update``)."""

    def __init__(self):
        self.notes, self.done = [], 0

    def note(self, text):
        self.notes.append(text)

    def update(self, n=1):
        self.done += n


def plan_section(page: str) -> str:
    return re.search(r'<section class="pcw-plan">(.*?)</section>', page, re.DOTALL).group(1)


def test_a_plan_runs_weight_only_views_then_examples_then_chosen_exact_tables_then_measured(explorer):
    plan = page_plan([explorer], None, 10 ** 9, heads=[(1, 6), (0, 2)])
    ranks = [item.value_rank for item, _ in plan.kept]
    assert ranks == sorted(ranks) and {WEIGHTS, EXAMPLES, CHOSEN, MEASURED, REST} <= set(ranks)
    sections = {rank: {item.section for item, _ in plan.kept if item.value_rank == rank} for rank in set(ranks)}
    assert sections[WEIGHTS] == {"composition", "eigen"} and sections[EXAMPLES] == {"examples"}
    assert sections[CHOSEN] == {"trigrams"} and sections[MEASURED] == {"composition", "causal"}
    assert plan.left == []  # no budget: everything
    bar = Notes()
    plan.run(bar)
    assert [note.split(":")[0] for note in bar.notes] == [item.section for item, _ in plan.kept]
    assert bar.done == round(plan.cost_s)  # the bar's estimate is the plan's
    chosen = offline.rules(explorer.trigrams._offline)[0]["patches"]
    assert list(chosen)[:3] == [offline.key(1, 6), offline.key(0, 2), offline.key(explorer.layer, explorer.head)]
    assert explorer.causal.head_loss_change is not None and set(explorer.composition.measured) == {"Q", "K", "V"}


def test_a_page_too_small_for_everything_names_what_it_left_out_with_its_cost_and_stays_in_its_bytes(
        explorer, tmp_path):
    explorer.compute()  # (what the save does first for a small model: the plan's base then holds it)
    whole = page_plan([explorer], None, 10 ** 9)
    weights = sum(item.bytes_estimate for item in whole.items if item.value_rank == WEIGHTS)
    examples = next(item for item in whole.items if item.section == "examples")
    max_bytes = whole.base_bytes + weights + examples.bytes_estimate // 2  # about half the heads' examples
    page = explorer.save_html(tmp_path / "page.html", max_bytes=max_bytes, budget=None).read_text()
    assert len(page.encode()) <= max_bytes
    said = plan_section(page)
    assert f"of its {max_bytes / 1e6:.2f} MB budget (max_bytes)" in said
    assert f"This page: {len(page.encode()) / 1e6:.2f} MB" in said
    left = re.findall(r"<li>(.*?)</li>", said)
    kept = [key for key in offline.rules(explorer.examples._offline)[0]["patches"]
            if key.endswith(f',"{explorer.examples.rank_by}"')]  # the heads kept in the shown ranking
    n_heads = explorer.model.cfg.n_layers * explorer.model.cfg.n_heads
    assert 0 < len(kept) < n_heads
    assert any(line.startswith(f"dataset examples of {n_heads - len(kept)} more heads: ") for line in left)
    assert any(line.startswith("exact skip-trigram tables of ") for line in left)
    for line in left:
        assert re.search(r": (under a second|about [\d.]+ (s|min|h)) in a kernel, [\d.]+ MB of page$", line), line


def test_heads_whose_attention_does_not_fit_keep_their_examples_and_say_so(explorer, tmp_path):
    explorer.compute()  # (what the save does first for a small model: the plan's base then holds it)
    whole = page_plan([explorer], None, 10 ** 9)
    weights = sum(item.bytes_estimate for item in whole.items if item.value_rank == WEIGHTS)
    rows, shading = (item for item in whole.items if item.section == "examples")
    max_bytes = whole.base_bytes + weights + rows.bytes_estimate + shading.bytes_estimate // 2
    page = explorer.save_html(tmp_path / "page.html", max_bytes=max_bytes, budget=None).read_text()
    patches = offline.rules(explorer.examples._offline)[0]["patches"]
    shaded = [k for k, p in patches.items() if all(s["values"] is not None for r in p["rows"] for s in r["segments"])]
    plain = [p for k, p in patches.items() if k not in shaded]
    assert len(patches) == 16 and 0 < len(shaded) < 16 and list(patches)[:len(shaded)] == shaded
    assert all(p["_offline_note"] == UNSHADED and all(s["values"] is None for r in p["rows"] for s in r["segments"])
               for p in plain)
    assert f"attention shading of the dataset examples of {len(plain)} more heads: " in plan_section(page)
    assert len(page.encode()) <= max_bytes


def test_a_save_with_no_time_left_computes_nothing_and_says_so(explorer, tmp_path):
    page = explorer.save_html(tmp_path / "page.html", budget=0).read_text()
    said = plan_section(page)
    assert "computed within a 0 s budget" in said
    left = re.findall(r"<li>(.*?)</li>", said)
    assert any(line.startswith("composition scores with their baseline") for line in left)
    assert any(line.startswith("the head-loss table") for line in left)
    assert explorer.causal.head_loss_change is None  # left out: not computed
    assert offline.rules(explorer.examples._offline)[0]["patches"] == {}  # no answer computed


def test_listed_heads_exact_tables_are_kept_before_the_rest(explorer, tmp_path):
    listed = [(1, 6), (0, 2)]
    explorer.compute()  # (what the save does first for a small model: the plan's base then holds it)
    whole = page_plan([explorer], None, 10 ** 9, heads=listed)
    upto = [item for item in whole.items if item.value_rank <= CHOSEN]
    max_bytes = whole.base_bytes + sum(item.bytes_estimate for item in upto) + 1000
    page = explorer.save_html(tmp_path / "page.html", max_bytes=max_bytes, heads=listed, budget=None).read_text()
    tables = offline.rules(explorer.trigrams._offline)[0]["patches"]
    current = (explorer.layer, explorer.head)
    assert set(tables) == {offline.key(*h) for h in [*listed, current]}
    assert "exact skip-trigram tables of 13 more heads" in plan_section(page)
    assert len(page.encode()) <= max_bytes


@pytest.mark.parametrize("kwargs, message", [
    ({"max_bytes": -1}, r"max_bytes must be a positive int \(bytes of the page\), got -1"),
    ({"max_bytes": 2.5e6}, r"max_bytes must be a positive int \(bytes of the page\), got 2500000.0"),
    ({"heads": [(2, 0)]}, (r"heads: each entry must be a \(layer, head\) pair with layer in 0..1 and head in 0..7, "
                           r"got \(2, 0\)")),
    ({"heads": [(0, -1)]}, r"and head in 0..7, got \(0, -1\)"),
    ({"heads": "1,6"}, r"heads must be a list of \(layer, head\) pairs, got '1,6'"),
])
def test_bad_arguments_are_refused_naming_what_was_expected_before_any_work(explorer, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        explorer.save_html(tmp_path / "page.html", **kwargs)
    assert not (tmp_path / "page.html").exists()


def test_a_byte_budget_under_the_front_end_and_state_is_refused_naming_what_the_page_needs(explorer, tmp_path):
    with pytest.raises(ValueError, match=r"max_bytes=1,000 is less than the page holds before any section's saved "
                                         r"answers \(the front end and the views' state: [\d,]+ bytes\)"):
        explorer.save_html(tmp_path / "page.html", max_bytes=1000)
    assert not (tmp_path / "page.html").exists()


def test_a_270_head_models_page_keeps_20_examples_of_every_head_each_window_once(model, tmp_path):
    """SmolLM2-135M's 30 x 9 heads (narrow: d_model 64), the shipped tokenizer's vocabulary."""
    wide = custom_model(dtype=torch.float32, n_layers=30, n_heads=9, d_model=64, d_head=8, d_vocab=model.cfg.d_vocab,
                        n_ctx=64, seed=3)
    wide.tokenizer = model.tokenizer
    sweep = pcw.sweep(wide, Corpus.python_stdlib(), tmp_path / "store", seq_len=32, k=SAVED, max_windows=96,
                      progress=False)
    view = pcw.DatasetExamples(sweep, wide, layer=29, head=8)
    try:
        page = view.save_html(tmp_path / "page.html", budget=None).read_text()
        state = view._offline
        patches = offline.rules(state)[0]["patches"]
        # every head in the shown ranking, and the shown head in the three others
        assert len(patches) == 270 + 3 and all(len(p["rows"]) <= SAVED for p in patches.values())
        assert all(len(p["rows"]) == SAVED for key, p in patches.items() if key.endswith('"norm"'))
        for layer, head, by in [(29, 8, "norm"), (0, 0, "norm"), (14, 3, "norm"), (29, 8, "induction")]:
            table = sweep.head_examples(layer, head, by=by).iloc[:SAVED]
            rows = patches[offline.key(layer, head, by)]["rows"]
            assert [(r["window"], r["position"]) for r in rows] == list(zip(table["window"], table["position"]))
        shown = {r["window"] for p in patches.values() for r in p["rows"]}
        assert len(state["data"]) <= 2 * sweep.seq_len * len(shown) + 2 * len(shown)  # each window's tokens once
        assert len(page.encode()) <= save_plan.MAX_BYTES
        assert f"This page: {len(page.encode()) / 1e6:.2f} MB" in plan_section(page)
    finally:
        view.close()
