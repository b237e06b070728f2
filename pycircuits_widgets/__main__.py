"""Command line: ``python -m pycircuits_widgets export NOTEBOOK.ipynb [-o OUT.html]``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pycircuits_widgets")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export",
        help="notebook saved with widget state -> one self-contained HTML file (no kernel, no network)",
    )
    export.add_argument("notebook", help="the .ipynb file (save it with widget state)")
    export.add_argument("-o", "--output", help="the HTML file to write (default: NOTEBOOK with .html; "
                        "never the notebook itself or any .ipynb)")
    export.add_argument("--title", help="page title (default: the notebook's title or file name)")
    args = parser.parse_args(argv)

    from .widgets.sharing.notebook_export import export_notebook

    try:
        out = export_notebook(args.notebook, args.output, title=args.title)
    except (OSError, ValueError) as exc:  # nothing written: an existing page is left as it was
        parser.exit(2, f"error: {exc}\n")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
