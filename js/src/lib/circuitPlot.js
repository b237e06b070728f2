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

// Okabe-Ito: distinguishable with common colour-vision deficiencies.
const CATEGORICAL = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"];

/** Colour of layer `l` (cycles after 8 layers). */
export function layerColor(l) {
  return CATEGORICAL[((l % CATEGORICAL.length) + CATEGORICAL.length) % CATEGORICAL.length];
}

/** "L.H" label of a head. */
export function headLabel(layer, head) {
  return `${layer}.${head}`;
}

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
 * Which points get a text label without overlapping an earlier label: greedy in index order,
 * a point is labelled if no labelled point lies within `minDist` pixels.
 * @returns {boolean[]}
 */
export function declutter(px, py, minDist) {
  const kept = [];
  return Array.from(px, (x, i) => {
    const free = kept.every((j) => (px[j] - x) ** 2 + (py[j] - py[i]) ** 2 >= minDist * minDist);
    if (free) kept.push(i);
    return free;
  });
}
