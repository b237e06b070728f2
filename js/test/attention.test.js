import { describe, expect, it } from "vitest";
import {
  MASK_RGB,
  attentionLut,
  decodePatterns,
  headPattern,
  unpackCausal,
  patternPixels,
  maskPolygon,
  cellAt,
  cellSize,
  labelStride,
  tokenWeights,
  floatRow,
} from "../src/lib/attention.js";

describe("attention helpers", () => {
  const lut = attentionLut();
  it("lut runs from light to dark over 256 levels", () => {
    expect(lut).toHaveLength(256);
    const sum = (c) => c[0] + c[1] + c[2];
    expect(sum(lut[0])).toBeGreaterThan(sum(lut[128]));
    expect(sum(lut[128])).toBeGreaterThan(sum(lut[255]));
  });
  const payload = (data, shape, layout, n) => ({ view: new DataView(Uint8Array.from(data).buffer), dtype: "uint8", shape, layout, n });
  it("headPattern picks [layer, head] of dense [L, H, n, n] patterns", () => {
    const data = Array.from({ length: 2 * 3 * 4 }, (_, i) => i);
    const p = decodePatterns(payload(data, [2, 3, 2, 2], "dense", 2));
    expect(Array.from(headPattern(p, 1, 2))).toEqual([20, 21, 22, 23]);
  });
  it("causal payloads carry the lower triangle by rows and unpack with zeros above it", () => {
    // n = 3: rows [a], [b c], [d e f]; two heads of one layer
    const p = decodePatterns(payload([1, 2, 3, 4, 5, 6, 11, 12, 13, 14, 15, 16], [1, 2, 6], "causal", 3));
    expect(Array.from(headPattern(p, 0, 0))).toEqual([1, 0, 0, 2, 3, 0, 4, 5, 6]);
    expect(Array.from(headPattern(p, 0, 1))).toEqual([11, 0, 0, 12, 13, 0, 14, 15, 16]);
    const one = decodePatterns(payload([7, 8, 9], [3], "causal", 2)); // a one-head (detail) payload
    expect(Array.from(headPattern(one))).toEqual([7, 0, 8, 9]);
    expect(Array.from(unpackCausal(Uint8Array.from([1]), 1))).toEqual([1]);
  });
  it("decodePatterns refuses a shape that does not fit its layout", () => {
    expect(() => decodePatterns(payload([1, 2, 3, 4], [1, 1, 4], "causal", 3))).toThrow(/does not hold causal/);
    expect(() => decodePatterns(payload([1, 2, 3, 4], [4], "packed", 2))).toThrow(/does not hold packed/);
  });
  it("patternPixels colours by lut and greys out src > dest only when causal", () => {
    const v = Uint8Array.from([255, 7, 0, 128]); // 2x2: [0,1] is above the diagonal
    const px = patternPixels(v, 2, lut, true);
    expect(Array.from(px.slice(0, 3))).toEqual(lut[255]);
    expect(Array.from(px.slice(4, 7))).toEqual(MASK_RGB);
    expect(Array.from(px.slice(12, 15))).toEqual(lut[128]);
    expect(Array.from(patternPixels(v, 2, lut, false).slice(4, 7))).toEqual(lut[7]);
  });
  it("maskPolygon is the staircase above the diagonal", () => {
    expect(maskPolygon(3, 10)).toEqual([
      [10, 0], [30, 0], [30, 20], [20, 20], [20, 10], [10, 10], [10, 0],
    ]);
    expect(maskPolygon(1, 10)).toEqual([]);
  });
  it("cellAt maps pixels to (dest, src) and rejects outside points", () => {
    expect(cellAt(25, 5, 10, 3)).toEqual({ dest: 0, src: 2 });
    expect(cellAt(30, 5, 10, 3)).toBeNull();
    expect(cellAt(-1, 5, 10, 3)).toBeNull();
  });
  it("cell size and label stride", () => {
    expect(cellSize(10)).toBe(64);
    expect(cellSize(2048)).toBe(1);
    expect(labelStride(1)).toBe(13);
    expect(labelStride(20)).toBe(1);
  });
  it("tokenWeights reads the row as destination and the column as source", () => {
    // A = [[255, 0, 0], [51, 204, 0], [0, 102, 153]]
    const v = Uint8Array.from([255, 0, 0, 51, 204, 0, 0, 102, 153]);
    const row = Array.from(tokenWeights(v, 3, 1, "destination"));
    expect(row.slice(0, 2)).toEqual([51 / 255, 204 / 255]);
    expect(row[2]).toBeNaN();
    const col = Array.from(tokenWeights(v, 3, 1, "source"));
    expect(col[0]).toBeNaN();
    expect(col.slice(1)).toEqual([204 / 255, 102 / 255]);
    expect(Array.from(tokenWeights(v, 3, -1, "source")).every(Number.isNaN)).toBe(true);
  });
  it("floatRow copies a float32 row from a DataView at an offset", () => {
    const f = new Float32Array([9, 0.25, 0.75]);
    expect(Array.from(floatRow(new DataView(f.buffer, 4, 8)))).toEqual([0.25, 0.75]);
  });
});
