"""CircuitExplorer click round trip in a live JupyterLab: click a head thumbnail -> comm
message -> kernel selection -> every view's observer -> kernel recomputes (skip-trigram
table, eigenvalue detail, ...) -> state updates -> views re-rendered.

Run:  .venv/bin/python benchmarks/bench_explorer.py [--clicks 20] [--model gpt2-small]
(needs jupyterlab, playwright and Debian's chromium, as the e2e tests do)

Setup: tests/e2e/live_lab.py's JupyterLab 4 server and kernel; headless Chromium opens a
notebook with ``pcw.CircuitExplorer(model, text)`` on the quick start's text, where model is
the shipped ``attn-only-2l`` (default) or, with ``--model gpt2-small``, a GPT-2-small-shaped
model (``transformers.GPT2Config`` defaults, 12 layers x 12 heads, d_model 768, MLPs, with GPT-2's
50257 tokens padded to 50304 as nanoGPT trains it: the explorer takes a smaller tokenizer only for a
vocabulary padded to a multiple of 64) with random weights built in the kernel, read through ``pcw.from_hf`` with a
byte-level BPE tokenizer trained on the text (nothing is downloaded). Each click selects a different head in the attention view; timed in the
page with ``performance.now()`` from the click to:

* "header": the explorer's header names the new head (kernel echo of the selection);
* "all views": additionally the skip-trigram table shows the new head's exact top-k (not
  the partial first block) and the eigenvalue detail shows its spectrum and copied tokens;
* "painted": the next animation frame after "all views".

A few warm-up clicks are not counted. Peers (CircuitsVis, bertviz) have no kernel round trip.

``--trace``: the timed clicks are also recorded in a Chromium trace, and the page's main-thread work
per click is printed by kind (``PAGE_WORK``: script, style, layout, paint, compositing), to tell
the page's share of a click from the kernel's.

``--profile``: the timed clicks are also sampled by the page's JavaScript profiler (DevTools'
``Profiler`` domain), and the script's self time per click is printed by where its code comes from
(``script_origins``: this package's bundle, JupyterLab and its extensions, the browser's own
functions, garbage collection), with the five busiest functions of each.

``--busy N``: the warm-up and timed clicks run beside N single-core busy processes (``busy.py``; the
setup and the fill do not), as on a user's busy machine; the load average is printed at the end.

``--smoke``: one click after one warm-up, on the shipped model: checks that the script runs end to end.

``--model llama-135m``: ``bench_build``'s 30-layer LLaMA shape (30 x 9 heads, 3 key-value heads,
d_model 576, MLP 1536, d_vocab 49152, rotary), random weights, the same trained tokenizer.

``--fill`` (clicks after the background fill): the explorer's background fill
(``CircuitExplorer.start_background``, started when it is shown) runs first, timed in the kernel
until every head is done (``explorer.wait_background``), or with ``--fill-heads N`` until the first
N heads of its order are (the shown head, then layer by layer; the fill is then stopped); the clicks
then go to filled heads only. Without it the clicks share the CPU with the fill (which gives way to them) and most heads
are first visits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import sys
import tempfile

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "e2e")]

from live_lab import JupyterLab, kernel_eval, kernel_exec, open_notebook, run_all_cells, write_notebook

from busy import busy, expected_slowdown
from harness import CHROMIUM, CHROMIUM_ARGS

WARMUP = 3
SETUP = "import pycircuits_widgets as pcw\nfrom pycircuits_widgets.demo import SAMPLE_TEXT\n"
_TRAINED_TOKENIZER = (
    "import torch, transformers\n"
    "from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers\n"
    "tok = Tokenizer(models.BPE())\n"
    "tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)\n"
    "tok.decoder = decoders.ByteLevel()\n"
    "tok.train_from_iterator([SAMPLE_TEXT], trainers.BpeTrainer(vocab_size=400, special_tokens=['<|endoftext|>'],\n"
    "                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))\n"
    "tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|endoftext|>')\n"
    "torch.manual_seed(0)\n"
)
MODELS = {
    "attn-only-2l": "model = pcw.load_pretrained('attn-only-2l')\n",
    "gpt2-small": _TRAINED_TOKENIZER + (
        "hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50304)).eval()\n"
        "model = pcw.from_hf(hf, tok)\n"
    ),
    "llama-135m": _TRAINED_TOKENIZER + (
        "config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,\n"
        "    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,\n"
        "    max_position_embeddings=2048, rms_norm_eps=1e-5)\n"
        "hf = transformers.LlamaForCausalLM(config).eval()\n"
        "model = pcw.from_hf(hf, tok)\n"
    ),
}
# the fill's wall time in the kernel: every head, or until the first N of its order are done
_FILL = """
import json as _json, time as _time
from pycircuits_widgets.widgets.views.explorer import FILLING as _FILLING
explorer.causal.stop_background()  # (queued before the fill: this times the fill alone)
_t0 = _time.perf_counter()
if {n} is None:
    explorer.wait_background(None)
