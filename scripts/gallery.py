"""Build the view gallery: every view of the widget bundle on one offline HTML page, so a
reviewer sees them all at once (as CircuitsVis's stories do for its components).

Usage:
    python scripts/gallery.py OUT.html      the page, from the saved views (seconds, no model)
    python scripts/gallery.py --save-views  compute every view again and save it (a minute)

The saved views are fixtures, one per section of the registry: ``js/test/fixtures/views/NAME.json``
holds what a saved page holds for that view (its entries of the page's state: the view's
state, its buffers in base64, its ``_offline`` answers to a reader's clicks). The gallery and
the JavaScript tests (js/test/viewFixtures.test.js) render from them without computing; run
``--save-views`` again when a view's payload changes (test_gallery_browser.py fails on a view
of the registry without a fixture).

The views are computed from fixed inputs, no download: the explorer's views of the shipped
``attn-only-2l`` on a short text (its dataset examples from a small sweep of the Python stdlib
corpus, its task section from an induction task of random tokens), and the MLP neuron view of a small seeded random Llama (the shipped models are
attention-only). Each view is its own top-level widget, under a heading with its section
title; tests/browser/test_gallery_browser.py opens the page.
"""

from __future__ import annotations

import argparse
import html
import json
import pathlib
import re
import tempfile

import torch
import transformers

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.core.save_plan import PlanContext, Rate, SavePlan
from pycircuits_widgets.widgets.sharing.standalone import Page, content_policy, references, render_html
from pycircuits_widgets.widgets.views.registry import BY_NAME

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "js" / "test" / "fixtures" / "views"
TEXT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"
NEURON_IDS = [3, 7, 11, 3, 7, 11, 19, 2]


def mlp_model():
    """A two-layer Llama with MLPs, weights from a fixed seed (d_mlp 64, vocabulary 40)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    return pcw.from_hf(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval())


def induction_task(model) -> pcw.Task:
    """Four random token sequences repeated (clean), the repeat's tokens replaced (corrupted); the answer:
    the token the repeat continues with, against the corrupted sequence's (seeded)."""
    g = torch.Generator().manual_seed(0)
    first, other = torch.randint(100, 1000, (4, 6), generator=g), torch.randint(100, 1000, (4, 6), generator=g)
    return pcw.Task(model, torch.cat([first, first[:, :-1]], 1), torch.cat([first, other[:, :-1]], 1),
                    answers=[(int(a), int(b)) for a, b in zip(first[:, -1], other[:, -1])])


def gallery_views(store: pathlib.Path) -> dict[str, object]:
    """Section name -> view widget, one per view of the registry, computed (on-demand ones too);
    ``store``: where the examples' sweep is written."""
    attn_only = pcw.load_pretrained("attn-only-2l")
    sweep = pcw.sweep(attn_only, pcw.Corpus.python_stdlib(), store, seq_len=32, k=6, max_windows=32)
    views = {}
    for model, text, corpus, task in ((attn_only, TEXT, sweep, induction_task(attn_only)),
                                      (mlp_model(), NEURON_IDS, None, None)):
        # a token and a head pair selected, so the views that follow them show their detail
        explorer = pcw.CircuitExplorer(model, text, sweep=corpus, task=task, position=4, selected_pair=(0, 3, 1, 2))
        explorer.compute()
        rate = Rate.measure(model)  # what a saved page of a small model holds (save_html's plan, every item)
        SavePlan([item for name, view in explorer.views().items() for item in view.page_items(PlanContext(name, rate))],
                 budget_s=None, max_bytes=1 << 40, base_bytes=0).run()
        explorer.wait(timeout=600)
        if explorer.neurons is not None:
            explorer.neurons.neuron = 5  # a neuron's detail too
            explorer.wait(timeout=600)
        for name, view in explorer.views().items():
            views.setdefault(name, view)
    return views


def page_entries(page: str) -> list[dict]:
    """The entries of a saved page's state (its ``pcw-state`` script, strict JSON: non-finite
    numbers stay tagged), in the page's order: the shown views, then the children they refer to."""
    found = re.search(r'<script type="application/json" id="pcw-state">(.*?)</script>', page, re.DOTALL)
    return json.loads(found.group(1))["widgets"]


def save_views(folder: pathlib.Path = FIXTURES) -> list[pathlib.Path]:
    """Compute every view and write each one's page entries (the view first, then the children
    it refers to) to ``folder/NAME.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        views = gallery_views(pathlib.Path(tmp) / "sweep")
        entries = page_entries(render_html(list(views.values()), title="pycircuits_widgets gallery"))
    by_id = {e["model_id"]: e for e in entries}
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, view in views.items():
        own, queue = [], [view.model_id]
        while queue:
            entry = by_id.get(queue.pop(0))
            if entry is None or entry in own:
                continue
            own.append(entry)
            queue += references(entry["state"])
        path = folder / f"{name}.json"
        path.write_text(json.dumps({"widgets": [{**e, "el": None} for e in own]}, allow_nan=False) + "\n",
                        encoding="utf-8")
        written.append(path)
    return written


def gallery_html(folder: pathlib.Path = FIXTURES) -> str:
    """The gallery page from the saved views: each view under an ``<h2 data-view=NAME>`` with its
    section title, in the registry's order."""
    missing = [name for name in BY_NAME if not (folder / f"{name}.json").exists()]
    if missing:
        raise SystemExit(f"no saved view for {', '.join(missing)}: run python scripts/gallery.py --save-views")
    page, cells = Page({}), []
    for i, (name, spec) in enumerate(BY_NAME.items()):
        view, *children = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))["widgets"]
        page.entries += [{**view, "el": f"pcw-{i}"}, *children]
        cells.append(f'<h2 data-view="{name}">{html.escape(spec.title)}</h2>\n<div class="pcw-cell" id="pcw-{i}"></div>')
    body = "\n".join(cells)
    return f"""<!DOCTYPE html>
<html lang="en" class="pcw-page">
<head>
<meta charset="utf-8">
{content_policy(True)}
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>pycircuits_widgets gallery</title>
{page.styles()}
</head>
<body>
{body}
{page.scripts()}
</body>
</html>
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, nargs="?", help="the HTML file to write")
    parser.add_argument("--save-views", action="store_true", help="compute every view again and save it")
    args = parser.parse_args()
    if args.save_views:
        for path in save_views():
            print(path)
    if args.out:
        args.out.write_text(gallery_html(), encoding="utf-8")
        print(args.out)
    elif not args.save_views:
        parser.error("give OUT.html, --save-views, or both")


if __name__ == "__main__":
    main()
