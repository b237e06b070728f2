// Geometry for the circuit plots: linear scales, the complex-plane view of eigenvalues,
// categorical layer colours and nearest-point hit testing (pure functions, vitest-tested).

/** A linear map from [d0, d1] to [r0, r1] with its inverse. */
export function linearScale([d0, d1], [r0, r1]) {
  const span = d1 - d0 || 1;
  const f = (v) => r0 + ((v - d0) / span) * (r1 - r0);
  f.invert = (p) => d0 + ((p - r0) / (r1 - r0)) * span;
  return f;
}

/**
 * Where an eigenvalue is drawn: as is, or with magnitude log(1 + |z|) and the same phase
 * (so huge and tiny eigenvalues share one plot and the sign/phase stays readable).
 * @returns {[number, number]}
 */
export function plotPoint(re, im, logScale) {
  if (!logScale) return [re, im];
  const r = Math.hypot(re, im);
  if (r === 0) return [0, 0];
  const s = Math.log1p(r) / r;
  return [re * s, im * s];
}

/** Half-width of a square window, centred on 0, that holds every point (a bit of margin). */
export function symmetricExtent(xs, ys) {
  let m = 0;
  for (let i = 0; i < xs.length; i++) m = Math.max(m, Math.abs(xs[i]), Math.abs(ys[i]));
  return m > 0 ? m * 1.08 : 1;
}

// Okabe-Ito: distinguishable with common colour-vision deficiencies (its black is a mid grey
// here, so it stays visible on a dark theme).
const CATEGORICAL = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#8c8c8c"];
/** Up to this many layers get one categorical colour each; more are coloured on a ramp. */
export const CATEGORICAL_LAYERS = CATEGORICAL.length;

/** Colour of layer `l` (cycles after 8 layers). */
export function layerColor(l) {
  return CATEGORICAL[((l % CATEGORICAL.length) + CATEGORICAL.length) % CATEGORICAL.length];
}

export { headLabel } from "./selection.js";

/**
 * Index of the point nearest to (x, y) within `radius` pixels, or -1.
 * @param {ArrayLike<number>} px  @param {ArrayLike<number>} py  pixel coordinates
 */
export function nearestPoint(px, py, x, y, radius) {
  let best = -1;
  let bestD = radius * radius;
  for (let i = 0; i < px.length; i++) {
    const d = (px[i] - x) ** 2 + (py[i] - y) ** 2;
    if (d <= bestD) {
      best = i;
      bestD = d;
    }
  }
  return best;
}

/**
 * The composition heatmap's grid: rows are writing heads h1 of layers 0..L-2, columns
 * reading heads h2 of layers 1..L-1 (only l1 < l2 composes). Maps a cell to the pair.
 */
export function pairGrid(nLayers, nHeads) {
  const rows = (nLayers - 1) * nHeads;
  return {
    rows,
    cols: rows,
    /** [l1, h1, l2, h2] of cell (r, c) */
    pair: (r, c) => [Math.floor(r / nHeads), r % nHeads, 1 + Math.floor(c / nHeads), c % nHeads],
    /** flat index into a [L, H, L, H] table */
    index: (r, c) => {
      const [l1, h1, l2, h2] = [Math.floor(r / nHeads), r % nHeads, 1 + Math.floor(c / nHeads), c % nHeads];
      return ((l1 * nHeads + h1) * nLayers + l2) * nHeads + h2;
    },
    /** cell of a pair, or null if it is not in the grid */
    cell: ([l1, h1, l2, h2]) =>
      l1 >= 0 && l1 < nLayers - 1 && l2 >= 1 && l2 < nLayers ? [l1 * nHeads + h1, (l2 - 1) * nHeads + h2] : null,
  };
}

/**
 * Layer-level summary of a composition table: for each layer pair (l1 < l2) the score of its
 * strongest head pair (largest value), so a composing pair of heads stands out in a 30-layer
 * model. `value(l1, h1, l2, h2)` gives a score (NaN when unknown).
 * @returns {Float64Array} [(L-1) * (L-1)], row l1 in 0..L-2, column l2 - 1; NaN where l1 >= l2
 */
export function layerSummary(nLayers, nHeads, value) {
  const n = nLayers - 1;
  const out = new Float64Array(n * n).fill(NaN);
  for (let l1 = 0; l1 < n; l1++) {
    for (let l2 = l1 + 1; l2 < nLayers; l2++) {
      let best = -Infinity;
      for (let h1 = 0; h1 < nHeads; h1++)
        for (let h2 = 0; h2 < nHeads; h2++) {
          const v = value(l1, h1, l2, h2);
          if (v > best) best = v;
        }
      if (best > -Infinity) out[l1 * n + (l2 - 1)] = best;
    }
  }
  return out;
}

/**
 * Which of `n` equal axis blocks of `blockPx` pixels get a text label, so that labels at
 * least `minPx` apart never overlap: every `step`-th block, starting at 0.
 * @returns {number} step (>= 1)
 */
export function labelStep(blockPx, minPx) {
  return Math.max(1, Math.ceil(minPx / Math.max(blockPx, 1e-9)));
}

/**
 * Where a point's label goes so it stays inside [x0, x1] x [y0, y1]: to the right and above
 * the point, flipped to the left (anchor "end") near the right edge and below near the top.
 * `width` is the label's estimated width in pixels.
 * @returns {{x: number, y: number, anchor: "start" | "end"}}
 */
export function labelPlacement(px, py, width, [x0, x1], [y0, y1], offset = 7) {
  const right = px + offset + width <= x1 || px - offset - width < x0;
  const y = py - offset + 2 - 10 < y0 ? py + offset + 8 : py - offset + 2;
  return { x: right ? px + offset : px - offset, y: Math.min(y, y1), anchor: right ? "start" : "end" };
}

/**
 * Which labels to draw so that no two overlap: greedy over `order` (priority; `always` first,
 * e.g. the selected point, drawn whatever it overlaps). `boxes[i]` = [x0, y0, x1, y1].
 * @returns {boolean[]} in index order
 */
export function declutterBoxes(boxes, order, always = []) {
  const kept = [];
  const shown = new Array(boxes.length).fill(false);
  const hits = (a, b) => a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3];
  for (const i of always) if (i >= 0 && i < boxes.length) kept.push(boxes[i]);
  for (const i of order) {
    if (always.includes(i)) continue;
    if (kept.every((b) => !hits(b, boxes[i]))) {
      kept.push(boxes[i]);
      shown[i] = true;
    }
  }
  return shown;
}
