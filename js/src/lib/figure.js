// A view as a figure for a paper or a slide: an SVG (and a PNG rasterised from it) of what the
// view shows, drawn by the view itself. There is no second drawing of any view here: the
// figure is the view's rendered element, cloned, with
//   - each <canvas> replaced by an <img> of its pixels (a heatmap as drawn),
//   - the state of its form controls written into attributes (a clone keeps only attributes),
//   - the page's chrome removed (CHROME: the figure menu, spinners, how to click, search boxes),
//   - a title and the selection above it,
// laid out once in the page (to measure it) and serialised into an SVG <foreignObject> with the
// bundle's CSS and the palette's resolved colours inside (an SVG drawn as an image, or opened
// on its own, sees no stylesheet of the page). Text stays text: the SVG holds the view's labels.
// Tools that draw no <foreignObject> (Inkscape, a word processor) get the same figure as a
// picture inside the SVG (svgDocument's <switch>).
import { headLabel } from "./selection.js";
import { stylesFor } from "./styles.js";

/** PNG pixels per CSS pixel: about 300 dpi at the view's size (96 CSS pixels per inch). */
export const FIGURE_SCALE = 3;

/** CSS pixels of margin around a figure. */
const PADDING = 8;

/** PNG pixels per CSS pixel of the picture an SVG figure carries for tools that draw no HTML. */
export const FALLBACK_SCALE = 2;

/** What a figure leaves out: the page's chrome, never what the view shows. */
export const CHROME = [
  // marked where it is made: the figure menu, paging, search and compute controls, how to click
  // (components/Note.svelte `chrome`), what needs a kernel
  "[data-chrome]",
  ".pcw-busy", // the busy indicator (components/Busy.svelte)
  "textarea",
  "input[type=search]",
  "input[type=text]",
].join(", ");

// Layout properties a canvas' <img> stand-in copies, so a view's `canvas` rules (a stacked
// overlay placed absolutely) keep holding for it.
const CANVAS_LAYOUT = ["position", "top", "left", "right", "bottom", "z-index", "display", "margin", "border",
  "vertical-align", "image-rendering"];

/** mount element -> {model, title} of the view mounted in it (index.js mountView). */
const sources = new WeakMap();

/**
 * Say what the view mounted in `el` is, for its figure: its `model` (the selection) and its
 * `title` ("" where it has none of its own: an explorer section's title is the section's).
 */
export function registerFigure(el, source) {
  sources.set(el, source);
}

function sourceOf(view) {
  for (let node = view.parentElement; node; node = node.parentElement) {
    if (sources.has(node)) return sources.get(node);
  }
  return null;
}