else:
    while not (explorer.progress.get("text") == _FILLING and explorer.progress.get("done", 0) >= {n}) \
            and not explorer.wait_background(0.5):
        pass
    explorer.stop_background()  # the clicks do not share the CPU with the rest of the fill
print(_json.dumps([_time.perf_counter() - _t0, explorer.progress.get("done")]))
"""
SHOW = "explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT)\nexplorer"

# Clicks head (l, h) and resolves with [header ms, all views ms, painted ms].
_CLICK_JS = """
async ([l, h]) => {
  const root = document.querySelector(".jp-OutputArea-output .pcw-explorer");
  const q = (s) => root.querySelector(s);
  const header = () => q("[data-testid=selected-head]")?.textContent === `L${l}.H${h}`;
  const table = () => {
    const c = q("section[data-view=trigrams] caption")?.textContent ?? "";
    // "head L1.H6" (one head spelling) or "head 1.6" (older pages)
    return (c.includes(`skip-trigrams of head ${l}.${h}`) || c.includes(`skip-trigrams of head L${l}.H${h}`))
      && !c.includes("partial");
  };
  const eigen = () => {
    const d = q("section[data-view=eigen] [data-testid=detail]");
    return !!d && (d.textContent.includes(`head ${l}.${h}:`) || d.textContent.includes(`head L${l}.H${h}:`))
      && !!d.querySelector("[data-testid=copies]");
  };
  const t0 = performance.now();
  let tHeader = null;
  const done = new Promise((resolve, reject) => {
    const check = () => {
      if (tHeader === null && header()) tHeader = performance.now();
      if (tHeader !== null && table() && eigen()) { obs.disconnect(); resolve(performance.now()); return true; }
      return false;
    };
    const obs = new MutationObserver(check);
    obs.observe(root, { subtree: true, childList: true, characterData: true, attributes: true });
    setTimeout(() => {
      obs.disconnect();
      const shown = (s) => JSON.stringify(q(s)?.textContent?.slice(0, 200) ?? null);
      reject(new Error(`head L${l}.H${h} not shown after 120 s: header ${shown("[data-testid=selected-head]")}, `
        + `table ${shown("section[data-view=trigrams] caption")}, eigen ${shown("section[data-view=eigen] [data-testid=detail]")}`));
    }, 120000);
  });
  q(`section[data-view=attention] button.thumb[data-layer="${l}"][data-head="${h}"]`).click();
  const tAll = await done;
  await new Promise((r) => requestAnimationFrame(() => r()));
  return [tHeader - t0, tAll - t0, performance.now() - t0];
}
"""


# Chromium trace events of the renderer's main thread, by the kind of work they are (the names are
# DevTools' timeline events; nested events of one kind are counted once, at the outermost, and an
# event nested in one of another kind counts in both: a forced layout inside a script is script and layout)
PAGE_WORK = {
    "script": ("FunctionCall", "EvaluateScript", "v8.callFunction", "TimerFire", "FireAnimationFrame",
               "EventDispatch", "RunMicrotasks", "V8.GCScavenger", "MajorGC", "MinorGC"),
    "style": ("UpdateLayoutTree", "RecalculateStyles", "ParseAuthorStyleSheet"),
    "layout": ("Layout", "IntersectionObserverController::computeIntersections"),
    "paint": ("PrePaint", "Paint", "PaintImage", "Decode Image"),
    "compositing": ("Layerize", "UpdateLayer", "Commit", "UpdateLayerTree"),
}


def page_work(trace: dict, clicks: int) -> dict[str, float]:
    """Milliseconds per click of the renderer main thread's work by kind (``PAGE_WORK``), and
    ``"main thread"``: all of its top-level tasks."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    main = {(e["pid"], e["tid"]) for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name" and e["args"].get("name") == "CrRendererMain"}
    kind_of = {name: kind for kind, names in PAGE_WORK.items() for name in names}
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                   if e.get("ph") == "X" and (e["pid"], e["tid"]) in main)
    totals = dict.fromkeys([*PAGE_WORK, "main thread"], 0.0)
    open_until = dict.fromkeys([*PAGE_WORK, "task"], -1.0)
    for start, end, name in spans:
        kind = "task" if name in ("RunTask", "ThreadControllerImpl::RunTask") else kind_of.get(name)
        if kind is None or start < open_until[kind]:
            continue  # not counted, or nested in an event of its kind already counted
        open_until[kind] = end
        totals["main thread" if kind == "task" else kind] += (end - start) / 1000
    return {kind: ms / clicks for kind, ms in totals.items()}


