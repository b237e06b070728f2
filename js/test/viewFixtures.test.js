// Every view of the registry mounted from its saved state (fixtures/views/NAME.json, written by
// `python scripts/gallery.py --save-views`: what a saved page holds for the view) through the
// kernel-less host, as a saved page mounts it: the payloads the Python side sends render
// without computing a model. happy-dom draws no canvas, so a canvas's 2D context here takes
// every call and draws nothing (the browser tests check the pixels).
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { flushSync } from "svelte";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import definition, { createHost, parseTagged } from "../src/index.js";

const FIXTURES = join(import.meta.dirname, "fixtures/views");
const names = readdirSync(FIXTURES).filter((f) => f.endsWith(".json")).map((f) => f.slice(0, -".json".length));

/** A 2D context that accepts every call and property and draws nothing. */
function blankContext(canvas) {
  const ctx = { canvas, createPattern: () => ({}), getImageData: () => ({ data: new Uint8ClampedArray(4) }) };
  return new Proxy(ctx, { get: (target, key) => (key in target ? target[key] : () => {}) });
}

const original = {};
beforeAll(() => {
  const canvas = globalThis.HTMLCanvasElement.prototype;
  original.getContext = canvas.getContext;
  original.toDataURL = canvas.toDataURL;
  canvas.getContext = function () {
    return blankContext(this);
  };
  canvas.toDataURL = () => "data:image/png;base64,";
  original.ImageData = globalThis.ImageData;
  globalThis.ImageData ??= class ImageData {
    constructor(data, width, height) {
      Object.assign(this, { data, width, height });
    }
  };
});
afterAll(() => {
  Object.assign(globalThis.HTMLCanvasElement.prototype, { getContext: original.getContext, toDataURL: original.toDataURL });
  globalThis.ImageData = original.ImageData;
  document.body.replaceChildren();
});

describe("views from their saved states", () => {
  it("finds the saved views (scripts/gallery.py --save-views; tests/test_gallery_fixtures.py: one per view)", () => {
    expect(names.length).toBeGreaterThanOrEqual(12);
  });

  it.each(names)("%s mounts without an error and shows its data", async (name) => {
    const { widgets } = parseTagged(readFileSync(join(FIXTURES, `${name}.json`), "utf8"));
    const host = createHost(definition);
    for (const saved of widgets) host.register(saved);
    const el = document.createElement("div");
    document.body.append(el);
    const model = host.mount(el, widgets[0]);
    flushSync();
    await new Promise((resolve) => setTimeout(resolve, 0)); // a child view resolves asynchronously
    flushSync();
    const root = el.querySelector(".pcw-view");
    expect(root, name).not.toBeNull();
    expect([...el.querySelectorAll("[role=alert]")].map((e) => e.textContent), name).toEqual([]);
    expect(model.get("error") ?? "", name).toBe("");
    // something of the saved payload is on the page: a table row, a token, a plotted head, a thumbnail
    expect(el.querySelectorAll("tr, .token, .pcw-tok, circle, img, canvas, rect").length, name).toBeGreaterThan(0);
  });
});