/** "SkipTrigramTable" -> "Skip trigram table": the title of a view shown on its own. */
export function viewTitle(viewName) {
  const words = String(viewName ?? "").match(/[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+/g) ?? [];
  const text = words.map((w, i) => (i === 0 || /^[A-Z]+$/.test(w) ? w : w.toLowerCase())).join(" ");
  return text.charAt(0).toUpperCase() + text.slice(1);
}

/**
 * The selection a figure states under its title, from the view's traits (`get(name)`; those it
 * lacks are undefined): "head L1.H6 · pair L0.H3 → L1.H2 · position 4 · neuron 5".
 */
export function selectionCaption(get) {
  const parts = [];
  const [layer, head, pair, position, neuron] = ["layer", "head", "selected_pair", "position", "neuron"].map(get);
  if (Number.isInteger(layer) && Number.isInteger(head) && head >= 0) parts.push(`head ${headLabel(layer, head)}`);
  if (Array.isArray(pair) && pair.length === 4) {
    parts.push(`pair ${headLabel(pair[0], pair[1])} → ${headLabel(pair[2], pair[3])}`);
  }
  if (Number.isInteger(position) && position >= 0) parts.push(`position ${position}`);
  if (Number.isInteger(neuron) && neuron >= 0) parts.push(`neuron ${neuron}`);
  return parts.join(" · ");
}

/** Pairs (element of `view`, its copy in `clone`) matching `selector`, in document order. */
function pairs(view, clone, selector) {
  const copies = clone.querySelectorAll(selector);
  return [...view.querySelectorAll(selector)].map((el, i) => [el, copies[i]]);
}

/** The view's element cloned as a figure shows it (module comment). */
function frozen(view) {
  const clone = view.cloneNode(true);
  for (const [canvas, copy] of pairs(view, clone, "canvas")) {
    const img = view.ownerDocument.createElement("img");
    img.src = canvas.toDataURL();
    img.className = canvas.className;
    const css = getComputedStyle(canvas);
    for (const name of CANVAS_LAYOUT) img.style.setProperty(name, css.getPropertyValue(name));
    const box = canvas.getBoundingClientRect();
    img.style.width = `${box.width}px`;
    img.style.height = `${box.height}px`;
    copy.replaceWith(img);
  }
  for (const [input, copy] of pairs(view, clone, "input")) {
    copy.toggleAttribute("checked", input.checked);
    copy.setAttribute("value", input.value);
  }
  for (const [select, copy] of pairs(view, clone, "select")) {
    [...copy.options].forEach((option, i) => option.toggleAttribute("selected", i === select.selectedIndex));
  }
  clone.querySelectorAll(CHROME).forEach((el) => el.remove());
  return clone;
}

// The figure's own lines (title, selection), styled inline: the page where the figure is measured
// and the SVG it is drawn in then lay them out alike.
const TITLE_STYLE = "font-size: 14px; font-weight: 600; margin: 0 4px 2px;";
const CAPTION_STYLE = "font-size: 12px; color: var(--pcw-text-muted); margin: 0 4px 4px;";

function textBlock(doc, style, text) {
  const el = doc.createElement("div");
  el.setAttribute("style", style);
  el.textContent = text;
  return el;
}

const escapeXml = (s) => s.replace(/[<>&"]/g, (c) => ({ "<": "&lt;", ">": "&gt;", "&": "&amp;", '"': "&quot;" })[c]);

/**
 * The figure of the view whose root (`.pcw-view`) is `view`: a standalone SVG document.
 * `title` and `caption` default to what the view's mount registered (its title, else its view
 * name's; its selection). Returns {svg, body, width, height, label}: the SVG document (no fallback
 * picture), its XHTML body, its size in CSS pixels and its <title>.
 */
export function figureSvg(view, { title, caption } = {}) {
  const source = sourceOf(view);
  const get = (name) => source?.model?.get(name);
  title ??= source?.title || viewTitle(get("_view"));
  caption ??= selectionCaption(get);
  const doc = view.ownerDocument;
  const figure = doc.createElement("div");
  figure.className = "pcw-page pcw-figure";
  if (title) figure.append(textBlock(doc, TITLE_STYLE, title));
  if (caption) figure.append(textBlock(doc, CAPTION_STYLE, caption));
  figure.append(frozen(view));
  // what the view inherits from the page, which the SVG's root would not
  const host = getComputedStyle(view.parentElement ?? view);
  const base = `display: block; box-sizing: border-box; padding: ${PADDING}px; font-size: ${host.fontSize}; ` +
    `line-height: ${host.lineHeight};`;
  // laid out beside the view (same stylesheets, same root), out of sight, to be measured: as
  // wide as its content, at most as the view (lines wrap where the view wraps them)
  const most = Math.ceil(Math.max(view.scrollWidth, view.getBoundingClientRect().width)) + 2 * PADDING;
  figure.style.cssText = `${base} position: absolute; left: -100000px; top: 0; width: fit-content; max-width: ${most}px;`;
  view.after(figure);
  const box = figure.getBoundingClientRect();
  const [width, height] = [Math.ceil(box.width), Math.ceil(box.height)];
  figure.remove();
  figure.style.cssText = `${base} width: ${width}px; height: ${height}px;`;

  const css = stylesFor(view);
  // the palette's tokens as the page resolves them here (a notebook's theme included): in the
  // SVG, JupyterLab's variables behind them are not defined
  const resolved = getComputedStyle(view);
  const tokens = [...new Set(css.match(/--pcw-[\w-]+(?=\s*:)/g) ?? [])]
    .map((name) => `${name}: ${resolved.getPropertyValue(name).trim()};`)
    .join(" ");
  const style = doc.createElement("style");
  style.textContent = `${css}\n.pcw-figure, .pcw-figure .pcw-view { ${tokens} }`;
  figure.prepend(style);
  const body = new XMLSerializer().serializeToString(figure);
  const label = [title, caption].filter(Boolean).join(": ");
  return { svg: svgDocument({ body, width, height, label }), body, width, height, label };
}

/**
 * The SVG document of a figure: its XHTML `body` in a <foreignObject>, which browsers draw; with
 * `fallback` (a PNG data URL of the same figure), that picture for the tools that draw no
 * <foreignObject> (a vector editor, a word processor), chosen by <switch> as draw.io's exports do.
 */
export function svgDocument({ body, width, height, label }, fallback = null) {
  const html = `<foreignObject x="0" y="0" width="${width}" height="${height}"` +
    `${fallback ? ' requiredFeatures="http://www.w3.org/TR/SVG11/feature#Extensibility"' : ""}>${body}</foreignObject>`;
  const picture = fallback ? `<image x="0" y="0" width="${width}" height="${height}" href="${fallback}"/>` : "";
  return `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}">` +
    `<title>${escapeXml(label)}</title>${fallback ? `<switch>${html}${picture}</switch>` : html}</svg>`;
}

// -- PNG ----------------------------------------------------------------------------------
const CRC_TABLE = Array.from({ length: 256 }, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
  return c >>> 0;
});

function crc32(bytes) {
  let c = 0xffffffff;
  for (const b of bytes) c = CRC_TABLE[(c ^ b) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/**
 * `png` (bytes) with a pHYs chunk saying `dpi` after its header: a paper's tools (LaTeX's
 * \includegraphics) size a PNG by it, and read one without it at 72 dpi, 4 times too large.
 */
export function withDpi(png, dpi) {
  const perMetre = Math.round(dpi / 0.0254);
  const chunk = new Uint8Array(4 + 4 + 9 + 4);
  const view = new DataView(chunk.buffer);
  view.setUint32(0, 9);
  chunk.set([0x70, 0x48, 0x59, 0x73], 4); // "pHYs"
  view.setUint32(8, perMetre);
  view.setUint32(12, perMetre);
  chunk[16] = 1; // unit: the metre
  view.setUint32(17, crc32(chunk.subarray(4, 17)));
  const headerEnd = 8 + 4 + 4 + 13 + 4; // signature, IHDR's length, type, data, CRC
  const out = new Uint8Array(png.length + chunk.length);
  out.set(png.subarray(0, headerEnd));
  out.set(chunk, headerEnd);
  out.set(png.subarray(headerEnd), headerEnd + chunk.length);
  return out;
}

/** The figure's SVG (without a fallback picture) rasterised at `scale` PNG pixels per CSS pixel: PNG bytes. */
async function rasterise({ svg, width, height }, scale, doc) {
  const img = new Image();
  img.src = `data:image/svg+xml;charset=utf-8,${encodeURIComponent(svg)}`;
  await img.decode();
  const canvas = doc.createElement("canvas");
  canvas.width = Math.round(width * scale);
  canvas.height = Math.round(height * scale);
  // an SVG image is drawn at the size asked for: the text is rendered at this resolution, not scaled up
  canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
  const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
  if (!blob) throw new Error(`pycircuits_widgets: the browser drew no PNG of this figure (${canvas.width} x ${canvas.height} pixels)`);
  return withDpi(new Uint8Array(await blob.arrayBuffer()), 96 * scale);
}

function dataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

/**
 * The figure of the view rooted at `view` as a Blob: `format` "svg" or "png" (at `scale` PNG
 * pixels per CSS pixel); `title`, `caption`: as figureSvg.
 */
export async function figure(view, { format = "svg", scale = FIGURE_SCALE, title, caption } = {}) {
  if (format !== "svg" && format !== "png") {
    throw new Error(`pycircuits_widgets: a figure is "svg" or "png", not ${JSON.stringify(format)}`);
  }
  const drawn = figureSvg(view, { title, caption });
  const png = await rasterise(drawn, format === "svg" ? FALLBACK_SCALE : scale, view.ownerDocument);
  if (format === "png") return new Blob([png], { type: "image/png" });
  return new Blob([svgDocument(drawn, await dataUrl(new Blob([png], { type: "image/png" })))], { type: "image/svg+xml" });
}

/** A file name for a figure titled `title`: "attention-patterns.svg". */
export function figureFileName(title, format) {
  const stem = String(title).toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "");
  return `${stem || "figure"}.${format}`;
}

/** Download the view's figure as a file (a Blob URL: works without a kernel, in a saved page too). */
export async function downloadFigure(view, format) {
  const blob = await figure(view, { format });
  const source = sourceOf(view);
  const a = view.ownerDocument.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = figureFileName(source?.title || viewTitle(source?.model?.get("_view")), format);
  a.click();
  // the download has read the Blob once it started; a browser may start it a little after the click
  setTimeout(() => URL.revokeObjectURL(a.href), 60_000);
}
