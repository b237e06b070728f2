"""AttentionPatterns vs CircuitsVis ``attention_heads``: payload bytes and time until fully
rendered in headless Chromium, 12 heads at 128 / 512 / 1024 / 2048 tokens, same tensors.

Run:  .venv/bin/python benchmarks/bench_attention.py [--smoke]   (needs the `bench` extra: circuitsvis, playwright)

``--smoke``: one page of 16 tokens each and a 64-token build: checks that the script runs end to end
(its numbers mean nothing).

First the cold build (``AttentionPatterns(tokens=..., patterns=...)`` of 12 heads at 2048 / 4096
tokens, each in a fresh process): seconds and peak memory above the float32 input.

* ours: ``widget.save_html`` page; "rendered" = the view's ``pcw-attention-painted`` performance
  mark (grid thumbnails, detail heatmap with labels and token view drawn, then one frame).
  Payload = the widget's synced state as it crosses the comm (binary buffers + JSON, the JS
  bundle excluded), and the attention values it carries.
* CircuitsVis: its offline HTML (``attention_heads(...).local_src``, the JS bundle that ships
  in the wheel inlined, no CDN); "rendered" = all 12 thumbnails + the zoomed head present as
  canvases, then one frame. Payload = its props JSON (the page minus the bundle).
* Times are ms from navigation start (``performance.now()`` in the page). A CircuitsVis size
  that does not finish within CAP_S is reported as such and larger sizes are not attempted.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import platform
import sys
import tempfile

import numpy as np
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.sharing.standalone import widget_state

SIZES = (128, 512, 1024, 2048, 4096)
N_HEADS = 12
CAP_S = 60.0
CHROMIUM = os.environ.get("PCW_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]

# Polls every frame for "all canvases there", then stamps the time one frame later.
_CV_DONE_JS = """
(() => {
  const tick = () => {
    if (document.querySelectorAll("canvas").length >= %d) {
      requestAnimationFrame(() => { window.__cvDone = performance.now(); });
    } else requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
})();
"""


def causal_patterns(n: int, seed: int = 0) -> np.ndarray:
    """[N_HEADS, n, n] random causal softmax patterns (float32), built in place one head at a
    time (the process's peak memory stays at the patterns themselves)."""
    rng = np.random.default_rng(seed)
    out = np.empty((N_HEADS, n, n), dtype=np.float32)
    above = np.triu(np.ones((n, n), bool), 1)
    for s in out:
        rng.standard_normal((n, n), dtype=np.float32, out=s)
        s *= 3
        s[above] = -np.inf
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(-1, keepdims=True)
    return out


def represented_values(w) -> int:
    """Attention values the synced payloads stand for (a causal head of side n counts n^2)."""
    total = 0
    for name in ("overview", "full", "_detail"):
        p = w.get_state([name])[name]  # the payload as sent
        if p:
            lead = p["shape"][:-1] if p["layout"] == "causal" else p["shape"][:-2]
            total += int(np.prod(lead)) * p["n"] ** 2
    return total


def build_cost(n: int) -> dict:
    """Cold ``AttentionPatterns(tokens, patterns)`` of 12 heads x n tokens: seconds and peak
    memory above the float32 input (run in a fresh process: ``--build n``)."""
    import resource
    import time

    A, tokens = causal_patterns(n), [f" t{i}" for i in range(n)]
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    t = time.perf_counter()
    pcw.AttentionPatterns(tokens=tokens, patterns=A)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"n": n, "s": seconds, "above_input_mb": max(0.0, peak - rss), "input_mb": A.nbytes / 2**20}


def ours(page, A, tokens, tmp):
    w = pcw.AttentionPatterns(tokens=tokens, patterns=A)
    saved = widget_state([w])[w.model_id]
    binary = sum(len(base64.b64decode(b["data"])) for b in saved.get("buffers", []))
    json_bytes = len(json.dumps({k: v for k, v in saved["state"].items() if k != "_esm"}))
    values = represented_values(w)
    path = w.save_html(tmp / f"ours_{len(tokens)}.html")
    page.goto(path.as_uri())
    page.wait_for_selector(".pcw-attention[data-painted]", timeout=CAP_S * 1000)
    ms = page.evaluate("performance.getEntriesByName('pcw-attention-painted')[0].startTime")
    return {"ms": ms, "bytes": binary + json_bytes, "values": values}


def run_circuitsvis(page, A, tokens, tmp):
    import circuitsvis as cv

    html = cv.attention.attention_heads(A, tokens).local_src
    bundle = (pathlib.Path(cv.__file__).parent / "dist" / "cdn" / "iife.js").read_text(encoding="utf-8")
    payload = len(html.encode()) - len(bundle.replace("</script>", "").encode())
    path = tmp / f"cv_{len(tokens)}.html"
    path.write_text(f"<!DOCTYPE html><html><body>{html}</body></html>", encoding="utf-8")
    page.add_init_script(_CV_DONE_JS % (N_HEADS + 1))
    page.goto(path.as_uri(), timeout=CAP_S * 1000)
    try:
        page.wait_for_function("window.__cvDone !== undefined", timeout=CAP_S * 1000, polling=200)
    except PlaywrightTimeout:  # did not finish within the cap
        return {"ms": None, "bytes": payload}
    return {"ms": page.evaluate("window.__cvDone"), "bytes": payload}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one 16-token page each and a 64-token build: checks "
                        "that the script runs end to end (its numbers mean nothing)")
    parser.add_argument("--build", type=int, help=argparse.SUPPRESS)  # one cold build, in a fresh process
    args = parser.parse_args()
    if args.build:
        return print(json.dumps(build_cost(args.build)))
    import subprocess

    sizes, builds = ((16,), (64,)) if args.smoke else (SIZES, (2048, 4096))
    print(f"# AttentionPatterns build, {N_HEADS} heads, cold (fresh process each); load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for n in builds:
        out = subprocess.run([sys.executable, __file__, "--build", str(n)], capture_output=True, text=True, check=True)
        b = json.loads(out.stdout)
        print(f"#   {n} tokens: {b['s']:.2f} s, peak {b['above_input_mb']:.0f} MB above the {b['input_mb']:.0f} MB input "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    rows = []
    cv_gave_up = None
    with tempfile.TemporaryDirectory() as d, sync_playwright() as pw:
        tmp = pathlib.Path(d)
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for n in sizes:
            A = causal_patterns(n)
            tokens = [f" t{i}" for i in range(n)]
            context = browser.new_context(viewport={"width": 1200, "height": 900})
            # Offline: only file:// loads; anything else would be a CDN fetch.
            context.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
            ctx_page = context.new_page()
            o = ours(ctx_page, A, tokens, tmp)
            context.close()
            c = None
            if cv_gave_up is None:
                context = browser.new_context(viewport={"width": 1200, "height": 900})
                context.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
                c = run_circuitsvis(context.new_page(), A, tokens, tmp)
                context.close()
                if c["ms"] is None:  # larger sizes would not finish either
                    cv_gave_up = n
            rows.append((n, o, c))
            print(f"  done n={n}", file=sys.stderr, flush=True)
        browser.close()

    from importlib.metadata import version

    import circuitsvis

    print(f"# CircuitsVis stopped after {cv_gave_up} tokens (did not finish within the cap)"
          if cv_gave_up else "# CircuitsVis finished every size")
    print(f"# AttentionPatterns vs CircuitsVis attention_heads, {N_HEADS} heads, headless Chromium")
    print(f"# load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}; B/attn value = bytes over the "
          "attention values the payloads stand for (a causal head of n tokens counts n^2)")
    print(f"# python {platform.python_version()}, numpy {np.__version__}, circuitsvis {circuitsvis.__version__}, "
          f"playwright {version('playwright')}, cpus {os.cpu_count()}, cap {CAP_S:.0f} s")
    head = (f"{'tokens':>6} | {'ours ms':>8} | {'ours bytes':>11} | {'B/attn value':>12} | {'CV ms':>9} | "
            f"{'CV bytes':>11} | {'speed x':>7} | {'bytes x':>7}")
    print(head)
    print("-" * len(head))
    for n, o, c in rows:
        if c is None:
            cv_ms, cv_b, sp, bx = "skipped", "-", "-", "-"
        elif c["ms"] is None:
            cv_ms, cv_b, sp, bx = f">{CAP_S:.0f}s", f"{c['bytes']:,}", "-", f"{c['bytes'] / o['bytes']:.0f}"
        else:
            cv_ms, cv_b = f"{c['ms']:.0f}", f"{c['bytes']:,}"
            sp, bx = f"{c['ms'] / o['ms']:.1f}", f"{c['bytes'] / o['bytes']:.0f}"
        print(f"{n:>6} | {o['ms']:>8.0f} | {o['bytes']:>11,} | {o['bytes'] / o['values']:>12.3f} | {cv_ms:>9} | "
              f"{cv_b:>11} | {sp:>7} | {bx:>7}")


if __name__ == "__main__":
    main()
