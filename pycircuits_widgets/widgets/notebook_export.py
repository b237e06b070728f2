"""Export a notebook saved with widget state to one self-contained HTML file.

The stock ``jupyter nbconvert --to html`` page loads require.js, the widget manager and
anywidget from CDNs, so its widgets show nothing offline. Here nbconvert (``lab``
template) renders the cells, with its script tags removed, and every pycircuits_widgets
view is mounted from the notebook's saved widget state by the kernel-less host of
:mod:`.standalone`: no kernel, no network, the no-kernel interactions (hover, click,
keyboard) working. anywidget saves the bundle (``_esm``) once per widget instance; the
page inlines each distinct bundle once. Child widgets of composite views (the explorer's
views, referenced as ``"IPY_MODEL_<id>"``) are registered for their parent to show.

Other widgets (sliders, third-party anywidgets) show their ``text/plain`` and a note.
Boxes (``VBox``/``HBox``) are laid out and their children shown the same way.
"""

from __future__ import annotations

import copy
import html
import pathlib
import warnings

from .standalone import bundle_code, page_scripts, page_styles

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
_OURS = "pycircuits_widgets."
_BOX_DIRECTION = {"BoxModel": "column", "VBoxModel": "column", "GridBoxModel": "column", "HBoxModel": "row"}

