"""Sizes of what a user shares: saved notebooks (widget state included) and HTML pages.

Executes notebooks with nbclient, storing widget state as JupyterLab's "save widget state"
does, and prints one table of sizes:

* the quick start notebook (notebooks/01_quickstart.ipynb) saved with widget state, and
  its ``python -m pycircuits_widgets export`` page;
* ``explorer.save_html`` of the quick start explorer;
* notebooks showing 1, 5 and 20 widgets (one ``ColoredTokens`` per cell), saved with
  widget state: how the saved size grows with the number of views.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_sharing.py [--smoke]

``--smoke``: only the notebook of 1 widget, saved and exported: checks that the script runs end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import nbclient
import nbformat

REPO = pathlib.Path(__file__).resolve().parent.parent
STATE = "application/vnd.jupyter.widget-state+json"


def execute(nb, path: pathlib.Path) -> pathlib.Path:
    nb.metadata.setdefault("kernelspec", {"name": "python3", "display_name": "Python 3", "language": "python"})
    env_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = env_path
    nbclient.NotebookClient(nb, store_widget_state=True, timeout=600, resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, str(path))
    return path


def widget_state_bytes(path: pathlib.Path) -> tuple[int, int]:
    """(bytes of the saved widget state, number of widget models)."""
    state = nbformat.read(str(path), 4).metadata.get("widgets", {}).get(STATE, {}).get("state", {})
    return len(json.dumps(state)), len(state)


def export(path: pathlib.Path) -> pathlib.Path:
    out = path.with_name(path.stem + "_page.html")
    cmd = [sys.executable, "-m", "pycircuits_widgets", "export", str(path), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    return out


def n_widgets_notebook(n: int):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import pycircuits_widgets as pcw")]
    nb.cells += [
        nbformat.v4.new_code_cell(f"pcw.ColoredTokens(['a{i}', ' b', ' c', ' d'], [0.5, {i}.0, 1.5, 2.0], label='v{i}')")
        for i in range(n)
    ]
    return nb


def mb(n: int) -> str:
    return f"{n / 1e6:.3f} MB"


def main(smoke: bool) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        if not smoke:
            quick = nbformat.read(str(REPO / "notebooks" / "01_quickstart.ipynb"), 4)
            saved = execute(quick, tmp / "01_quickstart.ipynb")
            state, models = widget_state_bytes(saved)
            rows.append(("quick start notebook, saved with widget state", mb(saved.stat().st_size),
                         f"state {mb(state)}, {models} models"))
            page = export(saved)
            rows.append(("quick start: `python -m pycircuits_widgets export` page", mb(page.stat().st_size), ""))
            explorer_page = tmp / "quickstart_explorer.html"  # the notebook's own save_html
            rows.append(("quick start: explorer.save_html", mb(explorer_page.stat().st_size), ""))
        for n in (1,) if smoke else (1, 5, 20):
            path = execute(n_widgets_notebook(n), tmp / f"n{n}.ipynb")
            state, models = widget_state_bytes(path)
            rows.append((f"{n} ColoredTokens in one notebook, saved", mb(path.stat().st_size), f"state {mb(state)}, {models} models"))
            if smoke:
                page = export(path)
                rows.append((f"{n} ColoredTokens: `python -m pycircuits_widgets export` page", mb(page.stat().st_size), ""))
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    width = max(len(r[0]) for r in rows)
    for what, size, note in rows:
        print(f"{what:<{width}}  {size:>10}  {note}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="only the notebook of 1 widget, saved and exported: "
                        "checks that the script runs end to end")
    main(parser.parse_args().smoke)
