"""Self-contained HTML pages for widgets: no kernel, no CDN, no network.

The page inlines the widget bundle once (however many widgets it shows) and each
widget's saved state, binary buffers included (base64). A small kernel-less host in the
bundle (``js/src/lib/host.js``) gives every view a model object with anywidget's
front-end API, so all interactions that need no kernel keep working.
"""

from __future__ import annotations

import base64
import html
import json
import pathlib

from ipywidgets.widgets.widget import _remove_buffers

from .base import CircuitWidget

# Host theme for pages outside JupyterLab: the views read JupyterLab's CSS variables.
_THEME_CSS = """
:root { --jp-layout-color0: #fff; --jp-layout-color1: #fff; --jp-layout-color2: #eee;
  --jp-ui-font-color1: rgba(0,0,0,.87); --jp-ui-font-color2: rgba(0,0,0,.54);
  --jp-ui-font-color3: rgba(0,0,0,.38); --jp-border-color1: #bdbdbd; --jp-border-color2: #e0e0e0;
  --jp-brand-color1: #1976d2; --jp-warn-color0: #e65100; --jp-error-color1: #d32f2f;
  --jp-error-color3: #fdecea; --jp-ui-font-family: system-ui, sans-serif;
  --jp-code-font-family: ui-monospace, Menlo, Consolas, monospace; }
@media (prefers-color-scheme: dark) {
  :root { --jp-layout-color0: #111; --jp-layout-color1: #111; --jp-layout-color2: #2a2a2a;
    --jp-ui-font-color1: rgba(255,255,255,.87); --jp-ui-font-color2: rgba(255,255,255,.6);
    --jp-ui-font-color3: rgba(255,255,255,.4); --jp-border-color1: #616161; --jp-border-color2: #424242;
    --jp-brand-color1: #64b5f6; --jp-warn-color0: #ffb74d; --jp-error-color1: #ef5350;
    --jp-error-color3: #3b1f1f; }
}
body { background: var(--jp-layout-color0); color: var(--jp-ui-font-color1);
  font-family: var(--jp-ui-font-family); margin: 16px; }
.pcw-cell { margin-bottom: 24px; }
"""

# Loads each inlined bundle the way anywidget does (an ES module from a Blob URL) and
# mounts every saved widget with the kernel-less host of its bundle. `window.pcwBridge`,
# when a test harness defines it, forwards changes to a live Python widget; a shared page
# has none and runs without a kernel. A widget that fails to mount shows why; the others
# still mount.
_BOOT_JS = """
const bridge = window.pcwBridge;
const hosts = [];
for (const el of document.querySelectorAll("script.pcw-bundle")) {
  const url = URL.createObjectURL(new Blob([el.textContent], { type: "text/javascript" }));
  const mod = await import(url);
  hosts.push(mod.createHost(mod.default, bridge ? bridge.hooks : {}));
}
const saved = JSON.parse(document.getElementById("pcw-state").textContent);
const models = new Map();
window.pcwHost = { models };
const failures = [];
// Register every saved model first: composite views resolve their children (entries
// without an element, shown by their parent) when they mount.
for (const w of saved.widgets) {
  try {
    models.set(w.model_id, hosts[w.bundle ?? 0].register(w));
  } catch (err) {
    failures.push(err);
  }
}
for (const w of saved.widgets) {
  if (!w.el) continue;
  const el = document.getElementById(w.el);
  try {
    hosts[w.bundle ?? 0].mount(el, w);
  } catch (err) {
    el.textContent = "pycircuits_widgets: " + err;
    failures.push(err);
  }
}
document.body.dataset.pcwReady = "1";
if (failures.length) throw failures[0];
"""


def _script_text(text: str) -> str:
    """Make text safe inside <script>: no `</script` and no `<!--` can end or confuse it.
    The replacements are JavaScript-neutral escapes."""
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def widget_state(widget: CircuitWidget) -> dict:
    """The widget's full synced state as JSON-able data: binary buffers in base64."""
    full = widget.get_state()
    # The bundle is inlined once per page, not once per widget; layout is a separate
    # ipywidgets model that a kernel-less page does not have.
    state = {k: v for k, v in full.items() if k not in ("_esm", "_css", "layout")}
    state, paths, buffers = _remove_buffers(state)
    return {
        "model_id": widget.model_id,
        "state": state,
        "buffer_paths": paths,
        "buffers": [base64.b64encode(bytes(b)).decode("ascii") for b in buffers],
    }


def child_widgets(widgets) -> list[CircuitWidget]:
    """Widgets held in the synced traits of ``widgets`` (children of composite views such as
    the explorer, synced as ``"IPY_MODEL_<id>"``), recursively, each once, not ``widgets``
    themselves. A page registers their states so the parent can show them."""
    seen = {w.model_id for w in widgets}
    found: list[CircuitWidget] = []

    def visit(value):
        if isinstance(value, CircuitWidget):
            if value.model_id not in seen:
                seen.add(value.model_id)
                found.append(value)
                visit_traits(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    def visit_traits(widget):
        for name in widget.trait_names(sync=True):
            visit(getattr(widget, name))

    for w in widgets:
        visit_traits(w)
    return found


def bundle_code() -> tuple[str, str]:
    """(javascript, css) of the built front end."""
    return str(CircuitWidget._esm), str(CircuitWidget._css)


def page_styles(css: list[str], *, theme: bool = True) -> str:
    """<style> tags for a page of widgets: each distinct widget CSS, after the host theme
    (JupyterLab's CSS variables) unless the page brings its own (``theme=False``)."""
    sheets = [_THEME_CSS] if theme else []
    return "\n".join(f"<style>{_script_text(c)}</style>" for c in [*sheets, *dict.fromkeys(css)])


def page_scripts(bundles: list[str], entries: list[dict]) -> str:
    """<script> tags that mount saved widgets into their elements, with no kernel.

    ``bundles``: distinct bundle sources, each inlined once. ``entries``: one per view, as
    :func:`widget_state` returns, plus ``el`` (the id of its element in the page, or None
    for a child widget that its parent view shows) and ``bundle`` (its index in
    ``bundles``, default 0)."""
    state_json = json.dumps({"widgets": entries}).replace("<", "\\u003c")
    tags = [f'<script type="application/json" id="pcw-state">{state_json}</script>']
    tags += [f'<script type="text/plain" class="pcw-bundle">{_script_text(js)}</script>' for js in bundles]
    tags.append(f'<script type="module">{_BOOT_JS}</script>')
    return "\n".join(tags)


def render_html(widgets, *, title: str = "pycircuits_widgets") -> str:
    """One HTML page showing the given widgets, the bundle inlined once."""
    widgets = list(widgets)
    if not widgets:
        raise ValueError("render_html needs at least one widget")
    for w in widgets:
        if not isinstance(w, CircuitWidget):
            raise TypeError(f"expected pycircuits_widgets widgets, got {type(w).__name__}")
    js, css = bundle_code()
    entries = [{**widget_state(w), "el": f"pcw-{i}"} for i, w in enumerate(widgets)]
    cells = "\n".join(f'<div class="pcw-cell" id="{e["el"]}"></div>' for e in entries)
    entries += [{**widget_state(c), "el": None} for c in child_widgets(widgets)]
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
{page_styles([css])}
</head>
<body>
{cells}
{page_scripts([js], entries)}
</body>
</html>
"""


def save_html(widgets, path, *, title: str = "pycircuits_widgets") -> pathlib.Path:
    """Write :func:`render_html` to ``path``; returns the path."""
    path = pathlib.Path(path)
    path.write_text(render_html(widgets, title=title), encoding="utf-8")
    return path
