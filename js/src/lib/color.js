// Colour scales shared by the views. Values map to CSS rgb() strings; each scale is
// monotone in lightness so that the order of values survives a greyscale print.

/** [t, r, g, b] anchors of a sequential blue ramp (light -> dark). */
const BLUES = [
  [0, 247, 251, 255],
  [0.25, 198, 219, 239],
  [0.5, 107, 174, 214],
  [0.75, 33, 113, 181],
  [1, 8, 48, 107],
];
/** Diverging blue - white - red, t in [0, 1] with 0.5 the neutral midpoint. */
const BLUE_WHITE_RED = [
  [0, 33, 102, 172],
  [0.25, 146, 197, 222],
  [0.5, 247, 247, 247],
  [0.75, 244, 165, 130],
  [1, 178, 24, 43],
];

function interpolate(anchors, t) {
  const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0));
  let i = 1;
  while (i < anchors.length - 1 && anchors[i][0] < x) i++;
  const [t0, ...c0] = anchors[i - 1];
  const [t1, ...c1] = anchors[i];
  const f = (x - t0) / (t1 - t0);
  return c0.map((v, k) => Math.round(v + f * (c1[k] - v)));
}

const css = ([r, g, b]) => `rgb(${r}, ${g}, ${b})`;

/**
 * A colour scale for a set of values.
 * mode "auto" picks diverging (centred on 0) when the values have both signs, else sequential.
 * @param {ArrayLike<number>} values
 * @param {{mode?: "auto"|"sequential"|"diverging", vmin?: number|null, vmax?: number|null}} opts
 */
export function colorScale(values, { mode = "auto", vmin = null, vmax = null } = {}) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  if (!Number.isFinite(lo)) [lo, hi] = [0, 1];
  lo = vmin ?? lo;
  hi = vmax ?? hi;
  const resolved = mode === "auto" ? (lo < 0 && hi > 0 ? "diverging" : "sequential") : mode;
  if (resolved === "diverging") {
    const m = Math.max(Math.abs(lo), Math.abs(hi)) || 1;
    return {
      mode: resolved,
      domain: [-m, m],
      rgb: (v) => interpolate(BLUE_WHITE_RED, 0.5 + v / (2 * m)),
      color: (v) => css(interpolate(BLUE_WHITE_RED, 0.5 + v / (2 * m))),
      gradient: gradientCss(BLUE_WHITE_RED),
    };
  }
  const span = hi - lo || 1;
  return {
    mode: resolved,
    domain: [lo, hi],
    rgb: (v) => interpolate(BLUES, (v - lo) / span),
    color: (v) => css(interpolate(BLUES, (v - lo) / span)),
    gradient: gradientCss(BLUES),
  };
}

function gradientCss(anchors) {
  return `linear-gradient(to right, ${anchors.map(([t, ...c]) => `${css(c)} ${t * 100}%`).join(", ")})`;
}

/** Relative luminance (WCAG) of an [r, g, b] colour, 0..1. */
export function luminance([r, g, b]) {
  const lin = (c) => {
    const s = c / 255;
    return s <= 0.03928 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
  };
  return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
}

/** Black or white text, whichever reads better on the background. */
export function textOn(rgb) {
  return luminance(rgb) > 0.35 ? "#111" : "#fff";
}

/**
 * A palette colour (a `--pcw-*` token of components/view.css) as an element with computed
 * style `style` sees it, for drawing on a canvas in the host's theme; the element's text
 * colour where no view's CSS is loaded (a test's bare DOM).
 * @param {CSSStyleDeclaration} style
 * @param {string} token e.g. "--pcw-warn"
 */
export function paletteColor(style, token) {
  return style.getPropertyValue(token).trim() || style.color;
}

/**
 * Call `callback` whenever the host page's theme may have changed: JupyterLab switches
 * themes by toggling attributes and CSS variables on <body> (data-jp-theme-light,
 * data-jp-theme-name, class, style); other hosts on <html>; the OS via prefers-color-scheme.
 * Canvases read colours from CSS variables when they draw, so they redraw on this signal.
 * @returns {() => void} stop observing
 */
export function observeTheme(callback) {
  if (typeof document === "undefined") return () => {};
  const observer = new MutationObserver(() => callback());
  const attributeFilter = ["class", "style", "data-jp-theme-light", "data-jp-theme-name", "data-theme"];
  for (const el of [document.documentElement, document.body]) {
    if (el) observer.observe(el, { attributes: true, attributeFilter });
  }
  const media = typeof matchMedia === "function" ? matchMedia("(prefers-color-scheme: dark)") : null;
  media?.addEventListener?.("change", callback);
  return () => {
    observer.disconnect();
    media?.removeEventListener?.("change", callback);
  };
}
