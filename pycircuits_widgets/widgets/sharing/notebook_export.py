"""Export a notebook saved with widget state to one self-contained HTML file.

The stock ``jupyter nbconvert --to html`` page loads require.js, the widget manager and
anywidget from CDNs, so its widgets show nothing offline. Here nbconvert (``lab``
template) renders the cells, with its script tags removed, and every pycircuits_widgets
view is mounted from the notebook's saved widget state by the kernel-less host of
:mod:`.standalone`: no kernel, no network, the no-kernel interactions (hover, click,
keyboard) working. The page inlines this package's own bundle once, whatever ``_esm``
the saved state holds. Child widgets of composite views (the explorer's views,
referenced as ``"IPY_MODEL_<id>"``) are registered for their parent to show.

Other widgets (sliders, third-party anywidgets) show as a placeholder with their
``text/plain``; boxes (``VBox``/``HBox``) are laid out and their children shown the same way.

Trust boundary: a shared notebook is untrusted input (JupyterLab runs none of an untrusted
notebook's script, and neither does its page). Outputs keep only the types that cannot run
code (text, images, LaTeX source, and HTML and Markdown made inert by :func:`inert_html`);
``application/javascript`` and every other type are dropped; Markdown and raw cells are
rendered, then made inert. The page's Content-Security-Policy (``standalone.content_policy``)
lets the browser run no script but this package's bundle even if something got through.
"""

from __future__ import annotations

import json
import pathlib
import warnings

from ...progress import progress
from .standalone import Page, content_policy, refuse_notebook_target, write_atomic

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

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


# Output types that cannot run code in the page (HTML and Markdown once made inert): every other
# type is dropped, as application/javascript, which nbconvert would paste into a <script>.
_KEPT_OUTPUTS = {"text/plain", "text/html", "text/markdown", "text/latex", "image/png", "image/jpeg", "image/gif",
                 "image/svg+xml"}
_MARKUP_OUTPUTS = {"text/html"}  # text/markdown is made inert after it is rendered (_InertExporter)
# Inline styles a notebook's HTML keeps: how text and tables look, nothing that places an element
# over the page (position, z-index, ...).
_STYLES = {"background", "background-color", "border", "border-collapse", "border-color", "border-style",
           "border-width", "color", "display", "font", "font-family", "font-size", "font-style", "font-weight",
           "height", "image-rendering", "line-height", "margin", "margin-bottom", "margin-left", "margin-right",
           "margin-top", "max-width", "padding", "text-align", "text-decoration", "vertical-align", "white-space",
           "width", "gap", "flex-direction", "flex-wrap"}


def inert_html(text) -> str:
    """A notebook's HTML made inert by ``nh3`` (the Ammonia sanitiser): no script, event handler,
    ``javascript:`` URL, frame, form or style sheet; the formatting tags, tables, images
    (``data:`` URLs included), ``title``/``data-*`` attributes and the inline styles in
    ``_STYLES`` are kept."""
    import nh3

    if isinstance(text, list):  # nbformat allows multiline strings as lists
        text = "".join(text)
    attributes = {tag: set(names) for tag, names in nh3.ALLOWED_ATTRIBUTES.items()}
    attributes["*"] = attributes.get("*", set()) | {"style", "title"}
    return nh3.clean(str(text), attributes=attributes, generic_attribute_prefixes={"data-"},
                     url_schemes=nh3.ALLOWED_URL_SCHEMES | {"data"}, filter_style_properties=_STYLES)


def _make_inert(nb) -> None:
    """Every output of ``nb`` (widget outputs excepted: the page shows those), and every raw
    cell, reduced to what cannot run code (see the module doc)."""
    for cell in nb.cells:
        if cell.cell_type == "raw":
            cell.source = inert_html(cell.source)
        for output in cell.get("outputs", []):
            data = output.get("data")
            if not isinstance(data, dict) or WIDGET_VIEW in data:
                continue
            output["data"] = {mime: inert_html(value) if mime in _MARKUP_OUTPUTS else value
                              for mime, value in data.items() if mime in _KEPT_OUTPUTS}
            # nbconvert writes an image's width/height metadata into its tag: numbers only
            output["metadata"] = {mime: {k: v for k, v in meta.items()
                                         if k in ("width", "height") and isinstance(v, (int, float))
                                         and not isinstance(v, bool)}
                                  for mime, meta in output.get("metadata", {}).items() if isinstance(meta, dict)}


