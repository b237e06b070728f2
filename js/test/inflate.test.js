// A saved page's deflated payloads never inflate past their bound (issue 27: a 1 MB page
// inflated to 1 GiB and froze Chromium).
import { deflateRawSync } from "node:zlib";
import { describe, expect, it } from "vitest";
import { decodeArray, decodeText, MAX_INFLATED } from "../src/lib/buffers.js";
import { answerOffline, offlinePatch } from "../src/lib/offline.js";

/** A Node Buffer's bytes as a DataView of their own (a Buffer may share a pooled ArrayBuffer). */
const own = (buf) => new DataView(Uint8Array.from(buf).buffer);
/** Raw deflate of `mib` MiB of spaces. */
const bomb = (mib) => own(deflateRawSync(Buffer.alloc(mib << 20, 32), { level: 9 }));

describe("deflated payloads are bounded before they are inflated", () => {
  const huge = bomb(96); // inflates to 96 MiB, over MAX_INFLATED
  it("refuses a payload whose declared size is over the limit, before inflating", () => {
    expect(MAX_INFLATED).toBe(64 << 20);
    expect(() => decodeArray({ view: huge, dtype: "uint8", shape: [96 << 20], encoding: "deflate" })).toThrow(
      /would inflate to 100663296 bytes, over the limit of 67108864 bytes; not inflated/,
    );
    expect(() => decodeArray({ view: huge, dtype: "float32", shape: [1 << 15, 1 << 15], encoding: "deflate" })).toThrow(
      /over the limit/,
    );
  });
  it("stops a payload that inflates past what its shape declares", () => {
    expect(() => decodeText({ view: huge, dtype: "uint8", shape: [100], encoding: "deflate" })).toThrow(
      /inflates past the 100 bytes its shape declares/,
    );
    const short = own(deflateRawSync(Buffer.from("[1,2]")));
    expect(() => decodeText({ view: short, dtype: "uint8", shape: [9], encoding: "deflate" })).toThrow(
      /inflates to 5 bytes, its shape declares 9/,
    );
  });
  it("refuses shapes that are not sizes", () => {
    for (const shape of [[-1], [1.5], ["3"], null, [2 ** 60]]) {
      expect(() => decodeArray({ view: huge, dtype: "uint8", shape, encoding: "deflate" })).toThrow(/decodeArray/);
    }
  });
  it("inflates an honest payload exactly", () => {
    const data = new Float32Array(50_000).map((_, i) => i / 7);
    const view = own(deflateRawSync(Buffer.from(data.buffer)));
    expect(Array.from(decodeArray({ view, dtype: "float32", shape: [50_000], encoding: "deflate" }).data)).toEqual(
      Array.from(data),
    );
  });
  it("an _offline state whose rules are a bomb gives the view an error, not a frozen page", () => {
    const rules = { view: huge, dtype: "uint8", shape: [64], encoding: "deflate" };
    const state = { layer: 0, error: "", _offline: { rules } };
    const model = {
      comm_live: false,
      get: (n) => state[n],
      set: (n, v) => (state[n] = v),
      on() {},
      off() {},
    };
    expect(offlinePatch(model, ["layer"]).error).toMatch(
      /saved answers for other selections cannot be read \(decodeArray: a deflated payload inflates past/,
    );
    answerOffline(model);
    expect(state.error).toMatch(/cannot be read/);
  });
});
