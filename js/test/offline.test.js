import { describe, expect, it, vi } from "vitest";
import { decodeArray } from "../src/lib/buffers.js";
import { HostModel } from "../src/lib/host.js";
import { answerOffline, isLive, offlinePatch } from "../src/lib/offline.js";

// float16 bits of 1.5, -2 and 0.099975586 (numpy: np.float16([1.5, -2, 0.1]).view(np.uint16))
const F16 = new Uint16Array([0x3e00, 0xc000, 0x2e66]);
const IDS = new Uint16Array([7, 300]);

function saved() {
  const bytes = new Uint8Array(F16.byteLength + IDS.byteLength);
  bytes.set(new Uint8Array(F16.buffer), 0);
  bytes.set(new Uint8Array(IDS.buffer), F16.byteLength);
  const rules = [{
    on: ["layer", "head"],
    base: { error: "", table: { strings: { 7: "a" } } },
    patches: { "1,2": { table: { layer: 1, head: 2, score: { packed: [0, "float16", [3]] }, ids: { packed: [6, "uint16", [2]] } } } },
    missing: "needs a kernel",
  }];
  return { rules: JSON.stringify(rules), kernel: { query: "search needs a kernel" }, data: new DataView(bytes.buffer) };
}

describe("kernel-less answers", () => {
  it("builds the patch of the new selection: base merged, packed arrays resolved", () => {
    const m = new HostModel("m", { layer: 1, head: 2, _offline: saved() });
    const patch = offlinePatch(m, ["head"]);
    expect(patch.error).toBe("");
    expect(patch._offline_note).toBe(""); // an answer clears the last limit's note
    expect(patch.table.strings).toEqual({ 7: "a" });
    expect(Array.from(decodeArray(patch.table.score).data)).toEqual([1.5, -2, Math.fround(0.099975586)]);
    expect(Array.from(decodeArray(patch.table.ids).data)).toEqual([7, 300]);
    m.update({ head: 0 });
    // a page without a kernel's limits are notes, never the view's error
    expect(offlinePatch(m, ["head"])).toEqual({ _offline_note: "needs a kernel" });
    expect(offlinePatch(m, ["query"])).toEqual({ _offline_note: "search needs a kernel" });
  });

  it("answers a kernel-less model once per burst of changes, and never a live one", async () => {
    const off = new HostModel("m", { layer: 0, head: 0, _offline: saved() });
    answerOffline(off);
    expect(off.get("_needs_kernel")).toEqual({ query: "search needs a kernel" });
    off.set("layer", 1);
    off.set("head", 2); // (1, 0) is never answered: the burst is answered for (1, 2)
    await Promise.resolve();
    expect(off.get("table").head).toBe(2);
    expect(off.get("error")).toBe("");

    const live = new HostModel("m", { layer: 0, head: 0, _offline: saved() }, { onSave: () => {} });
    answerOffline(live);
    live.set("layer", 1);
    live.set("head", 2);
    await Promise.resolve();
    expect(live.get("table")).toBeUndefined();
    expect(live.get("_needs_kernel")).toBeUndefined();
  });

  it("reads a saved state's rules once, and a new saved state anew", () => {
    const parse = vi.spyOn(JSON, "parse");
    try {
      const m = new HostModel("m", { layer: 1, head: 2, _offline: saved() });
      offlinePatch(m, ["head"]);
      const once = parse.mock.calls.length;
      expect(once).toBeGreaterThan(0);
      m.update({ head: 0 });
      expect(offlinePatch(m, ["head"])).toEqual({ _offline_note: "needs a kernel" });
      expect(parse.mock.calls.length).toBe(once); // the same value: not parsed again
      const next = saved();
      next.rules = next.rules.replace('"1,2"', '"1,0"');
      m.update({ _offline: next });
      expect(offlinePatch(m, ["head"]).table.head).toBe(2); // the new value's answers
      expect(parse.mock.calls.length).toBeGreaterThan(once);
    } finally {
      parse.mockRestore();
    }
  });

  it("reads liveness from the emitter (ipywidgets passes its model) and assumes live when unknown", () => {
    expect(isLive({ comm_live: false })).toBe(false);
    expect(isLive(3, { comm_live: true })).toBe(true);
    expect(isLive(undefined, {})).toBe(true);
  });
});

describe("merged answers", () => {
  it("add entries to a dict trait instead of replacing it", () => {
    const rules = [{ on: ["pair"], base: {}, merge: ["tables"], missing: "m",
                     patches: { '"b"': { tables: { b: { n: 2 } } } } }];
    const m = new HostModel("m", { pair: "b", tables: { a: { n: 1 } }, _offline: { rules: JSON.stringify(rules), kernel: {} } });
    expect(offlinePatch(m, ["pair"]).tables).toEqual({ a: { n: 1 }, b: { n: 2 } });
  });
});
