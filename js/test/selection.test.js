// The browser-side selection rules (the explorer links its views with them, kernel or not).
import { describe, expect, it } from "vitest";
import { applySelection, headData, headLabel, resolveSelection, trackKernel, writerLookup } from "../src/lib/selection.js";
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
  // the keys each section follows, as the explorer's `sections` trait sends them
  const follows = { loss: ["position"], trigrams: ["layer", "head", "token"], composition: ["layer", "head", "selected_pair"], eigen: ["layer", "head"] };
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
    applySelection(explorer, kids, { layer: 1, head: 6, position: 2, token: 5 }, follows);
    expect(explorer.saved).toEqual([{ layer: 1, head: 6, position: 2, token: 5 }]);
    expect(kids.loss.saved).toEqual([{ position: 2 }]);
    expect(kids.trigrams.saved).toEqual([{ layer: 1, head: 6, token: 5 }]);
    expect(kids.composition.saved).toEqual([]); // already there
    applySelection(explorer, { unlisted: model({ layer: 0 }) }, { layer: 2 }, follows);
    expect(explorer.saved.at(-1)).toEqual({ layer: 2 }); // a view no section lists follows nothing
  });
  it("compares pairs by value: an equal pair is no change, a new one is saved", () => {
    const explorer = model({ ...none, selected_pair: [0, 1, 1, 2] });
    const kids = { composition: model({ layer: 0, head: 0, selected_pair: [0, 1, 1, 2] }), eigen: model({ layer: 0, head: 0 }) };
    applySelection(explorer, kids, { ...none, selected_pair: [0, 1, 1, 2] }, follows);
    expect(explorer.saved).toEqual([]);
    applySelection(explorer, kids, { ...none, layer: 1, head: 0, selected_pair: [0, 2, 1, 0] }, follows);
    expect(kids.composition.saved).toEqual([{ layer: 1, selected_pair: [0, 2, 1, 0] }]); // head 0 already
    expect(kids.eigen.saved).toEqual([{ layer: 1 }]); // eigen does not show pairs
  });
});

describe("with a live kernel only the explorer is moved", () => {
  const follows = { trigrams: ["layer", "head"], eigen: ["layer", "head"] };
  const model = (state, hooks) => {
    const saved = [];
    const m = new HostModel("x", state, hooks === undefined ? { onSave: (_, c) => saved.push(c) } : hooks);
    return Object.assign(m, { saved });
  };
  it("a live explorer is saved alone; its kernel moves the children, which keep no unsent change", () => {
    const explorer = model({ ...none });
    const kids = { trigrams: model({ layer: 0, head: 0 }), eigen: model({ layer: 0, head: 0 }) };
    const [kernelLinks, stop] = trackKernel(explorer);
    expect(kernelLinks()).toBe(false); // nothing heard yet
    applySelection(explorer, kids, { layer: 1, head: 6 }, follows, kernelLinks);
    expect(kernelLinks()).toBe(true); // the explorer's own change said its comm is live
    expect(explorer.saved).toEqual([{ layer: 1, head: 6 }]);
    expect(kids.trigrams.get("head")).toBe(0);
    kids.trigrams.save_changes();
    expect(kids.trigrams.saved).toEqual([]); // nothing stale to send later
    stop();
    applySelection(explorer, kids, { layer: 1, head: 7 }, follows, kernelLinks);
    expect(kernelLinks()).toBe(true); // (stopped: the last answer stays)
  });
  it("without a live comm, or a host that does not say, every view is moved here", () => {
    for (const emitter of [{ comm_live: false }, {}, undefined]) {
      const explorer = model({ ...none });
      const kids = { trigrams: model({ layer: 0, head: 0 }), eigen: model({ layer: 1, head: 6 }) };
      const [kernelLinks] = trackKernel(explorer);
      explorer._emit = function (event, _self, value) { // the event's model, as that host passes it
        for (const cb of [...(this._listeners.get(event) ?? [])]) cb(emitter, value);
      };
      applySelection(explorer, kids, { layer: 1, head: 6 }, follows, kernelLinks);
      expect(kernelLinks()).toBe(false);
      expect(kids.trigrams.saved).toEqual([{ layer: 1, head: 6 }]);
      expect(kids.eigen.saved).toEqual([]); // already there
    }
    const offline = model({ ...none }, {}); // a saved page: no onSave, comm_live false
    const kid = model({ layer: 0, head: 0 }, {});
    const [kernelLinks] = trackKernel(offline);
    applySelection(offline, { trigrams: kid }, { layer: 1, head: 6 }, follows, kernelLinks);
    expect(kernelLinks()).toBe(false);
    expect(kid.get("head")).toBe(6);
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
  // the kernel's strongest-writer table of a 3-layer, 2-head model (int32 [L, H, 2], -1 for none),
  // written out by hand: L1.H0 <- L0.H1, L1.H1 <- L0.H0, L2.H1 <- L1.H0, L2.H0 none
  const L = 3, H = 2;
  const writers = new Int32Array(L * H * 2).fill(-1);
  const put = (l2, h2, l1, h1) => writers.set([l1, h1], (l2 * H + h2) * 2);
  put(1, 0, 0, 1); put(1, 1, 0, 0); put(2, 1, 1, 0);
  const writerOf = writerLookup(writers, L, H);
  const base = { ...none, selected_pair: [] };

  it("reads the strongest K-composition writer into a head from the kernel's table", () => {
    expect(writerOf(1, 0)).toEqual([0, 1]);
    expect(writerOf(1, 1)).toEqual([0, 0]);
    expect(writerOf(2, 1)).toEqual([1, 0]);
    expect(writerOf(2, 0)).toBeNull(); // no writer (no finite score: a rotary model's refused table)
    expect(writerOf(0, 1)).toBeNull(); // layer 0 reads nothing composed
    expect(writerOf(3, 0)).toBeNull(); // out of range
    expect(writerLookup(null, L, H)).toBeNull(); // no table yet
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
