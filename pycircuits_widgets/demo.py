"""The demo: ``python -m pycircuits_widgets.demo [--out FILE] [--text TEXT]``.

Loads the shipped two-layer model, builds the circuit explorer on a short text that repeats
itself (so the induction head has something to do), selects the strongest induction head,
and writes the explorer as one self-contained HTML file: open it in any browser, offline.
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

SAMPLE_TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
)
"""A function written twice: the second copy is predictable by induction."""

MODEL = "attn-only-2l"
NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def build_explorer(text: str = SAMPLE_TEXT):
    """The explorer on ``text`` with the strongest induction head of the shipped 2-layer model selected."""
    import pycircuits_widgets as pcw

    model = pcw.load_pretrained(MODEL)
    induction = pcw.head_scores(model)["induction"]  # [L, H]
    layer, head = divmod(int(induction.argmax()), model.cfg.n_heads)
    explorer = pcw.CircuitExplorer(model, text, layer=layer, head=head)
    explorer.wait()
    return explorer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pycircuits_widgets.demo", description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", default="pycircuits_demo.html", help="HTML file to write (default: %(default)s)")
    parser.add_argument("--text", default=SAMPLE_TEXT, help="text the model reads (default: a repeated function)")
    args = parser.parse_args(argv)

    from .widgets.core.selection import head_label

    explorer = build_explorer(args.text)
    path = explorer.save_html(pathlib.Path(args.out), title=f"pycircuits_widgets demo: {MODEL}").resolve()
    print(f"Circuit explorer of {MODEL} (head {head_label(explorer.layer, explorer.head)}, the strongest induction head)")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): open it in a browser, no kernel or network needed")
    print(f"  file://{path}")
    if NOTEBOOKS.is_dir():  # a source checkout: the tutorial notebooks are beside the package
        print(f"The notebooks, live (clicks recompute in the kernel): .venv/bin/jupyter lab {NOTEBOOKS}")
        if importlib.util.find_spec("jupyterlab") is None:
            print("  (JupyterLab is not installed here; first: .venv/bin/pip install -e '.[notebooks]')")
    else:  # an installed wheel carries no notebooks: say how to get the live explorer in one
        print("Live in a notebook (clicks recompute in the kernel):")
        print(f"  import pycircuits_widgets as pcw; pcw.CircuitExplorer(pcw.load_pretrained({MODEL!r}), text)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
