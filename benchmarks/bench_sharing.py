"""Sizes of what a user shares: saved notebooks (widget state included) and HTML pages.

Executes notebooks with nbclient, storing widget state as JupyterLab's "save widget state"
does, and prints one table of sizes:

* the quick start notebook (notebooks/01_quickstart.ipynb) saved with widget state, and
  its ``python -m pycircuits_widgets export`` page;
* ``explorer.save_html`` of the quick start explorer;
* notebooks showing 1, 5 and 20 widgets (one ``ColoredTokens`` per cell), saved with
  widget state: how the saved size grows with the number of views.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_sharing.py [--smoke]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_sharing.py --plan [--windows 384 --seq-len 64 --budget 60]

``--smoke``: only the notebook of 1 widget, saved and exported: checks that the script runs end to end.

``--plan``: the saved page of a 270-head model (SmolLM2-135M's shape, random weights: 30 layers x 9 heads,
d_model 576, d_vocab 49152, d_mlp 1536) with a corpus sweep of ``--windows`` windows (20 examples of each
head): ``explorer.save_html`` with the default ``max_bytes`` and ``--budget`` seconds; prints the page's
size, what its plan kept (estimated and measured seconds) and what it says it left out.
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


def plan_page(windows: int, seq_len: int, budget: float, out: pathlib.Path | None = None) -> None:
    """``--plan`` (module docstring); ``out``: where to keep the saved page (to open it, or take its picture)."""
    import html
    import re
    import time

    import torch
    import transformers

    import pycircuits_widgets as pcw
    from bench_build import SHAPES, text_of, tokenizer
    from pycircuits_widgets.widgets.core import save_plan

    timed = []  # (item, units, estimated s, measured s): each kept item as the save runs it
    run = save_plan.SavePlan.run

    def timing_run(plan, bar=None):  # SavePlan.run, each kept item timed
        for item, n in plan.left:
            if n == item.units and item.leave is not None:
                item.leave()
        for item, n in plan.kept:
            began = time.perf_counter()
            item.run(n)
            timed.append((item, n, item.seconds(n), time.perf_counter() - began))

    torch.manual_seed(0)
    tok = tokenizer()
    hf = transformers.AutoModelForCausalLM.from_config(SHAPES["llama-135m"](), attn_implementation="eager").eval()
    model = pcw.from_hf(hf, tok)
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        sweep = pcw.sweep(model, pcw.Corpus.python_stdlib(), pathlib.Path(tmp) / "store", seq_len=seq_len, k=20,
                          max_windows=windows, progress=False)
        swept = time.perf_counter() - began
        explorer = pcw.CircuitExplorer(model, text_of(tok, 40), sweep=sweep)
        save_plan.SavePlan.run = timing_run
        try:
            began = time.perf_counter()
            path = explorer.save_html(pathlib.Path(tmp) / "page.html", budget=budget)
            saved = time.perf_counter() - began
        finally:
            save_plan.SavePlan.run = run
            explorer.close()
        page = path.read_text()
        if out is not None:
            out.write_text(page)
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; sweep of {windows} windows of {seq_len} "
          f"tokens: {swept:.0f} s; save_html(budget={budget:g}): {saved:.1f} s, {mb(len(page.encode()))}")
    for item, n, estimate, measured in timed:
        print(f"  kept  {item.section}: {item.phrase(n)}: estimated {estimate:.1f} s, took {measured:.1f} s")
    said = re.search(r'<section class="pcw-plan">(.*?)</section>', page, re.DOTALL).group(1)
    for line in re.findall(r"<p>(.*?)</p>|<li>(.*?)</li>", said):
        print("  page:", html.unescape(line[0] or "  - " + line[1]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="only the notebook of 1 widget, saved and exported: "
                        "checks that the script runs end to end")
    parser.add_argument("--plan", action="store_true", help="the saved page of a 30 x 9-head model (module docstring)")
    parser.add_argument("--windows", type=int, default=384, help="--plan: windows of the corpus sweep")
    parser.add_argument("--seq-len", type=int, default=64, help="--plan: tokens of each window")
    parser.add_argument("--budget", type=float, default=60.0, help="--plan: save_html's budget in seconds")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="--plan: keep the saved page at this path")
    args = parser.parse_args()
    if args.plan:
        plan_page(args.windows, args.seq_len, args.budget, args.out)
    else:
        main(args.smoke)
