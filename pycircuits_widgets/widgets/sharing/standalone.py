"""Self-contained HTML pages of widgets: no kernel, no CDN, no network.

One path serves ``save_html`` and the notebook exporter (:mod:`.notebook_export`): both
start from widget state in the format a notebook saves
(``application/vnd.jupyter.widget-state+json``: model id -> ``{model_name, model_module,
state, buffers}``). For live widgets that state comes from ipywidgets' public
``ipywidgets.embed.dependency_state`` (the widgets and every widget they reference);
for a notebook, from its saved metadata. :class:`Page` turns it into page entries:

* Trust boundary: the page inlines only this package's own bundle, once, and its
  Content-Security-Policy (:func:`content_policy`) lets the browser run nothing else: no
  other inline script, event handler or ``javascript:`` URL, no network. A saved
  ``_esm``/``_css`` is ignored (a notebook's state can say anything); models of other
  widget libraries are shown as a placeholder with their text, never run.
* Without JavaScript each view shows (``<noscript>``) its Python-drawn picture
  (:mod:`.pictures`) of the state the page holds.
* Non-finite floats (NaN, +-inf) travel as ``{"__pcw_nonfinite__": "NaN"}`` and the page's
  JSON reader turns them back into numbers: the page JSON is strict (no bare ``NaN``,
  which would make the whole page fail to parse).
* Writes are atomic (:func:`write_atomic`): a failure leaves any existing file intact.

A small kernel-less host in the bundle (``js/src/lib/host.js``) gives every view a model
object with anywidget's front-end API, so all interactions that need no kernel work.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import html
import json
import math
import os
import pathlib
import tempfile
import time

import ipywidgets
from ipywidgets.embed import dependency_state

from ...models.tokenizer import escape_invisible
from ...progress import progress
from ..core.arrays import ARRAY_TRAITS
from ..core.base import CircuitWidget
from ..core.bundle import bundle_packed, packed_css_bytes
from ..core.offline import tag_nonfinite
from ..core.payload import JSON_BUFFER
from ..core.save_plan import PlanContext, Rate, SavePlan, check_heads, check_max_bytes

OURS = "pycircuits_widgets."
"""Prefix of ``_anywidget_id`` (module path of the class) of this package's widgets."""
_BOX_DIRECTION = {"BoxModel": "column", "VBoxModel": "column", "GridBoxModel": "column", "HBoxModel": "row"}
# Dropped from every saved state: code is never taken from state (see the module doc);
# layout is a separate ipywidgets model that the kernel-less host does not have.
_DROPPED = ("_esm", "_css", "layout")

# The page as the views' host: its colours are the views' palette (the --pcw-* tokens of
# js/src/components/view.css, which styles <html class="pcw-page"> and its dark mode), added
# with the bundle's CSS as the first view mounts. Until then, and on a page without views or
# without JavaScript, the browser's own light or dark colours (color-scheme).
_THEME_CSS = """
:root { color-scheme: light dark; }
body { margin: 16px; }
.pcw-cell { margin-bottom: 24px; }
"""
# Placeholders for other libraries' widgets, in the same palette (a token not loaded leaves
# the border in the text colour).
_PLACEHOLDER_CSS = """
.pcw-placeholder { border: 1px dashed; border-color: var(--pcw-border); border-radius: 4px;
  padding: 6px 8px; margin: 4px 0; }
.pcw-placeholder > p { font-size: 12px; color: var(--pcw-text-muted); margin: 2px 0; }
"""

