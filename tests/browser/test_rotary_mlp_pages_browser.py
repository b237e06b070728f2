"""Saved explorer pages of a tiny random LLaMA (rotary, GQA, gated MLP, no tokenizer: token ids) and a
tiny random GPT-2 (learned positions, MLPs, biases) in headless Chromium with the network cut:
``save_html`` and the notebook ``export`` both succeed, every section is there with no notice, the
rotary views state the offsets they read, and the page's numbers are the analysis's (skip-trigram
offsets, MLP path terms)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import nbformat
import numpy as np
import pytest
import transformers
from playwright.sync_api import expect
from tokenizers import Tokenizer, models, pre_tokenizers

import pycircuits_widgets as pcw
from harness import saved_page_open
from pycircuits_widgets.widgets.sharing.notebook_export import WIDGET_STATE, export_notebook
from pycircuits_widgets.widgets.sharing.standalone import widget_state
from pycircuits_widgets.widgets.views.registry import BY_NAME
from test_adapters_hf import randomize

pytestmark = pytest.mark.browser

V = 40
IDS = [3, 7, 11, 3, 7, 11, 19, 2]


def llama():
    config = transformers.LlamaConfig(vocab_size=V, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)
    return pcw.from_hf(randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"), 1))


def gpt2():
    vocab = {f"w{i}": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2,
                                                              n_head=4))
    return pcw.from_hf(randomize(hf, 2), transformers.PreTrainedTokenizerFast(tokenizer_object=tok))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def saved(request, tmp_path_factory):
    model = llama() if request.param == "llama" else gpt2()
    text = IDS if request.param == "llama" else " ".join(f"w{i}" for i in IDS)
    explorer = pcw.CircuitExplorer(model, text)
    path = explorer.save_html(tmp_path_factory.mktemp(request.param) / "explorer.html")
    return request.param, explorer, path


def section(page, name):
    return page.locator(f".pcw-explorer section[data-view={name}]")


def test_every_section_is_in_the_saved_page_without_a_notice(browser, saved):
    kind, explorer, path = saved
    shown = {n for n, spec in BY_NAME.items() if not (spec.needs_sweep or spec.needs_task)}  # no sweep, no task
    assert set(explorer.views()) == shown and not explorer.notices
    with saved_page_open(browser, path) as page:
        expect(page.get_by_test_id("notice")).to_have_count(0)
        for name in shown:
            expect(section(page, name)).to_have_count(1)
            expect(section(page, name).get_by_test_id("on-demand")).to_have_count(0)  # computed into the page
        # MLP path terms are ranked with the heads: the page's ranking is the kernel's
        terms = [t["name"] for t in explorer.paths.terms]
        assert {"MLP0", "MLP1", "MLP0 → L1.H2"} <= set(terms)
        importance = explorer.paths.importance
        top = [terms[i] for i in np.argsort(-importance, kind="stable")[:3]]
        shown = section(page, "paths").locator("tr.term").all_inner_texts()[:3]
        assert all(name in row for name, row in zip(top, shown)), (top, shown)
        expect(section(page, "paths").get_by_test_id("expansion-note")).to_contain_text("MLP")
        if kind == "gpt2":
            expect(page.get_by_test_id("offset-note")).to_have_count(0)  # learned positions: no offsets
            return
        for name in ("trigrams", "composition", "eigen", "induction"):
            expect(section(page, name).get_by_test_id("offset-note")).to_contain_text("query - key offsets 0..7")
        # the table's offset column is the analysis's: each triple at its strongest offset in 0..7
        rows = pcw.skip_trigrams(explorer.model, explorer.layer, explorer.head, k=5, approximate=True,
                                 offset=range(0, 8))
        shown = section(page, "trigrams").locator("td[data-col=offset]").all_inner_texts()[:5]
        assert [int(s) for s in shown] == [r.offset for r in rows]
        assert section(page, "trigrams").locator(".pcw-tok").first.inner_text().startswith("<id")  # ids as tokens
        control = section(page, "trigrams").get_by_test_id("offset-from")  # other windows need the kernel
        expect(control).to_be_disabled()
        assert "running kernel" in section(page, "trigrams").get_by_test_id("offset-control").get_attribute("title")


def test_a_notebook_holding_the_explorer_exports_and_opens(browser, saved, tmp_path):
    kind, explorer, _ = saved
    nb = nbformat.v4.new_notebook()
    data, _ = explorer._repr_mimebundle_()
    nb.cells.append(nbformat.v4.new_code_cell("e", outputs=[nbformat.v4.new_output("display_data", data=data)]))
    nb.metadata["widgets"] = {WIDGET_STATE: {"version_major": 2, "version_minor": 0,
                                             "state": widget_state([explorer])}}
    src = tmp_path / f"{kind}.ipynb"
    nbformat.write(nb, str(src))
    with saved_page_open(browser, export_notebook(src)) as page:
        for name in (n for n, spec in BY_NAME.items() if not (spec.needs_sweep or spec.needs_task)):  # none given
            expect(section(page, name)).to_have_count(1)
        expect(page.get_by_test_id("notice")).to_have_count(0)
        detail = explorer.composition.detail
        if kind == "llama" and detail:
            expect(section(page, "composition").get_by_test_id("detail-offset")).to_contain_text(detail["offset_note"])


def test_the_offset_control_reaches_the_kernel_and_the_table_follows(show):
    w = pcw.SkipTrigramTable(llama(), layer=0, head=1, k=8, offsets=range(0, 4))
    view = show(w)
    page = view.page
    page.get_by_test_id("offset-to").fill("9")
    page.get_by_test_id("offset-to").dispatch_event("change")
    view.wait_until(lambda: w.offsets == list(range(0, 10)), what="the window in Python")
    w.wait()
    expected = [str(r.offset) for r in pcw.skip_trigrams(w.model, 0, 1, k=8, approximate=True, offset=range(0, 10))]
    view.wait_until(lambda: page.locator("td[data-col=offset]").all_inner_texts() == expected, what="the new table")
    expect(page.get_by_test_id("offset-note")).to_contain_text("query - key offsets 0..9")
