import { describe, expect, it } from "vitest";
import { orderBy, paginate } from "../src/lib/circuitTable.js";
import { linearScale, plotPoint, symmetricExtent, nearestPoint, pairGrid, headLabel, layerColor,
  layerSummary, labelStep, labelPlacement, declutterBoxes } from "../src/lib/circuitPlot.js";

describe("circuitTable", () => {
  it("orders descending, NaN last, stable on ties", () => {
    expect(orderBy(new Float32Array([1, 3, NaN, 3, -2]))).toEqual([1, 3, 0, 4, 2]);
  });
  it("paginates and clamps the page", () => {
    const items = [...Array(45).keys()];
    expect(paginate(items, 2, 20)).toEqual({ rows: [40, 41, 42, 43, 44], page: 2, pages: 3, start: 40 });
    expect(paginate(items, 99, 20).page).toBe(2);
    expect(paginate(items, -3, 20).rows[0]).toBe(0);
    expect(paginate([], 0, 20)).toEqual({ rows: [], page: 0, pages: 1, start: 0 });
  });
});

describe("circuitPlot", () => {
  it("linear scale inverts", () => {
    const s = linearScale([-1, 1], [0, 200]);
    expect(s(0)).toBe(100);
    expect(s.invert(150)).toBeCloseTo(0.5);
  });
  it("log magnitude keeps the phase and maps |z| to log(1+|z|)", () => {
    const [x, y] = plotPoint(-3, 4, true);
    expect(Math.hypot(x, y)).toBeCloseTo(Math.log(6));
    expect(Math.atan2(y, x)).toBeCloseTo(Math.atan2(4, -3));
    expect(plotPoint(-3, 4, false)).toEqual([-3, 4]);
    expect(plotPoint(0, 0, true)).toEqual([0, 0]);
  });
  it("symmetric extent covers the largest coordinate", () => {
    expect(symmetricExtent([1, -5], [2, 0.5])).toBeCloseTo(5.4);
    expect(symmetricExtent([], [])).toBe(1);
  });
  it("nearest point within a radius", () => {
    expect(nearestPoint([0, 10, 20], [0, 0, 0], 12, 1, 5)).toBe(1);
    expect(nearestPoint([0, 10], [0, 0], 50, 50, 5)).toBe(-1);
  });
  it("pair grid maps cells to [l1, h1, l2, h2] and back, and to the flat [L,H,L,H] index", () => {
    const g = pairGrid(3, 2); // rows: 0.0 0.1 1.0 1.1; cols: 1.0 1.1 2.0 2.1
    expect(g.rows).toBe(4);
    expect(g.pair(1, 2)).toEqual([0, 1, 2, 0]);
    expect(g.cell([0, 1, 2, 0])).toEqual([1, 2]);
    expect(g.index(1, 2)).toBe(((0 * 2 + 1) * 3 + 2) * 2 + 0);
    expect(g.cell([2, 0, 2, 0])).toBeNull();
  });
  it("labels and colours heads", () => {
    expect(headLabel(1, 7)).toBe("L1.H7");
    expect(layerColor(0)).not.toBe(layerColor(1));
    expect(layerColor(8)).toBe(layerColor(0));
  });
  it("summarises a composition table by layer pair: the strongest head pair, NaN below the diagonal", () => {
    const L = 3, H = 2;
    const value = (l1, h1, l2, h2) => (l1 < l2 ? l1 * 1000 + h1 * 100 + l2 * 10 + h2 : NaN);
    const s = layerSummary(L, H, value);
    expect(s.length).toBe(4);
    expect(s[0]).toBe(111); // L0 -> L1: h1 = 1, h2 = 1
    expect(s[1]).toBe(121); // L0 -> L2
    expect(Number.isNaN(s[2])).toBe(true); // L1 -> L1 undefined
    expect(s[3]).toBe(1121); // L1 -> L2
  });
  it("keeps label boxes that overlap no earlier one, in priority order, after the always-shown", () => {
    const boxes = [[0, 0, 40, 10], [30, 5, 70, 15], [100, 0, 140, 10], [35, 0, 60, 10]];
    expect(declutterBoxes(boxes, [1, 0, 2, 3])).toEqual([false, true, true, false]);
    expect(declutterBoxes(boxes, [1, 0, 2, 3], [0])).toEqual([false, false, true, false]); // 0 drawn anyway
  });
  it("steps axis labels so they never overlap", () => {
    expect(labelStep(30, 22)).toBe(1);
    expect(labelStep(9, 22)).toBe(3);
    expect(labelStep(0, 22)).toBeGreaterThan(1000);
  });
  it("keeps point labels inside the plot", () => {
    const inside = ({ x, y, anchor }, w) => (anchor === "start" ? x + w : x) <= 320 && (anchor === "end" ? x - w : x) >= 0 && y - 10 >= 0;
    for (const [px, py] of [[316, 8], [4, 8], [160, 160], [316, 300]]) {
      expect(inside(labelPlacement(px, py, 40, [0, 320], [0, 320]), 40)).toBe(true);
    }
    expect(labelPlacement(100, 100, 40, [0, 320], [0, 320]).anchor).toBe("start");
    expect(labelPlacement(300, 100, 40, [0, 320], [0, 320]).anchor).toBe("end");
  });
});