# Unpacks the inlined bundle (its CSS then its javascript, gzipped together, base64: a third
# of their size; bundle.py `bundle_packed`), loads the javascript the way anywidget does (an
# ES module from a Blob URL), hands it the CSS (added to the page once, as the first view
# mounts), and mounts every saved widget with its kernel-less host. `window.pcwBridge`, when a test
# harness defines it, forwards changes to a live Python widget; a shared page has none
# and runs without a kernel. A widget that fails to mount shows why; the others still
# mount.
_BOOT_JS = """
const bridge = window.pcwBridge;
const carrier = document.querySelector("script.pcw-bundle");
const packed = carrier.textContent;
const bytes = Uint8Array.from(atob(packed), (c) => c.charCodeAt(0));
// Inflated 16 KiB of input at a time, each step only when the last one's output was read
// (a stream's transform inflates a whole input chunk at once), and stopped past 16 MiB (the
// bundle is about 0.3 MB): never a gzip bomb.
const gunzip = new DecompressionStream("gzip");
const feed = (async () => {
  const writer = gunzip.writable.getWriter();
  for (let at = 0; at < bytes.length; at += 1 << 14) await writer.write(bytes.subarray(at, at + (1 << 14)));
  await writer.close();
})();
feed.catch(() => {}); // a refused bundle stops the feed; the reader reports why
const inflating = gunzip.readable.getReader();
const chunks = [];
for (let size = 0; ; ) {
  const { done, value } = await inflating.read();
  if (done) break;
  size += value.length;
  if (size > 16 << 20) {
    inflating.cancel();
    throw new Error("pycircuits_widgets: the page's bundle inflates past 16 MiB; not loaded");
  }
  chunks.push(value);
}
const both = new Blob(chunks);
const cssBytes = Number(carrier.dataset.cssBytes);
if (!Number.isSafeInteger(cssBytes) || cssBytes < 0 || cssBytes > both.size) {
  throw new Error(`pycircuits_widgets: the page's bundle says its CSS is ${carrier.dataset.cssBytes} of its ${both.size} bytes; not loaded`);
}
const url = URL.createObjectURL(both.slice(cssBytes, both.size, "text/javascript"));
const mod = await import(url);
mod.useStyles(await both.slice(0, cssBytes).text());
const host = mod.createHost(mod.default, bridge ? bridge.hooks : {});
const saved = mod.parseTagged(document.getElementById("pcw-state").textContent);
// the models (tests read them) and a view's figure (CircuitWidget.save_figure calls it)
window.pcwHost = { models: host.models, figure: mod.figure };
const failures = [];
// Register every saved model first: composite views resolve their children (entries
// without an element, shown by their parent) when they mount.
for (const w of saved.widgets) {
  try {
    host.register(w);
  } catch (err) {
    failures.push(err);
  }
}
for (const w of saved.widgets) {
  if (!w.el) continue;
  const el = document.getElementById(w.el);
  try {
    host.mount(el, w);
  } catch (err) {
    el.textContent = "pycircuits_widgets: " + err;
    failures.push(err);
  }
}
document.body.dataset.pcwReady = "1";
if (failures.length) throw failures[0];
"""


def content_policy(scripts: bool) -> str:
    """The page's Content-Security-Policy ``<meta>`` (first in ``<head>``): the boot script
    (by its hash) and the bundle it imports (a ``blob:`` URL) are the only scripts that can
    run, with ``scripts``; none without. Nothing is fetched: images and fonts only from
    ``data:``/``blob:``, no connections, frames, objects or forms."""
    boot = base64.b64encode(hashlib.sha256(_BOOT_JS.encode("utf-8")).digest()).decode("ascii")
    script = f"'sha256-{boot}' blob:" if scripts else "'none'"
    policy = (f"default-src 'none'; script-src {script}; style-src 'unsafe-inline'; img-src data: blob:; "
              "font-src data:; base-uri 'none'; form-action 'none'")
    return f'<meta http-equiv="Content-Security-Policy" content="{policy}">'