class ExportError(ValueError):
    """The notebook cannot be exported as asked; the message says why and what to do."""


_HOW_TO_SAVE_STATE = (
    "Save the widget state with the notebook, then export again. In JupyterLab: check "
    "Settings > Save Widget State Automatically, run the cells and save the notebook. "
    "With nbconvert: jupyter nbconvert --to notebook --execute --inplace "
    "--ExecutePreprocessor.store_widget_state=True NOTEBOOK.ipynb"
)


MAX_DEPTH = 200
"""Deepest nesting of objects and lists a notebook may have (a saved widget state is under 10
levels; deeper input would exhaust Python's recursion limit while it is read or copied)."""


def _check_depth(value, where) -> None:
    """ExportError if ``value`` nests deeper than MAX_DEPTH (measured without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ExportError(f"{where} nests objects or lists more than {MAX_DEPTH} levels deep; "
                              "it is not a notebook this package saved")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _load(notebook):
    import nbformat

    if isinstance(notebook, (str, pathlib.Path)):
        where = notebook
        try:
            raw = json.loads(pathlib.Path(notebook).read_text(encoding="utf-8"))
        except RecursionError:  # json's decoder recurses per level
            raise ExportError(f"{where} nests objects or lists more than {MAX_DEPTH} levels deep; "
                              "it is not a notebook this package saved") from None
        except ValueError as exc:
            raise ExportError(f"{where} is not a Jupyter notebook (.ipynb, nbformat 4): {exc}") from None
        name = pathlib.Path(notebook).stem
    else:
        where, raw, name = "the notebook", notebook, "notebook"
    if not isinstance(raw, dict):
        raise ExportError(f"{where} is not a Jupyter notebook: its JSON is a {type(raw).__name__}, expected an object")
    _check_depth(raw, where)
    try:
        nb = nbformat.reads(json.dumps(raw), as_version=4)
    except (ValueError, TypeError, AttributeError, KeyError, nbformat.ValidationError) as exc:
        raise ExportError(f"{where} is not a Jupyter notebook (.ipynb, nbformat 4): "
                          f"{type(exc).__name__}: {exc}") from None
    return nb, name, where


def _expect(ok: bool, what: str, value, expected: str) -> None:
    if not ok:
        kind = "missing" if value is None else "an object" if isinstance(value, dict) else f"a {type(value).__name__}"
        raise ExportError(f"{what} is {kind}, expected {expected}; the notebook's saved widget state is malformed")


def _saved_state(nb, where) -> dict:
    """The notebook's saved widget state (model id -> model), its shape checked: each model an
    object whose ``state`` is an object and whose ``buffers`` are ``{"path": [keys], "data":
    base64 str}``. Removed from the metadata (the page carries it its own way)."""
    widgets = nb.metadata.pop("widgets", {})
    _expect(isinstance(widgets, dict), f"{where}: metadata.widgets", widgets, f"an object ({WIDGET_STATE!r} -> state)")
    doc = widgets.get(WIDGET_STATE, {})
    _expect(isinstance(doc, dict), f"{where}: metadata.widgets[{WIDGET_STATE!r}]", doc, 'an object with "state"')
    saved = doc.get("state", {})
    _expect(isinstance(saved, dict), f"{where}: the saved widget state", saved, "an object (model id -> model)")
    for model_id, model in saved.items():
        what = f"{where}: saved widget {model_id!r}"
        _expect(isinstance(model, dict), what, model, "an object with model_name, model_module, state")
        _expect(isinstance(model.get("state", {}), dict), f"{what}: state", model.get("state"), "an object")
        buffers = model.get("buffers", [])
        _expect(isinstance(buffers, list), f"{what}: buffers", buffers, "a list")
        for i, b in enumerate(buffers):
            _expect(isinstance(b, dict), f"{what}: buffer {i}", b, 'an object with "path" and "data"')
            path, data = b.get("path"), b.get("data")
            _expect(isinstance(path, list) and path and all(isinstance(k, (str, int)) and not isinstance(k, bool)
                                                           for k in path),
                    f"{what}: buffer {i}'s path", path, "a non-empty list of keys")
            _expect(isinstance(data, str), f"{what}: buffer {i}'s data", data, "a base64 str")
            if b.get("encoding", "base64") != "base64":
                raise ExportError(f"{what}: buffer {i} at {path} has encoding {b['encoding']!r}, expected 'base64'")
    return saved


def _widget_outputs(nb, where) -> list:
    """Every output showing a widget (its ``model_id`` checked to be a str)."""
    found = []
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW) if isinstance(output.get("data"), dict) else None
            if view is None:
                continue
            _expect(isinstance(view, dict) and isinstance(view.get("model_id"), str),
                    f"{where}: cell {i}'s widget output", view, 'an object with a "model_id" str')
            found.append(output)
    return found


def render_notebook_html(notebook, *, title: str | None = None) -> str:
    """One self-contained HTML page of a notebook (path, or nbformat node/dict): cells'
    code and outputs, every pycircuits_widgets view live from the saved widget state.

    Raises :class:`ExportError` when the notebook shows widgets but saved no widget
    state (the page would show none of them); warns when only some outputs lack it."""
    try:
        import nh3  # noqa: F401 (inert_html's; checked here, before any work)
        from jinja2 import DictLoader, pass_context
        from nbconvert import HTMLExporter
    except ImportError as exc:
        raise ImportError(
            "notebook export renders cells with nbconvert and makes them inert with nh3: "
            "`pip install nbconvert nh3` (or `pip install pycircuits_widgets[share]`)"
        ) from exc
    nb, name, where = _load(notebook)
    saved = _saved_state(nb, where)
    outputs = _widget_outputs(nb, where)
    if outputs and not saved:
        raise ExportError(f"{where} shows {len(outputs)} widget(s) but was saved without widget state, "
                          f"so a page would show none of them. {_HOW_TO_SAVE_STATE}")
    _make_inert(nb)
    page = Page(saved)
    for output in outputs:
        data = {**output["data"], "text/html": inert_html(output["data"].get("text/html", ""))}
        output["data"] = {"text/html": page.view_html(data[WIDGET_VIEW]["model_id"], data)}
        output["metadata"] = {"pcw_export": True}
    page.add_children()  # each view's saved state carries its kernel-less answers (_offline)
    if page.unsaved:
        warnings.warn(f"{where}: {page.unsaved} widget output(s) have no saved widget state (widgets closed or "
                      f"re-created after they were shown) and show a placeholder. {_HOW_TO_SAVE_STATE}", stacklevel=2)
    class InertExporter(HTMLExporter):
        """Markdown (cells and outputs) rendered as nbconvert renders it, then made inert."""

        @pass_context
        def markdown2html(self, context, source):
            return inert_html(super().markdown2html(context, source))

    exporter = InertExporter(
        template_name="lab",
        extra_loaders=[DictLoader({"pcw_notebook.html.j2": _TEMPLATE})],
        template_file="pcw_notebook.html.j2",
    )
    if title:
        nb.metadata["title"] = title
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": name}})
    head, _, rest = body.partition("</head>")
    main, _, tail = rest.rpartition("</body>")
    before, tag, head = head.partition("<head>")
    policy = content_policy(bool(page.entries))
    return f"{before}{tag}\n{policy}{head}{page.styles(theme=False)}\n</head>{main}{page.scripts()}\n</body>{tail}"


def export_notebook(notebook, out=None, *, title: str | None = None) -> pathlib.Path:
    """Write :func:`render_notebook_html` of the notebook at path ``notebook`` to ``out``
    (default: the notebook's path with ``.html``) atomically; returns the written path.

    Refuses (:class:`ExportError`, nothing written) to write over the notebook itself or
    over any ``.ipynb`` file."""
    notebook = pathlib.Path(notebook)
    if not notebook.is_file():
        raise FileNotFoundError(f"notebook {notebook} does not exist (expected a saved .ipynb file)")
    out = pathlib.Path(out) if out is not None else notebook.with_suffix(".html")
    try:
        refuse_notebook_target(out)
    except ValueError as exc:
        raise ExportError(f"{exc} (-o PAGE.html)") from None
    if out.resolve() == notebook.resolve() or (out.exists() and out.samefile(notebook)):
        raise ExportError(f"refusing to write the HTML page to {out}: it is the notebook being exported; "
                          "choose another output name (-o PAGE.html)")
    with progress(f"export {notebook.name}", total=2, unit="step") as bar:  # shown past a second
        bar.note("rendering the cells")
        page = render_notebook_html(notebook, title=title)
        bar.update()
        bar.note(f"writing {out.name}")
        written = write_atomic(out, page)
        bar.update()
    return written
