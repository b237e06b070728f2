"""Click-to-updated-view round trip in a live JupyterLab: browser click -> comm message ->
kernel trait change -> observer recomputes -> state update -> view re-rendered.

Run:  .venv/bin/python benchmarks/bench_roundtrip.py [--clicks 20] [--smoke]
(needs jupyterlab, playwright and Debian's chromium, as the e2e tests do)

Setup: tests/e2e/live_lab.py starts a real JupyterLab 4 server (127.0.0.1) and kernel;
headless Chromium opens a notebook with a ``ColoredTokens`` whose ``position``
observer recomputes the values (distance to the clicked token, a new float32 binary
buffer) and the legend label in the kernel. Each sample is timed in the page with
``performance.now()``: from the click to the DOM showing the kernel's new label
("DOM updated"), and to the next animation frame after it ("painted"). A few warm-up
clicks are not counted. Peers (CircuitsVis, bertviz) have no kernel round trip. ``--smoke``: one
click on the smallest view: checks that the script runs end to end (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import tempfile

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "e2e")]

from live_lab import JupyterLab, open_notebook, run_all_cells, write_notebook

from harness import CHROMIUM, CHROMIUM_ARGS

SIZES = (64, 1024)
WARMUP = 3

CELLS = """import numpy as np
import pycircuits_widgets as pcw
n = {n}
w = pcw.ColoredTokens([f" t{{i}}" for i in range(n)], np.zeros(n), label="none")
def recompute(change):
    i = change["new"]
    with w.hold_sync():
        w.values = np.abs(np.arange(n) - i)
        w.label = f"distance from {{i}}"
w.observe(recompute, "position")
w"""

# Clicks token i of the view and resolves when the kernel's recompute is in the DOM.
_CLICK_JS = """
async (i) => {
  const view = document.querySelector(".jp-OutputArea-output .pcw-colored-tokens");
  const want = `distance from ${i}`;
  const shown = () => view.querySelector('[data-testid="legend"] .label')?.textContent === want;
  const t0 = performance.now();
  const updated = new Promise((resolve, reject) => {
    const obs = new MutationObserver(() => {
      if (shown()) { obs.disconnect(); resolve(performance.now()); }
    });
    obs.observe(view, { subtree: true, childList: true, characterData: true, attributes: true });
    setTimeout(() => { obs.disconnect(); reject(new Error(`no "${want}" after 10 s`)); }, 10000);
  });
  view.querySelectorAll(".token")[i].click();
  const t1 = await updated;
  await new Promise((r) => requestAnimationFrame(() => r()));
  return [t1 - t0, performance.now() - t0];
}
"""


def measure(page, n: int, clicks: int) -> np.ndarray:
    """[clicks, 2] ms: (DOM updated, painted) for clicks on distinct tokens."""
    rng = np.random.default_rng(0)
    order = rng.permutation(n)[: clicks + WARMUP]
    samples = [page.evaluate(_CLICK_JS, int(i)) for i in order]
    return np.array(samples[WARMUP:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clicks", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="one click on the smallest view: checks that the script "
                        "runs end to end (its numbers mean nothing)")
    args = parser.parse_args()
    sizes = SIZES[:1] if args.smoke else SIZES
    if args.smoke:
        args.clicks = 1
    import anywidget
    import jupyterlab
    from playwright.sync_api import sync_playwright

    rows = []
    with tempfile.TemporaryDirectory() as tmp, JupyterLab(pathlib.Path(tmp)) as lab, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for n in sizes:
            name = f"roundtrip_{n}.ipynb"
            write_notebook(lab.root, name, [CELLS.format(n=n)])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            open_notebook(page, lab, name)
            run_all_cells(page)
            page.locator(".pcw-colored-tokens .token").first.wait_for()
            ms = measure(page, n, args.clicks)
            rows.append((n, ms))
            page.close()
            lab.shutdown_kernels()
        version = browser.version
        browser.close()

    print(f"Click -> kernel recompute -> view updated, live JupyterLab, {args.clicks} clicks (+{WARMUP} warm-up)")
    print(f"jupyterlab {jupyterlab.__version__}, anywidget {anywidget.__version__}, chromium {version}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}")
    print(f"{'widget':<16}{'tokens':>7}{'DOM p50':>10}{'DOM p95':>10}{'paint p50':>11}{'paint p95':>11}{'max':>9}  peer")
    for n, ms in rows:
        p50, p95 = np.percentile(ms, 50, axis=0), np.percentile(ms, 95, axis=0)
        print(f"{'ColoredTokens':<16}{n:>7}{p50[0]:>8.1f}ms{p95[0]:>8.1f}ms{p50[1]:>9.1f}ms{p95[1]:>9.1f}ms"
              f"{ms[:, 1].max():>7.0f}ms  n/a (no kernel round trip)")


if __name__ == "__main__":
    main()