# The lab template without any <script src>: no require.js, MathJax, mermaid or widget
# manager. Widget outputs are replaced before rendering by HTML marked `pcw_export`,
# emitted as a widget output area (outside jp-RenderedHTMLCommon, whose table styles
# would leak into the views).
_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block data_html scoped -%}
{%- if output.metadata.get('pcw_export') -%}
<div class="jupyter-widgets jp-OutputArea-output">{{ output.data['text/html'] }}</div>
{%- else -%}
{{ super() }}
{%- endif -%}
{%- endblock data_html -%}
"""

_NOTE_STYLE = "font-size:12px;color:var(--jp-ui-font-color2,#666);margin:2px 0"


class _Page:
    """Collects the views of one notebook: elements, saved states, distinct bundles."""

    def __init__(self, saved: dict):
        self.saved = saved
        self.entries: list[dict] = []
        self.bundles: dict[str, int] = {}
        self.css: list[str] = []
        self.unsaved = 0

    def view_html(self, model_id: str, fallback: dict) -> str:
        """HTML standing in for one widget view (``fallback``: the output's other data)."""
        model = self.saved.get(model_id)
        if model is None:
            self.unsaved += 1
            return _note_with(fallback, "widget not shown: its state was not saved with the notebook")
        state = model.get("state", {})
        if _is_ours(model):
            return self._mount(model_id, model)
        direction = _BOX_DIRECTION.get(model.get("model_name"))
        if direction is not None:
            children = "".join(self.view_html(ref.removeprefix("IPY_MODEL_"), {}) for ref in state.get("children", []))
            return f'<div style="display:flex;flex-direction:{direction};gap:8px">{children}</div>'
        name = html.escape(f"{model.get('model_module', '?')}.{model.get('model_name', '?')}")
        return _note_with(fallback, f"{name} widget not shown: only pycircuits_widgets views render without a kernel")

    def _mount(self, model_id: str, model: dict) -> str:
        el = f"pcw-{len(self.entries)}"
        self.entries.append({**self._entry(model_id, model), "el": el})
        return f'<div class="pcw-cell" id="{el}"></div>'

    def _entry(self, model_id: str, model: dict) -> dict:
        state = dict(model["state"])
        default_js, default_css = bundle_code()
        js = state.pop("_esm", None) or default_js
        self.css.append(state.pop("_css", None) or default_css)
        state.pop("layout", None)  # a separate ipywidgets model that the host does not have
        buffers = model.get("buffers", [])
        return {
            "model_id": model_id,
            "state": state,
            "buffer_paths": [b["path"] for b in buffers],
            "buffers": [_base64(b) for b in buffers],
            "el": None,
            "bundle": self.bundles.setdefault(js, len(self.bundles)),
        }

    def add_children(self) -> None:
        """Register (without an element) our widgets that the shown views' states refer to
        (``"IPY_MODEL_<id>"``, e.g. the explorer's views), recursively, each once: the
        parent view shows them."""
        known = {e["model_id"] for e in self.entries}
        queue = [ref for e in self.entries for ref in _references(e["state"])]
        while queue:
            ref = queue.pop()
            model = self.saved.get(ref)
            if ref in known or model is None or not _is_ours(model):
                continue
            known.add(ref)
            entry = self._entry(ref, model)
            self.entries.append(entry)
            queue += _references(entry["state"])


def _is_ours(model: dict) -> bool:
    return str(model.get("state", {}).get("_anywidget_id", "")).startswith(_OURS)


def _references(value) -> list[str]:
    """Model ids of the widgets a state refers to ("IPY_MODEL_<id>" anywhere inside it)."""
    if isinstance(value, str):
        return [value.removeprefix("IPY_MODEL_")] if value.startswith("IPY_MODEL_") else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [ref for item in value for ref in _references(item)]
    return []


def _base64(buffer: dict) -> str:
    if buffer.get("encoding", "base64") != "base64":
        raise ValueError(f"saved widget buffer at {buffer.get('path')} has encoding {buffer['encoding']!r}, expected 'base64'")
    return buffer["data"]


def _note_with(data: dict, note: str) -> str:
    """The output's own HTML (our static fallback) or its text, then a note."""
    shown = data.get("text/html") or f"<pre>{html.escape(str(data.get('text/plain', '')))}</pre>"
    if isinstance(shown, list):  # nbformat allows multiline strings as lists
        shown = "".join(shown)
    return f'{shown}<p style="{_NOTE_STYLE}">{note}</p>'


def _load(notebook):
    import nbformat

    if isinstance(notebook, (str, pathlib.Path)):
        try:
            return nbformat.read(str(notebook), as_version=4), pathlib.Path(notebook).stem
        except (ValueError, nbformat.ValidationError) as exc:
            raise ValueError(f"{notebook} is not a Jupyter notebook (.ipynb, nbformat 4): {exc}") from exc
    return nbformat.from_dict(copy.deepcopy(dict(notebook))), "notebook"


def render_notebook_html(notebook, *, title: str | None = None) -> str:
    """One self-contained HTML page of a notebook (path, or nbformat node/dict): cells'
    code and outputs, every pycircuits_widgets view live from the saved widget state."""
    try:
        from jinja2 import DictLoader
        from nbconvert import HTMLExporter
    except ImportError as exc:
        raise ImportError(
            "notebook export renders cells with nbconvert: `pip install nbconvert` "
            "(or `pip install pycircuits_widgets[share]`)"
        ) from exc
    nb, name = _load(notebook)
    widgets = nb.metadata.pop("widgets", {})
    page = _Page(widgets.get(WIDGET_STATE, {}).get("state", {}))
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                view = page.view_html(data[WIDGET_VIEW]["model_id"], data)
                output["data"] = {"text/html": view}
                output["metadata"] = {"pcw_export": True}
    page.add_children()
    if page.unsaved:
        warnings.warn(
            f"{page.unsaved} widget output(s) have no saved widget state and show a static preview: "
            "save the notebook with widget state (JupyterLab: Settings > Save Widget State Automatically; "
            "nbclient: store_widget_state=True)",
            stacklevel=2,
        )
    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[DictLoader({"pcw_notebook.html.j2": _TEMPLATE})],
        template_file="pcw_notebook.html.j2",
    )
    if title:
        nb.metadata["title"] = title
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": name}})
    if not page.entries:
        return body
    head, _, rest = body.partition("</head>")
    main, _, tail = rest.rpartition("</body>")
    return (
        f"{head}{page_styles(page.css, theme=False)}\n</head>{main}"
        f"{page_scripts(list(page.bundles), page.entries)}\n</body>{tail}"
    )


def export_notebook(notebook, out=None, *, title: str | None = None) -> pathlib.Path:
    """Write :func:`render_notebook_html` of the notebook at path ``notebook`` to ``out``
    (default: the notebook's path with ``.html``); returns the written path."""
    notebook = pathlib.Path(notebook)
    if not notebook.is_file():
        raise FileNotFoundError(f"notebook {notebook} does not exist (expected a saved .ipynb file)")
    out = pathlib.Path(out) if out is not None else notebook.with_suffix(".html")
    out.write_text(render_notebook_html(notebook, title=title), encoding="utf-8")
    return out
