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

/** Do boxes [x0, y0, x1, y1] a and b overlap? */
const hits = (a, b) => a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3];

/**
 * The order in which a scatter's points get labels: the `k` largest and `k` smallest by
 * each coordinate, taken in turn (largest x, smallest x, largest y, smallest y, second
 * largest x, ...), each point once. `ys` may be null (one axis).
 * @param {ArrayLike<number>} xs  @param {ArrayLike<number> | null} ys
 * @returns {number[]}
 */
export function extremeOrder(xs, ys, k) {
  const ranked = [xs, ys].filter(Boolean).flatMap((v) => {
    const up = Array.from(v, (_, i) => i).filter((i) => Number.isFinite(v[i])).sort((a, b) => v[b] - v[a]);
    return [up, [...up].reverse()];
  });
  const out = [];
  for (let j = 0; j < k; j++) for (const r of ranked) if (j < r.length && !out.includes(r[j])) out.push(r[j]);
  return out;
}

/**
 * Labels of a scatter's points that never overlap one another nor cover another point.
 * Greedy: `always` (e.g. the selected point) first, then `order`; each label tries four
 * spots around its point (right, left, above, below) and takes the first inside `bounds`
 * that hits no label already placed and no other point; a point with no such spot stays
 * unlabelled (its label shows on hover). An `always` point with no free spot takes its
 * first spot inside the plot, whatever it covers (labels placed after it avoid it); a
 * `loose` point (e.g. an extreme one, in a cloud too dense for any label to miss every dot)
 * still unlabelled after `order` takes a spot that hits no label, over dots if it must.
 * Text is `height` px tall, its baseline at y; `widths[i]` is label i's estimated width;
 * `pad` px around it stay clear too (a label's halo).
 * @param {ArrayLike<number>} px  @param {ArrayLike<number>} py  point centres, pixels
 * @param {[number, number, number, number]} bounds  [x0, y0, x1, y1] the labels stay in
 * @returns {Map<number, {x: number, y: number, anchor: "start" | "middle" | "end", box: number[]}>}
 */
export function placeLabels(px, py, widths, order, { always = [], loose = [], bounds, radius = 5, height = 10, gap = 2, pad = 1.5 }) {
  const points = Array.from(px, (x, i) => [x - radius, py[i] - radius, x + radius, py[i] + radius]);
  const placed = new Map();
  const spots = (i) => {
    const w = widths[i], x = px[i], y = py[i], d = radius + gap + pad;
    const mid = y + height / 2 - 1; // baseline that centres the text on the point
    const padded = ([x0, y0, x1, y1]) => [x0 - pad, y0 - pad, x1 + pad, y1 + pad];
    return [
      { x: x + d, y: mid, anchor: "start", box: [x + d, mid - height + 1, x + d + w, mid + 2] },
      { x: x - d, y: mid, anchor: "end", box: [x - d - w, mid - height + 1, x - d, mid + 2] },
      { x, y: y - d - 2, anchor: "middle", box: [x - w / 2, y - d - height - 1, x + w / 2, y - d] },
      { x, y: y + d + height - 1, anchor: "middle", box: [x - w / 2, y + d, x + w / 2, y + d + height + 1] },
    ].map((s) => ({ ...s, box: padded(s.box) })).filter(({ box }) => box[0] >= bounds[0] && box[1] >= bounds[1] && box[2] <= bounds[2] && box[3] <= bounds[3]);
  };
  const clear = (box) => [...placed.values()].every((p) => !hits(p.box, box));
  const free = (i, box) => clear(box) && points.every((b, j) => j === i || !hits(b, box));
  for (const i of always) {
    if (i < 0 || i >= points.length || placed.has(i)) continue;
    const options = spots(i);
    const spot = options.find((s) => free(i, s.box)) ?? options[0];
    if (spot) placed.set(i, spot);
  }
  for (const i of order) {
    if (placed.has(i)) continue;
    const spot = spots(i).find((s) => free(i, s.box));
    if (spot) placed.set(i, spot);
  }
  for (const i of loose) {
    if (placed.has(i)) continue;
    const spot = spots(i).find((s) => clear(s.box));
    if (spot) placed.set(i, spot);
  }
  return placed;
}