def script_origins(profile: dict, clicks: int, bundle: str) -> tuple[dict[str, float], dict[str, list]]:
    """``({origin: ms per click}, {origin: [(function, ms per click)]})`` of a DevTools CPU profile's
    self time: origins "pycircuits_widgets" (scripts whose URL contains ``bundle``: anywidget imports
    the bundle from a ``blob:`` URL), "JupyterLab" (the server's own scripts: JupyterLab and its
    extensions, ipywidgets included), "browser" (functions with no script: DOM, canvas, a layout a
    read forces; each named with whose script called it), "garbage collection"; idle and the
    profiler's "(program)" are left out. The second holds each origin's five busiest functions (the
    bundle's minified, with line and column)."""
    nodes = {node["id"]: node["callFrame"] for node in profile["nodes"]}
    parent = {child: node["id"] for node in profile["nodes"] for child in node.get("children", ())}

    def script(url: str) -> str:
        return "pycircuits_widgets" if bundle in url else "JupyterLab"

    def caller(node: int) -> str:  # whose script called a browser function
        while (node := parent.get(node)) is not None:
            if nodes[node]["url"]:
                return script(nodes[node]["url"])
        return "no script"

    self_us: dict[int, float] = {}
    for sample, delta in zip(profile["samples"], profile["timeDeltas"]):
        self_us[sample] = self_us.get(sample, 0.0) + delta
    functions: dict[str, dict[str, float]] = {o: {} for o in ("pycircuits_widgets", "JupyterLab", "browser",
                                                              "garbage collection")}
    for node, us in self_us.items():
        frame = nodes[node]
        name, url = frame["functionName"] or "(anonymous)", frame["url"]
        if name in ("(idle)", "(program)", "(root)"):
            continue
        origin = "garbage collection" if name == "(garbage collector)" else script(url) if url else "browser"
        where = f"{name}:{frame['lineNumber'] + 1}:{frame['columnNumber'] + 1}" if url else f"{name} ({caller(node)})"
        functions[origin][where] = functions[origin].get(where, 0.0) + us / 1000 / clicks
    totals = {origin: sum(f.values()) for origin, f in functions.items()}
    busiest = {origin: sorted(f.items(), key=lambda item: -item[1])[:5] for origin, f in functions.items()}
    return totals, busiest


# what the kernel holds, where a click's views never showed its head
_KERNEL_STATE = ("{'explorer': [explorer.layer, explorer.head, explorer.busy, explorer.error], 'views': "
                 "{n: [v.layer, v.head, v.busy, v.error] for n, v in explorer.views().items() if hasattr(v, 'head')}, "
                 "'table': [explorer.trigrams.trigrams.get(k) for k in ('layer', 'head', 'exact')]}")


def click(page, head: tuple[int, int]) -> list[float]:
    """``_CLICK_JS`` on ``head``; where its views never show it, the error says what the kernel holds."""
    from playwright.sync_api import Error

    try:
        return page.evaluate(_CLICK_JS, list(head))
    except Error as exc:
        raise RuntimeError(f"{exc.message}\nthe kernel: {kernel_eval(page, _KERNEL_STATE)}") from exc


