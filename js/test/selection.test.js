// The browser-side selection rules (the explorer links its views with them, kernel or not).
import { describe, expect, it } from "vitest";
import { FOLLOWS, applySelection, headData, headLabel, resolveSelection, strongestWriter } from "../src/lib/selection.js";
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
    expect(Object.keys(FOLLOWS)).toEqual(["loss", "attention", "trigrams", "composition", "eigen", "paths", "induction", "positional", "virtual", "bigrams"]);
  });
  it("compares pairs by value: an equal pair is no change, a new one is saved", () => {
    const explorer = model({ ...none, selected_pair: [0, 1, 1, 2] });
    const kids = { composition: model({ layer: 0, head: 0, selected_pair: [0, 1, 1, 2] }), eigen: model({ layer: 0, head: 0 }) };
    applySelection(explorer, kids, { ...none, selected_pair: [0, 1, 1, 2] });
    expect(explorer.saved).toEqual([]);
    applySelection(explorer, kids, { ...none, layer: 1, head: 0, selected_pair: [0, 2, 1, 0] });
    expect(kids.composition.saved).toEqual([{ layer: 1, selected_pair: [0, 2, 1, 0] }]); // head 0 already
    expect(kids.eigen.saved).toEqual([{ layer: 1 }]); // eigen does not show pairs
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

describe("pairs", () => {
  // a 3-layer, 2-head K table [L, H, L, H] (row-major), NaN where l1 >= l2; written out by hand
  const L = 3, H = 2;
  const scores = new Float32Array(L * H * L * H).fill(NaN);
  const put = (l1, h1, l2, h2, v) => (scores[((l1 * H + h1) * L + l2) * H + h2] = v);
  put(0, 0, 1, 0, 0.2); put(0, 1, 1, 0, 0.5);
  put(0, 0, 1, 1, 0.3); put(0, 1, 1, 1, 0.3); // a tie: the first (L0.H0) wins, as numpy's argmax
  put(0, 0, 2, 1, 0.1); put(0, 1, 2, 1, 0.2); put(1, 0, 2, 1, 0.9); put(1, 1, 2, 1, 0.4);
  const writerOf = strongestWriter(scores, L, H);
  const base = { ...none, selected_pair: [] };

  it("the strongest K-composition writer into a head, over every earlier layer", () => {
    expect(writerOf(1, 0)).toEqual([0, 1]);
    expect(writerOf(1, 1)).toEqual([0, 0]);
    expect(writerOf(2, 1)).toEqual([1, 0]);
    expect(writerOf(2, 0)).toBeNull(); // no finite score (as a rotary model's refused table)
    expect(writerOf(0, 1)).toBeNull(); // layer 0 reads nothing composed
    expect(strongestWriter(null, L, H)(1, 0)).toBeNull();
  });
  it("a pair selects its later head, and keeps the clicked pair", () => {
    expect(resolveSelection(base, { selected_pair: [0, 0, 1, 0] }, [], writerOf)).toMatchObject({ layer: 1, head: 0, selected_pair: [0, 0, 1, 0] });
  });
  it("a reading head brings its strongest writer; a layer-0 head keeps the pair", () => {
    expect(resolveSelection(base, { layer: 2, head: 1 }, [], writerOf)).toMatchObject({ selected_pair: [1, 0, 2, 1] });
    const withPair = { ...base, layer: 1, head: 0, selected_pair: [0, 0, 1, 0] };
    expect(resolveSelection(withPair, { layer: 1, head: 0 }, [], writerOf).selected_pair).toEqual([0, 0, 1, 0]); // already its head
    expect(resolveSelection(withPair, { layer: 0, head: 1 }, [], writerOf).selected_pair).toEqual([0, 0, 1, 0]);
    expect(resolveSelection(withPair, { head: 1 }, [], writerOf).selected_pair).toEqual([0, 0, 1, 1]);
    expect(resolveSelection(withPair, { layer: 2, head: 0 }, [], writerOf).selected_pair).toEqual([0, 0, 1, 0]); // no writer known
    expect(resolveSelection(withPair, { head: 1 }, []).selected_pair).toEqual([0, 0, 1, 0]); // no K table yet
  });
});
