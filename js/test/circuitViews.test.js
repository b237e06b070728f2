import { describe, expect, it } from "vitest";
import { orderBy, paginate } from "../src/lib/circuitTable.js";
import { linearScale, plotPoint, symmetricExtent, nearestPoint, pairGrid, headLabel, layerColor,
  layerSummary, labelStep, extremeOrder, placeLabels } from "../src/lib/circuitPlot.js";

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
  it("steps axis labels so they never overlap", () => {
    expect(labelStep(30, 22)).toBe(1);
    expect(labelStep(9, 22)).toBe(3);
    expect(labelStep(0, 22)).toBeGreaterThan(1000);
  });
  it("orders labels by extremity on each axis in turn, each point once", () => {
    const xs = [0.9, -0.8, 0.1, 0.2, -0.1];
    const ys = [0.0, 0.1, 0.95, -0.9, 0.5];
    expect(extremeOrder(xs, ys, 1)).toEqual([0, 1, 2, 3]);
    expect(extremeOrder(xs, ys, 2)).toEqual([0, 1, 2, 3, 4]);
    expect(extremeOrder(xs, null, 2)).toEqual([0, 1, 3, 4]);
    expect(extremeOrder([NaN, 1, 2], null, 5)).toEqual([2, 1]); // unknown values get no label
  });
  const overlap = (a, b) => a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3];
  it("places labels that overlap no other label nor another point, inside the bounds", () => {
    // a dense random cloud: brute-force check of every pair of placed boxes
    let seed = 7;
    const rand = () => ((seed = (seed * 16807) % 2147483647) / 2147483647);
    const n = 120;
    const px = Array.from({ length: n }, () => 34 + rand() * 280);
    const py = Array.from({ length: n }, () => rand() * 280);
    const widths = Array.from({ length: n }, (_, i) => 6.2 * (i % 3 ? 6 : 7));
    const order = Array.from({ length: n }, (_, i) => i);
    const bounds = [34, 0, 320, 286];
    const placed = placeLabels(px, py, widths, order, { always: [5], bounds, radius: 4 });
    expect(placed.has(5)).toBe(true);
    expect(placed.size).toBeGreaterThan(5); // not vacuous
    expect(placed.size).toBeLessThan(n);
    const items = [...placed];
    for (const [i, { box }] of items) {
      expect(box[0] >= bounds[0] && box[1] >= bounds[1] && box[2] <= bounds[2] && box[3] <= bounds[3]).toBe(true);
      expect(box[2] - box[0]).toBeCloseTo(widths[i] + 3); // and its halo, 1.5 px each side
      for (const [j, other] of items) if (j !== i) expect(overlap(box, other.box)).toBe(false);
      if (i === 5) continue; // the always-shown label may cover a point
      for (let j = 0; j < n; j++) if (j !== i) expect(overlap(box, [px[j] - 4, py[j] - 4, px[j] + 4, py[j] + 4])).toBe(false);
    }
  });
  it("flips a label to the side that stays inside the plot, and shows an always label even when crowded", () => {
    const bounds = [0, 0, 320, 320];
    expect(placeLabels([310], [100], [40], [0], { bounds }).get(0).anchor).toBe("end");
    expect(placeLabels([100], [100], [40], [0], { bounds }).get(0).anchor).toBe("start");
    // point 0 boxed in by neighbours on every side: unlabelled unless always shown
    const px = [100, 120, 80, 100, 100], py = [100, 100, 100, 88, 112];
    expect(placeLabels(px, py, px.map(() => 30), [0], { bounds, radius: 5 }).has(0)).toBe(false);
    expect(placeLabels(px, py, px.map(() => 30), [], { always: [0], bounds, radius: 5 }).has(0)).toBe(true);
    // loose: over dots, never over another label
    const loose = placeLabels(px, py, px.map(() => 30), [1], { loose: [0], bounds, radius: 5 });
    expect(loose.has(0)).toBe(true);
    expect(overlap(loose.get(0).box, loose.get(1).box)).toBe(false);
  });
});