def heads_to_click(all_heads: list[tuple[int, int]], clicks: int, start: tuple[int, int]) -> list[tuple[int, int]]:
    """A seeded sequence of ``all_heads``, each different from the one before it."""
    rng = np.random.default_rng(0)
    out, current = [], start
    while len(out) < clicks:
        nxt = all_heads[rng.integers(len(all_heads))]
        if nxt != current:
            out.append(nxt)
            current = nxt
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clicks", type=int, default=20)
    parser.add_argument("--model", choices=sorted(MODELS), default="attn-only-2l")
    parser.add_argument("--fill", action="store_true", help="click after the background fill (module docstring)")
    parser.add_argument("--fill-heads", type=int, default=None, help="with --fill: wait for the first N heads only")
    parser.add_argument("--trace", action="store_true", help="the page's main-thread work per click (module docstring)")
    parser.add_argument("--profile", action="store_true", help="the page's script time per click by origin (module docstring)")
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="click beside N single-core busy processes "
                        "(module docstring)")
    parser.add_argument("--smoke", action="store_true", help="one click (after one warm-up) on the shipped model: "
                        "checks that the script runs end to end (its numbers mean nothing)")
    args = parser.parse_args()
    warmup = 1 if args.smoke else WARMUP
    if args.smoke:
        args.clicks, args.model = 1, "attn-only-2l"
    import anywidget
    import jupyterlab
    from playwright.sync_api import sync_playwright

    cells = [SETUP + MODELS[args.model] + SHOW]
    with tempfile.TemporaryDirectory() as tmp, JupyterLab(pathlib.Path(tmp), start_timeout=300) as lab, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        write_notebook(lab.root, "explorer.ipynb", cells)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        open_notebook(page, lab, "explorer.ipynb")
        run_all_cells(page)
        page.locator(".pcw-explorer section[data-view=attention] button.thumb").first.wait_for(timeout=600_000)
        shape = kernel_eval(page, "[model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_vocab]")
        n_layers, n_heads, d_vocab = shape
        heads = [(l, h) for l in range(n_layers) for h in range(n_heads)]  # the fill's order from (0, 0)
        filled = None
        if args.fill:
            fill_s, done = json.loads(kernel_exec(page, _FILL.format(n=args.fill_heads)).strip().splitlines()[-1])
            filled = len(heads) if args.fill_heads is None else max(args.fill_heads, done or 0)
            heads = heads[:filled]
            fill_load = os.getloadavg()[0]
        order = heads_to_click(heads, args.clicks + warmup, (0, 0))
        loaded = contextlib.ExitStack()
        loaded.enter_context(busy(args.busy))
        for head in order[:warmup]:
            click(page, head)
        if args.trace:
            browser.start_tracing(page=page, categories=["devtools.timeline", "disabled-by-default-devtools.timeline"])
        if args.profile:
            cdp = page.context.new_cdp_session(page)
            cdp.send("Profiler.enable")
            cdp.send("Profiler.start")
        ms = np.array([click(page, head) for head in order[warmup:]])
        click_load = os.getloadavg()[0]
        loaded.close()
        work = page_work(json.loads(browser.stop_tracing()), args.clicks) if args.trace else None
        origins = script_origins(cdp.send("Profiler.stop")["profile"], args.clicks, "blob:") if args.profile else None
        version = browser.version
        browser.close()

    print(f"CircuitExplorer head click -> kernel recompute -> views updated, live JupyterLab, "
          f"{args.clicks} clicks (+{warmup} warm-up), {args.model} ({n_layers}x{n_heads} heads, d_vocab {d_vocab})")
    print(f"jupyterlab {jupyterlab.__version__}, anywidget {anywidget.__version__}, chromium {version}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}")
    if args.busy:
        print(f"clicks beside {args.busy} busy processes (fair sharing alone: a 2-thread job "
              f"{expected_slowdown(2, args.busy):.2f}x slower); load avg {click_load:.1f} at the last click")
    if filled is not None:
        print(f"background fill: {fill_s:.0f} s for {filled} of {n_layers * n_heads} heads "
              f"({fill_s / filled:.1f} s each, load avg {fill_load:.1f} at its end); clicks on filled heads only")
    print(f"{'until':<12}{'p50':>9}{'p95':>9}{'max':>9}  peer")
    for i, name in enumerate(["header", "all views", "painted"]):
        col = ms[:, i]
        print(f"{name:<12}{np.percentile(col, 50):>7.1f}ms{np.percentile(col, 95):>7.1f}ms{col.max():>7.0f}ms"
              "  n/a (no kernel round trip)")
    if work is not None:
        print("page main-thread work per click: " + ", ".join(f"{kind} {v:.1f} ms" for kind, v in work.items()))
    if origins is not None:
        by_origin, busiest = origins
        print("page script self time per click: " + ", ".join(f"{o} {v:.1f} ms" for o, v in by_origin.items()))
        for origin in ("pycircuits_widgets", "JupyterLab", "browser"):
            print(f"  {origin}'s busiest: " + ", ".join(f"{f} {v:.1f} ms" for f, v in busiest[origin]))


if __name__ == "__main__":
    main()
