// The browser-side selection rules (the explorer links its views with them, kernel or not).
import { describe, expect, it } from "vitest";
import { FOLLOWS, applySelection, headData, headLabel, resolveSelection } from "../src/lib/selection.js";
import { HostModel } from "../src/lib/host.js";

const ids = [5, 7, 5, 9];
const none = { layer: 0, head: 0, position: -1, token: -1 };

describe("resolveSelection", () => {
  it("a position selects its token", () => {
    expect(resolveSelection(none, { position: 1 }, ids)).toEqual({ ...none, position: 1, token: 7 });
  });
  it("a token selects its last position, or none when absent", () => {
    expect(resolveSelection(none, { token: 5 }, ids)).toMatchObject({ position: 2, token: 5 });
    expect(resolveSelection({ ...none, position: 0, token: 5 }, { token: 5 }, ids)).toMatchObject({ position: 0 });
    expect(resolveSelection({ ...none, position: 1, token: 7 }, { token: 42 }, ids)).toMatchObject({ position: -1, token: 42 });
  });
  it("no token means no position; clearing the position keeps the token", () => {
    expect(resolveSelection({ ...none, position: 1, token: 7 }, { token: -1 }, ids)).toMatchObject({ position: -1, token: -1 });
    expect(resolveSelection({ ...none, position: 1, token: 7 }, { position: -1 }, ids)).toMatchObject({ position: -1, token: 7 });
  });
  it("a head change keeps the token selection", () => {
    expect(resolveSelection({ ...none, position: 3, token: 9 }, { layer: 1, head: 6 }, ids)).toEqual({ layer: 1, head: 6, position: 3, token: 9 });
  });
});

describe("applySelection", () => {
  const model = (state) => {
    const saved = [];
    const m = new HostModel("x", state, { onSave: (_, c) => saved.push(c) });
    return Object.assign(m, { saved });
  };
  it("moves every model that shows a key and saves only the changed ones", () => {
    const explorer = model({ ...none });
    const kids = {
      loss: model({ position: -1 }),
      trigrams: model({ layer: 0, head: 0, token: -1 }),
      composition: model({ layer: 1, head: 6 }),
    };
    applySelection(explorer, kids, { layer: 1, head: 6, position: 2, token: 5 });
    expect(explorer.saved).toEqual([{ layer: 1, head: 6, position: 2, token: 5 }]);
    expect(kids.loss.saved).toEqual([{ position: 2 }]);
    expect(kids.trigrams.saved).toEqual([{ layer: 1, head: 6, token: 5 }]);
    expect(kids.composition.saved).toEqual([]); // already there
    expect(Object.keys(FOLLOWS)).toEqual(["loss", "attention", "trigrams", "composition", "eigen"]);
  });
});

describe("headLabel and headData", () => {
  it("writes a head one way", () => expect(headLabel(1, 6)).toBe("L1.H6"));
  it("returns the payload only when it is the selected head's", () => {
    const table = { layer: 1, head: 6, rows: "kernel" };
    expect(headData({ layer: 1, head: 6, trigrams: table }, "trigrams")).toBe(table);
    expect(headData({ layer: 0, head: 3, trigrams: table }, "trigrams")).toBeNull();
  });
});