def script_text(text: str) -> str:
    """Make text safe inside <script>/<style>: no `</` and no `<!--` can end or confuse it.
    The replacements are JavaScript-neutral escapes."""
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def strict_json(value) -> str:
    """JSON with every non-finite float as ``{NONFINITE: "NaN" | "Infinity" | "-Infinity"}``
    (which the page's reader turns back into numbers), safe inside <script>."""

    def tag(v):
        if isinstance(v, float) and not math.isfinite(v):
            return tag_nonfinite(v)
        if isinstance(v, dict):
            return {k: tag(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [tag(x) for x in v]
        return v

    return json.dumps(tag(value), allow_nan=False).replace("<", "\\u003c")


def is_ours(model: dict) -> bool:
    """Whether a saved model is one of this package's views."""
    return str(model.get("state", {}).get("_anywidget_id", "")).startswith(OURS)


def references(value) -> list[str]:
    """Model ids of the widgets a state refers to ("IPY_MODEL_<id>" anywhere inside it)."""
    if isinstance(value, str):
        return [value.removeprefix("IPY_MODEL_")] if value.startswith("IPY_MODEL_") else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [ref for item in value for ref in references(item)]
    return []


NOT_COMPUTED = "not computed"
"""``progress["state"]`` of a view saved while it was still computing (the page says so)."""
SAVED_BUSY = ("Not computed: this view was still computing when its state was saved (a notebook saved "
              "mid-computation); a running kernel computes it.")


def _note_with(data: dict, note: str) -> str:
    """A placeholder: the output's own HTML (our static fallback; a notebook's is made inert by
    the exporter first) or its text, then a note."""
    shown = data.get("text/html") or f"<pre>{html.escape(str(data.get('text/plain', '')))}</pre>"
    if isinstance(shown, list):  # nbformat allows multiline strings as lists
        shown = "".join(shown)
    return f'<div class="pcw-placeholder">{shown}<p>{html.escape(note)}</p></div>'


class Page:
    """The views of one page, from saved widget state (model id -> saved model).

    ``picture(model_id)``: the static HTML a reader without JavaScript sees in a view's place
    (its ``<noscript>``); default: drawn from the saved state (:func:`saved_picture`)."""

    def __init__(self, saved: dict, picture=None):
        self.saved = saved
        for model in saved.values():  # a notebook saved while a view computed: no spinner that never ends
            state = model.get("state") if isinstance(model, dict) else None
            if isinstance(state, dict) and is_ours(model) and state.get("busy") is True:
                state.update(busy=False, progress={"state": NOT_COMPUTED, "text": SAVED_BUSY})
        self.picture = picture or (lambda model_id: saved_picture(saved, model_id))
        self.entries: list[dict] = []
        self.unsaved = 0

    def view_html(self, model_id: str, fallback: dict) -> str:
        """HTML standing in for one widget view (``fallback``: the output's other data, its
        ``text/html`` inert, shown for a widget that cannot be mounted, and without
        JavaScript for one whose picture cannot be drawn)."""
        model = self.saved.get(model_id)
        if model is None:
            self.unsaved += 1
            return _note_with(fallback, "Widget not shown: its state was not saved with the notebook.")
        if is_ours(model):
            el = f"pcw-{len(self.entries)}"
            self.entries.append({**self._entry(model_id, model), "el": el})
            static = self.picture(model_id) or fallback.get("text/html", "")
            if "</noscript" in static.lower():  # escaped text never holds it; anything else is not shown
                static = ""
            return f'<div class="pcw-cell" id="{el}"></div><noscript>{static}</noscript>'
        direction = _BOX_DIRECTION.get(model.get("model_name"))
        if direction is not None:
            children = "".join(self.view_html(ref, {}) for ref in references(model.get("state", {}).get("children", [])))
            return f'<div style="display:flex;flex-direction:{direction};gap:8px">{children}</div>'
        name = f"{model.get('model_module', '?')}.{model.get('model_name', '?')}"
        return _note_with(fallback, f"{name} widget not shown: only pycircuits_widgets views run in this page "
                                    "(other widgets need their library and a kernel).")

    @staticmethod
    def _entry(model_id: str, model: dict) -> dict:
        buffers = model.get("buffers", [])  # base64 (a notebook's is checked by notebook_export)
        return {
            "model_id": model_id,
            "state": {k: v for k, v in model.get("state", {}).items() if k not in _DROPPED},
            "buffer_paths": [b["path"] for b in buffers],
            "buffers": [b["data"] for b in buffers],
            "el": None,
        }

    def add_children(self) -> None:
        """Register (without an element) our widgets that the shown views' states refer to
        (``"IPY_MODEL_<id>"``, e.g. the explorer's views), recursively, each once: the
        parent view shows them."""
        known = {e["model_id"] for e in self.entries}
        queue = [ref for e in self.entries for ref in references(e["state"])]
        while queue:
            ref = queue.pop()
            model = self.saved.get(ref)
            if ref in known or model is None or not is_ours(model):
                continue
            known.add(ref)
            entry = self._entry(ref, model)
            self.entries.append(entry)
            queue += references(entry["state"])

    def styles(self, *, theme: bool = True) -> str:
        """<style> tags: the page's layout as the views' host unless the page brings its
        own (``theme=False``), and placeholders. The views' own CSS travels packed with
        the bundle (:meth:`scripts`), which adds it as they mount."""
        sheets = ([_THEME_CSS] if theme else []) + [_PLACEHOLDER_CSS]
        return "\n".join(f"<style>{script_text(c)}</style>" for c in sheets)

    def scripts(self) -> str:
        """<script> tags that mount the views with no kernel ("" when there are none)."""
        if not self.entries:
            return ""
        return "\n".join([
            f'<script type="application/json" id="pcw-state">{strict_json({"widgets": self.entries})}</script>',
            f'<script type="text/plain" class="pcw-bundle" data-css-bytes="{packed_css_bytes()}">{bundle_packed()}</script>',
            f'<script type="module">{_BOOT_JS}</script>',
        ])


def _widget_class(model: dict):
    """This package's widget class a saved model names (``_anywidget_id``), or None: looked up
    among the classes already defined, never imported from the name. A state saved before the
    views moved to ``widgets/views/`` names ``pycircuits_widgets.widgets.<module>.<Class>``: such a
    name is matched by its class name among this package's classes."""
    from ..core.base import CircuitWidget

    name = str(model.get("state", {}).get("_anywidget_id", ""))
    stack, classes, ours = [CircuitWidget], {}, {}
    while stack:
        cls = stack.pop()
        classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
        if cls.__module__.startswith(OURS):
            ours.setdefault(cls.__qualname__, cls)
        stack += cls.__subclasses__()
    old_layout = name.startswith("pycircuits_widgets.widgets.") and name.count(".") == 3
    return classes.get(name) or (ours.get(name.rsplit(".", 1)[-1]) if old_layout else None)


class _SavedView:
    """A saved model's state read as the widget's traits (buffers restored, array and JSON-buffer
    traits read back by their own ``from_json``, ``IPY_MODEL_`` references as saved views), for :mod:`.pictures`."""

    def __init__(self, saved: dict, model_id: str, cls, depth: int = 0):
        model = saved[model_id]
        state = copy.deepcopy(model.get("state", {}))
        for b in model.get("buffers", []):
            *keys, last = b["path"]
            target = state
            for key in keys:
                target = target[key]
            target[last] = memoryview(base64.b64decode(b["data"], validate=True))
        for name, trait in cls.class_traits(sync=True).items():  # the widget's own readers of its wire values
            ours = isinstance(trait, ARRAY_TRAITS) or trait.metadata.get("to_json") is JSON_BUFFER["to_json"]
            if ours and isinstance(state.get(name), dict):
                state[name] = trait.metadata["from_json"](state[name], None)
        self._saved, self._state, self._depth = saved, state, depth

    def __getattr__(self, name):
        try:
            value = self.__dict__["_state"][name]
        except KeyError:
            raise AttributeError(name) from None
        ref = value.removeprefix("IPY_MODEL_") if isinstance(value, str) and value.startswith("IPY_MODEL_") else None
        child = self._saved.get(ref) if ref is not None else None
        if isinstance(child, dict) and self._depth < 4 and (cls := _widget_class(child)) is not None:
            return _saved_view(self._saved, ref, cls, self._depth + 1)
        return value


def _saved_view(saved: dict, model_id: str, cls, depth: int = 0) -> _SavedView:
    # named as the widget's class: the picture's frame says which view it is
    return type(cls.__name__, (_SavedView,), {})(saved, model_id, cls, depth)


def saved_picture(saved: dict, model_id: str) -> str | None:
    """The Python-drawn picture (``fallback.fallback_html``) of a saved model's state, or None
    when it is not one of our views or its state cannot be drawn (a picture reads the widget
    directly, a state may be malformed: then the caller shows the output's own HTML)."""
    from .fallback import fallback_html

    model = saved.get(model_id)
    cls = _widget_class(model) if isinstance(model, dict) else None
    if cls is None:
        return None
    try:
        return fallback_html(_saved_view(saved, model_id, cls))
    except Exception:  # noqa: BLE001 -- whatever a saved state holds, the page is still written
        return None


def widget_state(widgets) -> dict:
    """Saved widget state (model id -> model) of ``widgets`` and every widget they
    reference, through ipywidgets' public embedding API."""
    return dependency_state(list(widgets), drop_defaults=False)


def _live_widgets(widgets) -> dict:
    """model id -> widget, for ``widgets`` and every widget their synced traits hold."""
    found = {}

    def visit(value):
        if isinstance(value, ipywidgets.Widget):
            if value.model_id not in found:
                found[value.model_id] = value
                for name in value.trait_names(sync=True):
                    visit(getattr(value, name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    visit(list(widgets))
    return found


def render_html(widgets, *, title: str = "pycircuits_widgets", offline: bool = True,
                budget: float | None = None, wait: bool = True, max_bytes: int | None = None,
                heads=()) -> str:
    """One HTML page showing the given widgets (ours live; boxes laid out; others as a
    placeholder), the bundle inlined once. Each view's state carries the answers a reader's
    clicks need (its ``_offline`` trait, :mod:`.offline`), made current here unless
    ``offline=False`` (a page wired to a kernel, which answers instead).

    Views still computing are waited for up to ``budget`` seconds in all (None: no limit), on a
    bar naming each; one not done by then is saved as it stands with ``progress`` ``{"state":
    NOT_COMPUTED, "text"}``, which the page shows, and ``busy`` off (no spinner that never ends).
    ``wait=False``: the page is wired to a live kernel (a test harness standing in for one), which
    sends the views' results as they come: nothing is waited for and nothing marked.

    ``max_bytes`` (with ``offline`` and ``wait``): the page is planned (:func:`page_plan`): what each view's
    work costs at its model's size is estimated first, the most valuable that fits ``budget`` and
    ``max_bytes`` is computed (the exact tables of ``heads``, ``[(layer, head)]``, before other heads'),
    and the page states its size, its budgets and what was left out with its cost."""
    widgets = list(widgets)
    if not widgets:
        raise ValueError("render_html needs at least one widget")
    for w in widgets:
        if not isinstance(w, ipywidgets.Widget):
            raise TypeError(f"expected widgets, got {type(w).__name__}")
    live = _live_widgets(widgets)
    if max_bytes is not None:
        check_max_bytes(max_bytes)
    start = time.monotonic()
    plan = page_plan(widgets, budget, max_bytes, heads) if max_bytes is not None and offline and wait else None
    if plan is not None:
        with progress("save_html: computing what fits the page (estimated)", total=plan.total_s, unit="s") as bar:
            plan.run(bar)
    left = None if budget is None else max(0.0, budget - (time.monotonic() - start))
    states = _page_states(live, offline, left) if wait else {}
    saved = widget_state(widgets)
    limit = "" if budget is None else f" (budget {budget:g} s)"
    for model_id, state in states.items():
        if state.unfinished:
            text = (f"Not computed: {type(live[model_id]).__name__} was still computing {state.unfinished} when this "
                    f"page was saved{limit}; a running kernel computes it.")
            saved[model_id]["state"].update(busy=False, progress={"state": NOT_COMPUTED, "text": text})
    page = Page(saved, picture=lambda model_id: states[model_id].picture() if model_id in states else
                live[model_id]._fallback_html())
    cells = "\n".join(page.view_html(w.model_id, {"text/plain": repr(w)}) for w in widgets)
    page.add_children()
    if plan is None:
        return _page_html(title, page, cells)
    # the page's own size in its statement: measured with the statement in place (its digits do not change it)
    text = _page_html(title, page, _plan_html(plan, 0) + cells)
    text = _page_html(title, page, _plan_html(plan, len(text.encode("utf-8"))) + cells)
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise RuntimeError(f"save_html: the page came to {size:,} bytes, over max_bytes={max_bytes:,}: the plan's byte "
                           "estimates were too low (a bug: please report it); nothing was written")
    return text


def _page_html(title: str, page: Page, cells: str) -> str:
    return f"""<!DOCTYPE html>
<html lang="en" class="pcw-page">
<head>
<meta charset="utf-8">
{content_policy(bool(page.entries))}
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(escape_invisible(title))}</title>
{page.styles()}
</head>
<body>
{cells}
{page.scripts()}
</body>
</html>
"""


_PLAN_CSS = """
.pcw-plan { font: 13px system-ui, sans-serif; margin: 0 0 16px; }
.pcw-plan p, .pcw-plan ul { margin: 2px 0; }
"""


def _plan_html(plan: SavePlan, page_bytes: int) -> str:
    """The page's statement of its budgets and of what it left out, each with its cost (plain HTML: shown
    with or without JavaScript)."""
    left = "".join(f"<li>{html.escape(line)}</li>" for line in plan.left_out())
    out = f"<p>Left out (not computed within the budgets; a running kernel computes them):</p><ul>{left}</ul>" if left else ""
    return (f'<section class="pcw-plan"><style>{script_text(_PLAN_CSS)}</style>'
            f"<p>{html.escape(plan.statement(page_bytes))}</p>{out}</section>")


def page_plan(widgets, budget: float | None, max_bytes: int, heads=()) -> SavePlan:
    """The plan of a page of ``widgets`` (``core.save_plan``): each of our views' ``page_items`` (an explorer's:
    each section's, ``CircuitWidget.page_views``) at a rate measured now on the first view's model, the heads
    ``heads`` (checked against each model) and then the ones each view visited chosen first; the page's base
    bytes: the bundle, the views' state as it stands, and the kernel-less answers of views without items."""
    check_max_bytes(max_bytes)
    items, rate, planned = [], None, set()
    for w in widgets:
        if not isinstance(w, CircuitWidget) or getattr(w, "model", None) is None:
            continue
        chosen = check_heads(heads, w.model.cfg) + tuple(w.visited_heads())
        rate = rate or Rate.measure(w.model)
        for section, view in w.page_views().items():
            found = view.page_items(PlanContext(section, rate, tuple(dict.fromkeys(chosen))))
            items += found
            planned |= {view.model_id} if found else set()
    base = (len(bundle_packed()) + len(strict_json(widget_state(widgets)))
            + sum(w.answers_reserve() for model_id, w in _live_widgets(widgets).items()
                  if isinstance(w, CircuitWidget) and model_id not in planned))
    return SavePlan(items, budget_s=budget, max_bytes=max_bytes, base_bytes=base)


def _page_states(live: dict, offline: bool, budget: float | None) -> dict:
    """Each of our live views' ``for_page`` state, their work waited for within ``budget`` seconds in all,
    on a bar naming each; model id -> ``PageState``."""
    ours = {model_id: w for model_id, w in live.items() if isinstance(w, CircuitWidget)}
    deadline = None if budget is None else time.monotonic() + budget
    states = {}
    limit = "" if budget is None else f" ({budget:.0f} s left of the budget)"
    with progress(f"save_html: waiting for the views{limit}", total=len(ours), unit="view") as bar:
        for model_id, w in ours.items():
            name = type(w).__name__
            bar.note(name)
            states[model_id] = w.for_page(deadline, offline, lambda what, name=name: bar.note(f"{name}: {what}"))
            bar.update()
    return states


def _new_file_mode(path: pathlib.Path) -> int:
    """The mode a plain ``open(path, "w")`` would give (mkstemp's is 0600): the existing
    file's, else 0666 less the umask."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_atomic(path, text: str) -> pathlib.Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and
    a rename: readers never see a partial file, and on any failure an existing file is
    left as it was. Errors name the file."""
    path = pathlib.Path(path)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end]
        raise ValueError(f"cannot write {path}: the page text holds {bad!r} at offset {exc.start}, "
                         f"which is not valid Unicode (a lone surrogate?); nothing was written") from None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _new_file_mode(path))
        os.replace(tmp, path)
    except BaseException as exc:
        os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}; an existing file was left as it was") from exc
        raise
    return path


def refuse_notebook_target(out) -> pathlib.Path:
    """``out`` as a path, unless it names a notebook (``.ipynb``, any case): an HTML page
    written there would replace the notebook (``ValueError``, nothing written)."""
    out = pathlib.Path(out)
    if out.suffix.lower() == ".ipynb":
        raise ValueError(f"refusing to write the HTML page to {out}: it would replace a notebook; "
                         "choose a name ending in .html")
    return out


def save_html(widgets, path, *, title: str = "pycircuits_widgets", offline: bool = True,
              budget: float | None = None, max_bytes: int | None = None, heads=()) -> pathlib.Path:
    """Write :func:`render_html` to ``path`` atomically (never to a ``.ipynb``); returns the path."""
    return write_atomic(refuse_notebook_target(path), render_html(widgets, title=title, offline=offline, budget=budget,
                                                                  max_bytes=max_bytes, heads=heads))
