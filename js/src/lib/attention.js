// Pure helpers of the AttentionPatterns view: decoding of the pattern payloads, uint8
// patterns -> pixels, the causal mask outline, hit testing, label thinning and the token
// view's weights. A head's pattern is a square [n, n] uint8 array A[dest * n + src] =
// round(255 a) (row = destination, column = source).
import { decodeArray } from "./buffers.js";
import { colorScale } from "./color.js";

/** Grey of masked (src > dest) cells; the view hatches them on top. */
export const MASK_RGB = [205, 205, 205];

/** 256-entry RGB lookup for uint8 attention (0 -> light, 255 -> dark blue). */
export function attentionLut() {
  const scale = colorScale([0, 1], { mode: "sequential", vmin: 0, vmax: 1 });
  return Array.from({ length: 256 }, (_, q) => scale.rgb(q / 255));
}

/**
 * Decode a patterns payload of widgets/views/attention.py ``encode_patterns``: uint8 with
 * ``layout`` "dense" (shape [..., n, n]) or "causal" (shape [..., n (n + 1) / 2]: each head's
 * lower triangle, row `dest` holding sources 0..dest at offset dest (dest + 1) / 2). Leading
 * dims are [L, H] (all heads) or none (one head).
 * @returns {{data: Uint8Array, layout: string, n: number, per: number, nHeads: number}}
 */
export function decodePatterns(payload) {
  const { data, shape } = decodeArray(payload);
  const layout = payload.layout ?? "dense";
  const causal = layout === "causal";
  const n = payload.n ?? shape[shape.length - 1];
  const per = causal ? (n * (n + 1)) / 2 : n * n;
  const lead = shape.slice(0, shape.length - (causal ? 1 : 2));
  const inner = causal ? shape[shape.length - 1] : shape[shape.length - 1] * shape[shape.length - 2];
  if (inner !== per || (layout !== "causal" && layout !== "dense")) {
    throw new Error(`decodePatterns: shape [${shape}] does not hold ${layout} patterns of side ${n}`);
  }
  return { data, layout, n, per, nHeads: lead.length === 2 ? lead[1] : 1 };
}

/** The lower triangle of an [n, n] pattern, packed by rows, as a full [n * n] array (zeros above). */
export function unpackCausal(packed, n) {
  const out = new Uint8Array(n * n);
  let offset = 0;
  for (let d = 0; d < n; d++) {
    out.set(packed.subarray(offset, offset + d + 1), d * n);
    offset += d + 1;
  }
  return out;
}

/**
 * The [n * n] pattern of one head of decoded patterns (a view for "dense", unpacked for
 * "causal"); a one-head payload ignores layer and head.
 */
export function headPattern(patterns, layer, head) {
  const { data, layout, n, per, nHeads } = patterns;
  const start = data.length === per ? 0 : (layer * nHeads + head) * per;
  const slice = data.subarray(start, start + per);
  return layout === "causal" ? unpackCausal(slice, n) : slice;
}

/**
 * RGBA pixels (one per cell) of a pattern; masked cells (src > dest when causal) are grey.
 * A max-pooled overview is square blocks, so the same rule masks exactly the blocks that
 * lie wholly above the diagonal.
 * @param {Uint8Array} values [n * n] @param {number} n @param {number[][]} lut from attentionLut
 */
export function patternPixels(values, n, lut, causal = true) {
  const px = new Uint8ClampedArray(n * n * 4);
  for (let d = 0; d < n; d++) {
    for (let s = 0; s < n; s++) {
      const i = d * n + s;
      const rgb = causal && s > d ? MASK_RGB : lut[values[i]];
      const o = i * 4;
      px[o] = rgb[0];
      px[o + 1] = rgb[1];
      px[o + 2] = rgb[2];
      px[o + 3] = 255;
    }
  }
  return px;
}

/**
 * Outline [x, y][] of the masked triangle (cells with src > dest) of an n x n grid of
 * `cell`-pixel cells: the staircase just above the diagonal. Empty for n < 2.
 */
export function maskPolygon(n, cell) {
  if (n < 2) return [];
  const pts = [
    [cell, 0],
    [n * cell, 0],
    [n * cell, (n - 1) * cell],
  ];
  for (let k = n - 1; k >= 1; k--) {
    pts.push([k * cell, k * cell], [k * cell, (k - 1) * cell]);
  }
  return pts;
}

/** The (dest, src) cell under a point in grid pixels, or null outside the grid. */
export function cellAt(x, y, cell, n) {
  const src = Math.floor(x / cell);
  const dest = Math.floor(y / cell);
  if (x < 0 || y < 0 || src >= n || dest >= n) return null;
  return { dest, src };
}

/** Pixels per cell so that n cells fill about `target` pixels (at least 1). */
export function cellSize(n, target = 640) {
  return Math.max(1, Math.floor(target / n));
}

/** Label every k-th position so labels are at least `minPx` apart. */
export function labelStride(cell, minPx = 13) {
  return Math.max(1, Math.ceil(minPx / cell));
}

/**
 * Weights the token view shades with, for a focused token `pos` of a [n, n] pattern:
 * "destination": the row A[pos, :] (attention pos pays to each source);
 * "source": the column A[:, pos] (attention each destination pays to pos).
 * Masked entries (causal, not attendable) are NaN. Values are uint8 / 255.
 */
export function tokenWeights(values, n, pos, mode, causal = true) {
  const w = new Float64Array(n).fill(NaN);
  if (pos < 0 || pos >= n) return w;
  for (let t = 0; t < n; t++) {
    const [d, s] = mode === "source" ? [t, pos] : [pos, t];
    if (!(causal && s > d)) w[t] = values[d * n + s] / 255;
  }
  return w;
}

/** Short label of a token for axes: visible text, cut to `max` characters. */
export function shortLabel(text, max = 10) {
  return text.length > max ? text.slice(0, max - 1) + "…" : text;
}

/** Float32 copy of a binary row sent by the kernel (DataView or ArrayBuffer). */
export function floatRow(buffer) {
  if (buffer instanceof ArrayBuffer) return new Float32Array(buffer.slice(0));
  return new Float32Array(buffer.buffer.slice(buffer.byteOffset, buffer.byteOffset + buffer.byteLength));
}
