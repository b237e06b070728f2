import { deflateRawSync } from "node:zlib";
import { describe, expect, it } from "vitest";
import { decodeArray, decodeBase64, decodeText } from "../src/lib/buffers.js";
import { colorScale, luminance, textOn } from "../src/lib/color.js";
import { endsLine, formatValue, visibleWhitespace } from "../src/lib/tokens.js";
import { HostModel, restoreBuffers } from "../src/lib/host.js";

describe("decodeArray", () => {
  it("views an aligned buffer without copying and honours byteOffset", () => {
    const f = new Float32Array([9, 1.5, -2, 3]);
    const view = new DataView(f.buffer, 4, 12);
    const { data, shape } = decodeArray({ view, dtype: "float32", shape: [3] });
    expect(Array.from(data)).toEqual([1.5, -2, 3]);
    expect(data.buffer).toBe(f.buffer);
    expect(shape).toEqual([3]);
  });
  it("copies a misaligned buffer", () => {
    const bytes = new Uint8Array(9);
    new DataView(bytes.buffer).setFloat32(1, 2.5, true);
    new DataView(bytes.buffer).setFloat32(5, -1, true);
    const { data } = decodeArray({ view: new DataView(bytes.buffer, 1, 8), dtype: "float32", shape: [2] });
    expect(Array.from(data)).toEqual([2.5, -1]);
  });
  it("rejects a size that does not match the shape, and unknown dtypes", () => {
    const view = new DataView(new ArrayBuffer(8));
    expect(() => decodeArray({ view, dtype: "float32", shape: [3] })).toThrow(/2 float32 values for shape \[3\]/);
    expect(() => decodeArray({ view, dtype: "complex64", shape: [1] })).toThrow(/unsupported dtype/);
  });
  it("inflates a deflate-encoded payload (raw deflate by node's zlib, as Python's zlib writes it)", () => {
    const values = Uint16Array.from({ length: 3000 }, (_, i) => (i * 7) % 1024);
    const packed = deflateRawSync(new Uint8Array(values.buffer));
    expect(packed.length).toBeLessThan(values.byteLength / 2);
    const view = new DataView(packed.buffer, packed.byteOffset, packed.length);
    const { data, shape } = decodeArray({ view, dtype: "uint16", shape: [3, 1000], encoding: "deflate" });
    expect(shape).toEqual([3, 1000]);
    expect(Array.from(data)).toEqual(Array.from(values));
    // float16 goes through the same inflation (0x3c00 = 1.0, 0xc000 = -2.0)
    const half = deflateRawSync(new Uint8Array(Uint16Array.of(0x3c00, 0xc000).buffer));
    expect(Array.from(decodeArray({ view: new DataView(half.buffer, half.byteOffset, half.length), dtype: "float16", shape: [2], encoding: "deflate" }).data)).toEqual([1, -2]);
    expect(() => decodeArray({ view, dtype: "uint16", shape: [3000], encoding: "gzip" })).toThrow(/unsupported encoding "gzip"/);
  });
  it("reads the UTF-8 text of a deflated uint8 payload (JSON with non-ASCII token strings)", () => {
    const bytes = new TextEncoder().encode(JSON.stringify(["·def", "↵··", "\u0000", "é"]));
    const packed = deflateRawSync(bytes);
    const view = new DataView(packed.buffer, packed.byteOffset, packed.length);
    expect(JSON.parse(decodeText({ view, dtype: "uint8", shape: [bytes.length], encoding: "deflate" }))).toEqual(["·def", "↵··", "\u0000", "é"]);
  });
  it("decodes base64", () => {
    expect(Array.from(new Uint8Array(decodeBase64("AQID").buffer))).toEqual([1, 2, 3]);
  });
});

describe("colorScale", () => {
  it("sequential scale gets darker with value", () => {
    const s = colorScale([0, 10]);
    expect(s.mode).toBe("sequential");
    const lum = [0, 2.5, 5, 7.5, 10].map((v) => luminance(s.rgb(v)));
    for (let i = 1; i < lum.length; i++) expect(lum[i]).toBeLessThan(lum[i - 1]);
  });
  it("auto picks a diverging scale centred on zero for mixed signs", () => {
    const s = colorScale([-1, 4]);
    expect(s.mode).toBe("diverging");
    expect(s.domain).toEqual([-4, 4]);
    const [r, g, b] = s.rgb(0);
    expect(Math.abs(r - b)).toBeLessThan(3);
    expect(s.rgb(4)[0]).toBeGreaterThan(s.rgb(4)[2]);
    expect(s.rgb(-4)[2]).toBeGreaterThan(s.rgb(-4)[0]);
  });
  it("honours vmin/vmax and clamps outside values", () => {
    const s = colorScale([0, 100], { vmin: 0, vmax: 1 });
    expect(s.rgb(100)).toEqual(s.rgb(1));
  });
  it("picks readable text colour", () => {
    expect(textOn([255, 255, 255])).toBe("#111");
    expect(textOn([8, 48, 107])).toBe("#fff");
  });
});

describe("tokens", () => {
  it("makes whitespace visible and is idempotent", () => {
    expect(visibleWhitespace(" a\tb\n")).toBe("·a→b↵");
    expect(visibleWhitespace(visibleWhitespace(" a\n"))).toBe("·a↵");
    expect(endsLine("x\n")).toBe(true);
    expect(endsLine("x↵")).toBe(true);
    expect(endsLine("x")).toBe(false);
  });
  it("formats numbers compactly", () => {
    expect(formatValue(3.14159)).toBe("3.142");
    expect(formatValue(0)).toBe("0");
    expect(formatValue(1e-5)).toBe("1.000e-5");
    expect(formatValue(NaN)).toBe("—");
  });
});

describe("HostModel", () => {
  it("emits change events as (model, value), batches dirty changes for save_changes, and applies kernel updates", () => {
    const saved = [];
    const m = new HostModel("m1", { a: 1 }, { onSave: (id, c) => saved.push([id, c]) });
    const seen = [];
    m.on("change:a", (model, v) => seen.push([model === m, v]));
    m.set("a", 2);
    m.save_changes();
    m.save_changes();
    m.update({ a: 5 });
    expect(seen).toEqual([[true, 2], [true, 5]]); // (model, value), as ipywidgets emits
    expect(saved).toEqual([["m1", { a: 2 }]]);
  });
  it("restores buffers at their paths", () => {
    const dv = new DataView(new ArrayBuffer(4));
    const state = restoreBuffers({ values: { dtype: "float32", shape: [1] } }, [["values", "view"]], [dv]);
    expect(state.values.view).toBe(dv);
  });
});
