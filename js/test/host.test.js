// A saved page's buffer paths are data from whoever wrote the notebook (issue 27): they never
// reach a prototype.
import { afterEach, describe, expect, it } from "vitest";
import { MAX_BUFFER_PATH, restoreBuffers } from "../src/lib/host.js";

const dv = () => new DataView(new ArrayBuffer(4));

describe("restoreBuffers refuses paths that leave the state's own data", () => {
  afterEach(() => {
    delete Object.prototype.polluted;
    delete Object.prototype.encoding;
  });
  for (const path of [
    ["__proto__", "polluted"],
    ["__proto__", "encoding"],
    ["constructor", "prototype", "polluted"],
    ["a", "__proto__", "polluted"],
    ["toString", "polluted"], // inherited, not the state's own
    [],
    Array(MAX_BUFFER_PATH + 1).fill("a"),
    [{}, "x"],
    [-1],
    "values",
  ]) {
    it(`refuses ${JSON.stringify(path).slice(0, 60)}`, () => {
      expect(() => restoreBuffers({ a: {} }, [path], [dv()])).toThrow(/pycircuits_widgets: saved buffer path/);
      expect({}.polluted).toBeUndefined();
      expect({}.encoding).toBeUndefined();
    });
  }
  it("refuses more buffers than paths, and a path through a number", () => {
    expect(() => restoreBuffers({}, [["a"]], [dv(), dv()])).toThrow(/1 buffer paths for 2 buffers/);
    expect(() => restoreBuffers({ a: 5 }, [["a", "view"]], [dv()])).toThrow(/leads nowhere/);
  });
  it("still restores ipywidgets' paths (keys and list indices)", () => {
    const a = dv();
    const b = dv();
    const state = restoreBuffers({ t: { src: {} }, l: [{}, {}] }, [["t", "src", "view"], ["l", 1, "view"]], [a, b]);
    expect(state.t.src.view).toBe(a);
    expect(state.l[1].view).toBe(b);
  });
});
