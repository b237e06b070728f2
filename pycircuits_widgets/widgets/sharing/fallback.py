"""Static HTML fallback of a widget, for renderers that run no JavaScript.

A code host's notebook preview (or any viewer without the widget manager) shows a
display's ``text/html`` when it cannot render ``application/vnd.jupyter.widget-view+json``.
:meth:`CircuitWidget._fallback_html` puts :func:`fallback_html` there, so a shared
notebook shows a picture of the view (:mod:`.pictures`) instead of an empty cell.
JupyterLab ranks the widget view first and never shows it.

A view without a picture (a user's own subclass view) gets a summary: a plain table of
its own synced traits, text HTML-escaped and truncated, binary arrays as dtype, shape and
range, and a 1-D array aligned with a ``tokens`` trait as a token / value table. The
fallback is built once, at display time, and saved in the notebook: it stays under
:data:`.pictures.BUDGET` bytes (a picture over it is replaced by the summary).
"""

from __future__ import annotations

import html
import json

import anywidget
import numpy as np

from ...models.tokenizer import escape_invisible
from .pictures import BUDGET, FIGURES

MAX_ROWS = 40
"""Most tokens (rows) or list items shown."""
MAX_TEXT = 160
"""Most characters of one text value shown."""

_NOTE = (
    "Static preview: the interactive view needs JavaScript (JupyterLab, or "
    "<code>python -m pycircuits_widgets export</code> for a standalone page)."
)
# Presentational attributes rather than CSS: short, and kept by HTML sanitizers.
_TABLE = 'border="1" cellpadding="2" style="border-collapse:collapse"'


def _text(value: str) -> str:
    short = value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "…"
    return html.escape(escape_invisible(short))


def _number(x) -> str:
    return f"{float(x):.4g}"


def _describe_array(arr: np.ndarray) -> str:
    shape = "×".join(map(str, arr.shape)) or "scalar"
    if arr.size == 0:
        return f"{arr.dtype} [{shape}] (empty)"
    stats = f"min {_number(arr.min())}, max {_number(arr.max())}"
    if arr.ndim == 1 and arr.size <= 12:
        stats = ", ".join(_number(v) for v in arr)
    return f"{arr.dtype} [{shape}]: {stats}"


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return _describe_array(value)
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, (list, tuple)):
        shown = ", ".join(_text(repr(v)) for v in value[:MAX_ROWS])
        more = f", … ({len(value) - MAX_ROWS} more)" if len(value) > MAX_ROWS else ""
        return f"[{shown}{more}] ({len(value)} items)"
    if isinstance(value, dict):
        return _text(json.dumps(value, default=str))
    return _text(str(value))


def _token_table(tokens: list[str], columns: dict[str, np.ndarray]) -> str:
    head = "".join(f"<th>{html.escape(name)}</th>" for name in ["#", "token", *columns])
    rows = []
    for i, token in enumerate(tokens[:MAX_ROWS]):
        values = "".join(f"<td>{_number(col[i])}</td>" for col in columns.values())
        rows.append(f"<tr><td>{i}</td><td><code>{_text(repr(token)[1:-1])}</code></td>{values}</tr>")
    if len(tokens) > MAX_ROWS:
        rows.append(f'<tr><td colspan="{2 + len(columns)}">… {len(tokens) - MAX_ROWS} more tokens</td></tr>')
    return f"<table {_TABLE}><tr>{head}</tr>{''.join(rows)}</table>"


def summary_html(widget) -> str:
    """A small static HTML table of ``widget``'s own synced traits (see module doc)."""
    base_traits = set(anywidget.AnyWidget.class_trait_names())
    names = [
        n
        for n in widget.trait_names(sync=True)
        if not n.startswith("_") and n not in base_traits and n != "error"  # shown above the table
    ]
    values = {n: getattr(widget, n) for n in names}
    tokens = values.get("tokens")
    aligned = {}
    if isinstance(tokens, list) and tokens:
        for name, value in values.items():
            if isinstance(value, np.ndarray) and value.shape == (len(tokens),):
                aligned[name] = value
    rows = "".join(
        f"<tr><th>{html.escape(n)}</th><td>{_describe(v)}</td></tr>"
        for n, v in values.items()
        if n not in aligned and not (n == "tokens" and aligned)
    )
    table = f"<table {_TABLE}>{rows}</table>" if rows else ""
    return table + (_token_table(tokens, aligned) if aligned else "")


def _frame(widget, body: str) -> str:
    error = f'<p style="color:#d32f2f">{_text(widget.error)}</p>' if widget.error else ""
    return (f'<div class="pcw-fallback" style="font-family:sans-serif;font-size:12px">'
            f"<p><b>{html.escape(type(widget).__name__)}</b> <i>{_NOTE}</i></p>{error}{body}</div>")


def fallback_html(widget) -> str:
    """The static fallback of ``widget``: a picture of its view drawn from its data, or the
    summary of its traits; at most ``BUDGET`` bytes."""
    figure = FIGURES.get(widget._view)
    if figure is not None:
        page = _frame(widget, figure(widget))
        if len(page.encode("utf-8")) <= BUDGET:
            return page
    return _frame(widget, summary_html(widget))
