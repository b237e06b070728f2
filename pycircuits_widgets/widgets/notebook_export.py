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
"""

from __future__ import annotations

import copy
import pathlib
import warnings

from .standalone import Page, refuse_notebook_target, write_atomic

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


class ExportError(ValueError):
    """The notebook cannot be exported as asked; the message says why and what to do."""


_HOW_TO_SAVE_STATE = (
    "Save the widget state with the notebook, then export again. In JupyterLab: check "
    "Settings > Save Widget State Automatically, run the cells and save the notebook. "
    "With nbconvert: jupyter nbconvert --to notebook --execute --inplace "
    "--ExecutePreprocessor.store_widget_state=True NOTEBOOK.ipynb"
)


def _load(notebook):
    import nbformat

    if isinstance(notebook, (str, pathlib.Path)):
        try:
            return nbformat.read(str(notebook), as_version=4), pathlib.Path(notebook).stem
        except (ValueError, nbformat.ValidationError) as exc:
            raise ExportError(f"{notebook} is not a Jupyter notebook (.ipynb, nbformat 4): {exc}") from exc
    return nbformat.from_dict(copy.deepcopy(dict(notebook))), "notebook"


def render_notebook_html(notebook, *, title: str | None = None) -> str:
    """One self-contained HTML page of a notebook (path, or nbformat node/dict): cells'
    code and outputs, every pycircuits_widgets view live from the saved widget state.

    Raises :class:`ExportError` when the notebook shows widgets but saved no widget
    state (the page would show none of them); warns when only some outputs lack it."""
    try:
        from jinja2 import DictLoader
        from nbconvert import HTMLExporter
    except ImportError as exc:
        raise ImportError(
            "notebook export renders cells with nbconvert: `pip install nbconvert` "
            "(or `pip install pycircuits_widgets[share]`)"
        ) from exc
    nb, name = _load(notebook)
    saved = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    outputs = [o for cell in nb.cells for o in cell.get("outputs", []) if WIDGET_VIEW in o.get("data", {})]
    where = notebook if isinstance(notebook, (str, pathlib.Path)) else "the notebook"
    if outputs and not saved:
        raise ExportError(f"{where} shows {len(outputs)} widget(s) but was saved without widget state, "
                          f"so a page would show none of them. {_HOW_TO_SAVE_STATE}")
    page = Page(saved)
    for output in outputs:
        output["data"] = {"text/html": page.view_html(output["data"][WIDGET_VIEW]["model_id"], output["data"])}
        output["metadata"] = {"pcw_export": True}
    page.add_children()  # each view's saved state carries its kernel-less answers (_offline)
    if page.unsaved:
        warnings.warn(f"{where}: {page.unsaved} widget output(s) have no saved widget state (widgets closed or "
                      f"re-created after they were shown) and show a placeholder. {_HOW_TO_SAVE_STATE}", stacklevel=2)
    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[DictLoader({"pcw_notebook.html.j2": _TEMPLATE})],
        template_file="pcw_notebook.html.j2",
    )
    if title:
        nb.metadata["title"] = title
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": name}})
    head, _, rest = body.partition("</head>")
    main, _, tail = rest.rpartition("</body>")
    return f"{head}{page.styles(theme=False)}\n</head>{main}{page.scripts()}\n</body>{tail}"


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
    return write_atomic(out, render_notebook_html(notebook, title=title))
