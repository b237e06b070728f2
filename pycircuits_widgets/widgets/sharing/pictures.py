"""Pictures of the views, drawn in Python from their synced data, for the static
``text/html`` fallback (a code host's notebook preview runs no JavaScript).

Each view gets a small figure of what its author saw: heatmaps are PNGs (written here
with zlib, no imaging dependency) shown pixelated; the eigenvalue plane is an SVG of at
most ``n_layers * n_heads`` points; tables and token strips are plain HTML. Every figure
is bounded (cells pooled, rows cut), and :data:`BUDGET` bounds a whole display.
"""

from __future__ import annotations

import base64
import html
import struct
import zlib

import numpy as np

from ...models.tokenizer import escape_invisible, visible_whitespace
from ..core.payload import max_pool

BUDGET = 48_000
"""Most bytes of one display's static fallback (the explorer's included)."""
THUMB = 24
"""Most pixels per side of one head's thumbnail in the attention grid."""
DETAIL = 96
"""Most pixels per side of the selected head's pattern."""
TABLE_ROWS = 10
"""Skip-trigram rows shown."""
TOKENS = 40
"""Tokens shown in a token strip."""
_TEXT = 24
"""Most characters of one token shown."""
_NAN_RGB = (200, 200, 200)


def png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an ``[h, w, 3]`` uint8 image (8-bit RGB, no filter)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\0" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def img(rgb: np.ndarray, *, scale: int, alt: str, test_id: str) -> str:
    """An <img> of the image at ``scale`` screen pixels per pixel."""
    h, w, _ = rgb.shape
    data = base64.b64encode(png(rgb)).decode("ascii")
    return (f'<img data-pcw-figure="{test_id}" alt="{html.escape(alt)}" width="{w * scale}" height="{h * scale}" '
            f'style="image-rendering:pixelated" src="data:image/png;base64,{data}">')


