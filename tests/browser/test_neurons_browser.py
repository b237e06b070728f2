"""The MLP neuron view in headless Chromium: a tiny random LLaMA explorer's ``save_html`` page (no
kernel, network cut) shows the neurons section, answers a neuron click from its saved answers with
the kernel's tables, and shows the neutral note for a neuron it has no answer for; with the harness's
kernel, a typed neuron reaches Python and a bad one is refused, shown and rolled back."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import transformers
from playwright.sync_api import expect

import pycircuits_widgets as pcw
from harness import explorer_section, open_offline
from pycircuits_widgets.models.tokenizer import reading_ids
from pycircuits_widgets.widgets.core import offline
from test_adapters_hf import randomize

pytestmark = pytest.mark.browser

IDS = [3, 7, 11, 3, 7, 11, 19, 2]
D_MLP = 256  # more neurons than the page's lists name, so some have no saved answer


def llama():
    config = transformers.LlamaConfig(vocab_size=40, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=D_MLP)
    return pcw.from_hf(randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"), 4))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    explorer = pcw.CircuitExplorer(llama(), IDS, layer=1, head=2)
    path = explorer.save_html(tmp_path_factory.mktemp("neurons") / "explorer.html")
    return explorer, path


def shown_tables(section):
    """{term: (token ids, values)} of the section's tables."""
    out = {}
    for table in section.locator("[data-term]").all():
        texts = [int(t.get_attribute("data-token-id")) for t in table.locator(".pcw-tok").all()]
        values = [float(v) for v in table.get_by_test_id("value").all_inner_texts()]
        out[table.get_attribute("data-term")] = (texts, values)
    return out


def kernel_tables(view):
    """The same from the kernel's view state."""
    return {t["term"]: (t["ids"].tolist(), t["values"].tolist())
            for t in view.direct["tables"] + view.through_head["tables"]}


def assert_same(page_tables, kernel):
    assert set(page_tables) == set(kernel) == {"in", "gate", "out", "out_bottom", "head_in", "head_gate"}
    for term, (texts, values) in page_tables.items():
        assert texts == kernel[term][0], term
        assert values == pytest.approx(kernel[term][1], rel=5e-3, abs=1e-6), term  # shown to 3 digits


def test_the_saved_page_answers_a_neuron_click_or_shows_the_neutral_note(browser, saved):
    explorer, path = saved
    view = explorer.neurons
    listed = view.neurons.tolist()
    saved_neurons = {key for rule in offline.rules(view._offline) if rule["on"] == ["layer", "head", "neuron"]
                     for key in rule["patches"]}
    unsaved = next(n for n in range(D_MLP) if offline.key(1, 2, n) not in saved_neurons)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(10000)
    _, errors = open_offline(page, path, console_errors=True)
    section = explorer_section(page, "neurons")
    expect(section.get_by_test_id("on-demand")).to_have_count(0)  # computed into the page
    expect(section.get_by_test_id("neuron-list").locator("button")).to_have_count(len(listed))
    expect(section.get_by_test_id("no-neuron")).to_be_visible()
    expect(section.get_by_test_id("ranking")).to_contain_text("largest ||Wout[n] WU||")
    expect(section.get_by_test_id("norm-note")).to_contain_text("raw W_E")
    section.locator(f"button[data-neuron='{listed[1]}']").click()
    expect(section.get_by_test_id("direct")).to_be_visible()
    first = shown_tables(section)
    section.locator(f"button[data-neuron='{listed[2]}']").click()
    expect(section.locator("button.selected")).to_have_attribute("data-neuron", str(listed[2]))
    second = shown_tables(section)
    assert first != second  # the tables changed with the neuron, with no kernel
    # a neuron the page has no answer for: the neutral note, and no other neuron's tables
    section.get_by_test_id("neuron-input").fill(str(unsaved))
    section.get_by_test_id("neuron-input").dispatch_event("change")
    expect(section.get_by_test_id("offline-note")).to_contain_text("needs a running kernel")
    expect(section.get_by_test_id("direct")).to_have_count(0)
    expect(section.get_by_test_id("error")).to_have_count(0)
    assert not errors, errors
    context.close()
    # the page's tables were the kernel's
    for neuron, tables in ((listed[1], first), (listed[2], second)):
        view.neuron = neuron
        assert explorer.wait()
        assert_same(tables, kernel_tables(view))


def test_a_typed_neuron_reaches_the_kernel_and_a_bad_one_is_refused(show):
    w = pcw.NeuronView(*reading_ids(llama(), IDS), layer=0, head=1, neuron=4)
    assert w.wait()
    view = show(w)
    page = view.page
    expect(page.get_by_test_id("direct")).to_be_visible()
    before = shown_tables(page)
    page.get_by_test_id("neuron-input").fill(str(D_MLP))
    page.get_by_test_id("neuron-input").dispatch_event("change")
    view.wait_until(lambda: page.get_by_test_id("error").count() == 1, what="error panel")
    assert f"neuron must be -1 (none) or in 0..{D_MLP - 1}, got {D_MLP}" in page.get_by_test_id("error").inner_text()
    assert w.neuron == 4
    expect(page.get_by_test_id("neuron-input")).to_have_value("4")  # rolled back in the page too
    assert shown_tables(page) == before
    page.get_by_test_id("neuron-input").fill("9")
    page.get_by_test_id("neuron-input").dispatch_event("change")
    view.wait_until(lambda: w.neuron == 9, what="the neuron in Python")
    assert w.wait()
    view.wait_until(lambda: page.get_by_test_id("error").count() == 0 and shown_tables(page) != before,
                    what="the new tables")
    assert_same(shown_tables(page), kernel_tables(w))
