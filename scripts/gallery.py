"""Build the view gallery: every view of the widget bundle on one offline HTML page, so a
reviewer sees them all at once (as CircuitsVis's stories do for its components).

Usage: ``python scripts/gallery.py OUT.html``

The views are built from fixed inputs, no download: the explorer's views of the shipped
``attn-only-2l`` on a short text (its dataset examples from a small sweep of the Python stdlib
corpus), and the MLP neuron view of a small seeded random Llama (the shipped models are
attention-only). Each view is its own top-level widget, under a
heading with its section title; tests/browser/test_gallery_browser.py opens the page.
"""

from __future__ import annotations

import argparse
import html
import pathlib
import tempfile

import torch
import transformers

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.sharing.standalone import render_html
from pycircuits_widgets.widgets.views.registry import BY_NAME

TEXT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"
NEURON_IDS = [3, 7, 11, 3, 7, 11, 19, 2]


def mlp_model():
    """A two-layer Llama with MLPs, weights from a fixed seed (d_mlp 64, vocabulary 40)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    return pcw.from_hf(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval())


def gallery_views(store: pathlib.Path) -> dict[str, object]:
    """Section name -> view widget, one per view of the registry, computed (on-demand ones too);
    ``store``: where the examples' sweep is written."""
    attn_only = pcw.load_pretrained("attn-only-2l")
    sweep = pcw.sweep(attn_only, pcw.Corpus.python_stdlib(), store, seq_len=32, k=6, max_windows=32)
    views = {}
    for model, text, corpus in ((attn_only, TEXT, sweep), (mlp_model(), NEURON_IDS, None)):
        explorer = pcw.CircuitExplorer(model, text, sweep=corpus)
        explorer.compute()
        explorer.wait(timeout=600)
        for name, view in explorer.views().items():
            views.setdefault(name, view)
    return views


def gallery_html() -> str:
    """The gallery page: each view under an ``<h2 data-view=NAME>`` with its section title."""
    with tempfile.TemporaryDirectory() as tmp:
        views = gallery_views(pathlib.Path(tmp) / "sweep")
        page = render_html(list(views.values()), title="pycircuits_widgets gallery")
    # render_html lays the views out in order, one cell each; a heading names each cell
    cells = page.split('<div class="pcw-cell"')
    if len(cells) != len(views) + 1:
        raise RuntimeError(f"the page has {len(cells) - 1} view cells for {len(views)} views")
    out = [cells[0]]
    for name, cell in zip(views, cells[1:]):
        out.append(f'<h2 data-view="{name}">{html.escape(BY_NAME[name].title)}</h2>\n<div class="pcw-cell"{cell}')
    return "".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the HTML file to write")
    args = parser.parse_args()
    args.out.write_text(gallery_html(), encoding="utf-8")
    print(args.out)


if __name__ == "__main__":
    main()