def sequential(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] -> white..blue RGB (NaN grey)."""
    t = np.clip(np.nan_to_num(x, nan=0.0), 0.0, 1.0)[..., None]
    rgb = (255 * (1 - t) + np.array([25, 118, 210]) * t).round().astype(np.uint8)
    rgb[np.isnan(x)] = _NAN_RGB
    return rgb


def diverging(x: np.ndarray, limit: float) -> np.ndarray:
    """Values in [-limit, limit] -> blue..white..red RGB (NaN grey)."""
    t = np.clip(np.nan_to_num(x, nan=0.0) / (limit or 1.0), -1.0, 1.0)[..., None]
    red, blue = np.array([211, 47, 47]), np.array([25, 118, 210])
    rgb = np.where(t > 0, 255 * (1 - t) + red * t, 255 * (1 + t) - blue * t).round().astype(np.uint8)
    rgb[np.isnan(x)] = _NAN_RGB
    return rgb


def pool_to(a: np.ndarray, size: int) -> np.ndarray:
    """Max-pool the last two axes of ``a`` (weights >= 0) so that neither exceeds ``size`` (as the
    attention overview does: a strong weight is never averaged away)."""
    return max_pool(a, -(-a.shape[-1] // size))


def _token(s: str) -> str:
    s = escape_invisible(visible_whitespace(s))
    return html.escape(s if len(s) <= _TEXT else s[:_TEXT] + "…")


def _label(s: str) -> str:
    """A label, name or heading (user or checkpoint text) as HTML: invisible and reordering
    characters as escapes, as in a token (``escape_invisible``), then HTML-escaped."""
    return html.escape(escape_invisible(s))


def _caption(text: str) -> str:
    return f'<p style="margin:4px 0;font-weight:bold">{_label(text)}</p>'


# -- one figure per view ------------------------------------------------------------------
def attention(w) -> str:
    """Every head's pattern as a thumbnail grid (layers x heads), then the selected head."""
    overview = w.overview["weights"].astype(np.float32) / 255  # [L, H, m, m], held as round(255 a)
    L, H, _, _ = overview.shape
    thumbs = pool_to(overview, THUMB)
    t = thumbs.shape[-1]
    grid = np.full((L * (t + 1) - 1, H * (t + 1) - 1), np.nan, np.float32)
    for layer in range(L):
        for head in range(H):
            grid[layer * (t + 1):layer * (t + 1) + t, head * (t + 1):head * (t + 1) + t] = thumbs[layer, head]
    selected = pool_to(overview[w.layer, w.head], DETAIL)
    return (_caption(f"Attention patterns: {L} layers × {H} heads; selected L{w.layer}.H{w.head}")
            + img(sequential(grid), scale=2, alt="attention pattern of every head", test_id="attention-grid") + " "
            + img(sequential(selected), scale=max(1, 192 // selected.shape[0]), alt=f"attention pattern of head "
                  f"L{w.layer}.H{w.head}", test_id="attention-head"))


def _pending(what: str) -> str:
    """The picture of a view whose data its runner is still computing (a display can come first)."""
    return _caption(f"{what}: not computed yet")


def composition(w) -> str:
    """The shown composition kind's score of every (earlier head, later head) pair."""
    tables = w.scores.get(w.kind, {})
    if "correct" not in tables:
        return _pending(f"{w.kind}-composition scores")
    s = tables["correct"]  # [L, H, L, H]
    if w.subtract_baseline:
        s = s - w.baselines["correct"]
    L, H = s.shape[:2]
    # rows: heads of layers 0..L-2 (earlier), columns: heads of layers 1..L-1 (later)
    flat = s[:-1, :, 1:, :].reshape((L - 1) * H, (L - 1) * H)
    finite = flat[np.isfinite(flat)]
    limit = float(np.abs(finite).max()) if finite.size else 1.0
    return (_caption(f"{w.kind}-composition scores (rows: earlier head, columns: later head; "
                     f"{'minus baseline' if w.subtract_baseline else 'raw'}; max |score| {limit:.3g})")
            + img(diverging(flat, limit), scale=max(1, 192 // flat.shape[0]), alt=f"{w.kind}-composition heatmap",
                  test_id="composition"))


def eigen(w) -> str:
    """Each head at (OV positivity, QK positivity), the selected head ringed, and the
    selected head's OV eigenvalues in the complex plane."""
    if w.ov_positivity is None:
        return _pending("Eigenvalue positivity")
    ov = w.ov_positivity
    L, H = ov.shape
    # no QK positivity (e.g. rotary positions): the heads sit on the OV axis
    qk = np.zeros_like(ov) if w.qk_positivity is None else w.qk_positivity
    size, pad = 160, 10

    def xy(a, b):
        return pad + (a + 1) / 2 * (size - 2 * pad), pad + (1 - b) / 2 * (size - 2 * pad)

    dots = []
    for layer in range(L):
        hue = 360 * layer / max(L, 1)
        for head in range(H):
            x, y = xy(float(ov[layer, head]), float(qk[layer, head]))
            ring = ' stroke="black" stroke-width="2"' if (layer, head) == (w.layer, w.head) else ""
            dots.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="hsl({hue:.0f},70%,45%)"{ring}>'
                        f"<title>L{layer}.H{head}</title></circle>")
    axes = (f'<line x1="{pad}" y1="{size / 2}" x2="{size - pad}" y2="{size / 2}" stroke="#999"/>'
            f'<line x1="{size / 2}" y1="{pad}" x2="{size / 2}" y2="{size - pad}" stroke="#999"/>')
    plane = (f'<svg data-pcw-figure="eigen-positivity" xmlns="http://www.w3.org/2000/svg" width="{size}" '
             f'height="{size}" viewBox="0 0 {size} {size}">{axes}{"".join(dots)}</svg>')
    spectrum = ""
    detail = w.detail or {}
    if "ov_re" in detail:
        re, im = detail["ov_re"], detail["ov_im"]
        r = float(np.abs(re + 1j * im).max()) or 1.0
        points = "".join(f'<circle cx="{size / 2 + a / r * (size / 2 - pad):.1f}" cy="{size / 2 - b / r * (size / 2 - pad):.1f}" '
                         f'r="2" fill="#1976d2"/>' for a, b in zip(re.tolist(), im.tolist()))
        spectrum = (f' <svg data-pcw-figure="eigen-spectrum" xmlns="http://www.w3.org/2000/svg" width="{size}" '
                    f'height="{size}" viewBox="0 0 {size} {size}">{axes}{points}</svg>')
    return (_caption(f"Eigenvalue positivity (x: OV, y: QK) of every head; OV eigenvalues of L{w.layer}.H{w.head}")
            + plane + spectrum)


def skip_trigrams(w) -> str:
    """The top rows of the skip-trigram table."""
    t = w.trigrams or {}
    if "src" not in t:
        return _pending("Skip-trigrams")
    strings = t["strings"]  # keys are ids (str once the state went through JSON)

    def name(i: int) -> str:
        return _token(strings.get(i, strings.get(str(i), "?")))

    cols = [t[n][:TABLE_ROWS].tolist() for n in ("src", "dest", "out", "score")]
    rows = "".join(f"<tr><td><code>{name(s)}</code></td><td><code>{name(d)}</code></td><td><code>{name(o)}</code></td>"
                   f"<td>{float(v):.3g}</td></tr>" for s, d, o, v in zip(*cols))
    return (_caption(f"Top skip-trigrams of head L{t['layer']}.H{t['head']}"
                     f"{'' if t.get('exact', True) else ' (partial)'}")
            + '<table data-pcw-figure="skip-trigrams" border="1" cellpadding="2" style="border-collapse:collapse">'
            + "<tr><th>source</th><th>destination</th><th>out</th><th>score</th></tr>" + rows + "</table>")


def tokens(w) -> str:
    """The first tokens coloured by their values (the legend's scale)."""
    values = w.values.astype(np.float64)
    lo = w.vmin if w.vmin is not None else float(np.nanmin(values)) if values.size else 0.0
    hi = w.vmax if w.vmax is not None else float(np.nanmax(values)) if values.size else 1.0
    span = (hi - lo) if np.isfinite(hi - lo) and hi > lo else 1.0
    colours = sequential((values[:TOKENS] - lo) / span)
    spans = "".join(
        f'<span title="{v:.4g}" style="background:rgb({r},{g},{b});padding:0 1px">{_token(s)}</span>'
        for s, v, (r, g, b) in zip(w.tokens, values.tolist(), colours.tolist())
    )
    more = f" … {len(w.tokens) - TOKENS} more" if len(w.tokens) > TOKENS else ""
    return _caption(f"{w.label} per token") + f'<div data-pcw-figure="tokens" style="font-family:monospace">{spans}{more}</div>'


_TABLE = '<table data-pcw-figure="{id}" border="1" cellpadding="2" style="border-collapse:collapse">'


def _table(test_id: str, header: list[str], rows: list[list[str]]) -> str:
    """A small HTML table; cells are given already escaped."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return _TABLE.format(id=test_id) + f"<tr>{head}</tr>{body}</table>"


def _bars(test_id: str, labels: list[str], values: list[float], *, width: int = 160) -> str:
    """A horizontal SVG bar chart (bars from 0; each bar titled with its value)."""
    top = max((abs(v) for v in values if np.isfinite(v)), default=1.0) or 1.0
    label_w, row = 150, 14
    bars = "".join(
        f'<text x="0" y="{i * row + 10}" font-size="10">{_label(label[:_TEXT])}</text>'
        f'<rect x="{label_w}" y="{i * row + 2}" width="{max(abs(v), 0) / top * width:.1f}" height="{row - 4}" '
        f'fill="{"#1976d2" if v >= 0 else "#d32f2f"}"><title>{v:.4g}</title></rect>'
        f'<text x="{label_w + width + 4}" y="{i * row + 10}" font-size="10">{v:.3g}</text>'
        for i, (label, v) in enumerate(zip(labels, values)))
    w, h = label_w + width + 50, len(values) * row + 2
    return (f'<svg data-pcw-figure="{test_id}" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}" font-family="sans-serif">{bars}</svg>')


def path_expansion(w) -> str:
    """The loss ladder by path order and the most important terms (loss increase when removed), or
    why the text's logits are not a sum of paths (``refusal``)."""
    if w.refusal:
        return _caption(w.refusal)
    if w.importance is None:
        return _pending("Path expansion")
    importance = w.importance.astype(np.float64)
    order = np.argsort(-np.nan_to_num(importance, nan=-np.inf))[:TABLE_ROWS]
    return (_caption("Path expansion: mean loss with paths up to each order")
            + _bars("path-ladder", [r["label"] for r in w.ladder], [float(r["loss"]) for r in w.ladder]) + "<br>"
            + _caption("Most important terms (loss increase when removed, nats)")
            + _bars("path-terms", [w.terms[i]["name"] for i in order], [float(importance[i]) for i in order]))


def positional(w) -> str:
    """The selected head's positional score and measured attention against the offset, over the head's
    window (the offsets where its attention is on the text)."""
    if w.positional is None:
        return _pending("Attention by offset")
    shown = slice(None) if w.window is None else slice(int(w.window[w.layer, w.head]) + 1)
    pos = w.positional[w.layer, w.head, shown].astype(np.float64)
    measured = w.measured[w.layer, w.head, shown].astype(np.float64)
    size_x, size_y, pad = 240, 120, 8

    def line(values: np.ndarray, colour: str, test_id: str) -> str:
        finite = values[np.isfinite(values)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        span = (hi - lo) or 1.0
        step = (size_x - 2 * pad) / max(len(values) - 1, 1)
        points = " ".join(f"{pad + k * step:.1f},{pad + (1 - (v - lo) / span) * (size_y - 2 * pad):.1f}"
                          for k, v in enumerate(values.tolist()) if np.isfinite(v))
        return (f'<polyline data-pcw-curve="{test_id}" points="{points}" fill="none" stroke="{colour}" '
                f'stroke-width="1.5"/>')

    return (_caption(f"Attention by offset, head L{w.layer}.H{w.head}: positional score (blue, {w.rule}) and "
                     f"measured on the text (orange), each scaled to its range; offsets 0..{len(pos) - 1}")
            + f'<svg data-pcw-figure="positional" xmlns="http://www.w3.org/2000/svg" width="{size_x}" '
              f'height="{size_y}" viewBox="0 0 {size_x} {size_y}">'
            + line(pos, "#1976d2", "positional") + line(measured, "#ef6c00", "measured") + "</svg>")


def _pair(p) -> str:
    return f"L{p[0]}.H{p[1]} → L{p[2]}.H{p[3]}"


def virtual_heads(w) -> str:
    """The strongest virtual heads with their norms, positivity and most-copied tokens."""
    rows = [[html.escape(_pair(h["pair"])), f"{h['norm']:.3g}", f"{h['positivity']:.3g}",
             " ".join(f"<code>{_token(c['str'])}</code>" for c in h["copies"][:3])] for h in w.heads[:TABLE_ROWS]]
    return (_caption("Strongest virtual heads (V-composition)")
            + _table("virtual-heads", ["pair", "norm", "positivity", "copies"], rows))


def induction(w) -> str:
    """The selected pair's verdict and the top rows of its ranked K-composition table."""
    key = ",".join(str(int(x)) for x in w.selected_pair)
    pair = w.pairs.get(key, {})
    parts = [_caption(f"Induction mechanism of {_pair(w.selected_pair)}: {pair.get('sentence', '')}")]
    table = w.tables.get(key)
    if table:
        values = table["values"].tolist()

        def name(i: int) -> str:
            return f"<code>{_token(w.strings.get(str(i), '?'))}</code>"

        parts.append(_table("induction-table", ["destination", "source", "value"], [
            [name(d), name(s), f"{v:.3g}"] for d, s, v in list(zip(*table["tokens"].tolist(), values))[:TABLE_ROWS]]))
    return "".join(parts)


def bigrams(w) -> str:
    """Top next tokens of the first embedded rows (the selected token's first)."""
    if w.top_ids is None:
        return _pending("Direct path W_E W_U")
    ids, logits, tokens = w.top_ids, w.top_logits, w.row_tokens()
    order = sorted(range(len(tokens)), key=lambda i: tokens[i] != w.token)[:TABLE_ROWS]
    rows = [[f"<code>{_token(w.vocab[tokens[i]])}</code>",
             " ".join(f"<code>{_token(w.vocab[int(t)])}</code> {float(v):.3g}" for t, v in zip(ids[i][:5], logits[i][:5]))]
            for i in order]
    return _caption("Direct path W_E W_U: top next tokens") + _table("bigrams", ["token", "next tokens (logit)"], rows)


def dataset_examples(w) -> str:
    """The shown head's (or neuron's) top examples: score, where, and the context with the destination
    boxed and, once the re-run is in, each token's value above a tenth of the row's largest in bold."""
    if not w.rows:
        return _pending("Dataset examples")
    layer, head, neuron, rank_by = w.shown
    unit = f"neuron {neuron} of layer {layer}" if neuron >= 0 else f"head L{layer}.H{head}"
    score = "score" if neuron >= 0 or rank_by == "norm" else rank_by.replace("_", " ")

    def context(r) -> str:
        parts = []
        for i, seg in enumerate(r["segments"]):
            if i:
                parts.append("… ")
            values = seg["values"] or [None] * len(seg["ids"])
            top = max((abs(v) for v in values if v is not None), default=0) or 1
            for t, (token, v) in enumerate(zip(seg["ids"], values)):
                text = _token(w.strings.get(str(token), "?"))
                if seg["start"] + t == r["position"]:
                    text = f'<span style="border:2px solid #e65100">{text}</span>'
                elif v is not None and abs(v) >= 0.1 * top:
                    text = f"<b>{text}</b>"
                parts.append(text)
        return f"<code>{''.join(parts)}</code>"

    rows = [[f"{r['score']:.3g}" if r["score"] is not None else "—",
             (f"doc {r['document']} · " if r["document"] is not None else "") + f"w{r['window']}:{r['position']}",
             context(r)] for r in w.rows[:TABLE_ROWS]]
    return (_caption(f"Dataset examples of {unit} ({len(w.rows)} in the sweep of {w.corpus.get('model', '')})")
            + _table("dataset-examples", [score, "where", "context (destination boxed)"], rows))


def explorer(w) -> str:
    """The header line and the picture of each section marked ``picture`` (``w.sections``)."""
    parts = [_caption(f"Circuit explorer: {w.model_name}, head L{w.layer}.H{w.head}"
                      + (f", mean loss {w.mean_loss:.3f} nats" if w.mean_loss is not None else ""))]
    for section in w.sections:
        child = getattr(w, section["name"], None) if section.get("picture") else None
        if child is not None:
            parts.append(f"<div>{FIGURES[child._view](child)}</div>")
    return "".join(parts)


FIGURES = {
    "AttentionPatterns": attention,
    "CompositionMatrix": composition,
    "EigenvaluePlot": eigen,
    "SkipTrigramTable": skip_trigrams,
    "ColoredTokens": tokens,
    "CircuitExplorer": explorer,
    "PathExpansion": path_expansion,
    "PositionalQK": positional,
    "VirtualHeads": virtual_heads,
    "InductionMechanism": induction,
    "BigramTable": bigrams,
    "DatasetExamples": dataset_examples,
}
"""View name (``_view``) -> figure of a widget of that view."""
