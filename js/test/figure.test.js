// The pure parts of a view's figure (lib/figure.js); the figure itself is checked in real
// Chromium (tests/browser/test_figures_browser.py).
import { describe, expect, it } from "vitest";
import {
  figureFileName, figureSvg, registerFigure, selectionCaption, svgDocument, viewTitle, withDpi,
} from "../src/lib/figure.js";

/** A PNG's chunks: [type, data length] in order, each CRC checked. */
function chunks(png) {
  const view = new DataView(png.buffer, png.byteOffset, png.byteLength);
  const out = [];
  for (let at = 8; at < png.length; ) {
    const length = view.getUint32(at);
    const type = String.fromCharCode(...png.subarray(at + 4, at + 8));
    out.push([type, length]);
    at += 12 + length;
  }
  return out;
}

// The smallest PNG: one white pixel, written by Python's zlib and struct.
const ONE_PIXEL = Uint8Array.from(
  atob("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC"),
  (c) => c.charCodeAt(0),
);

describe("a figure's title and selection", () => {
  it("names a view shown on its own by its view's name, in words", () => {
    expect(viewTitle("EigenvaluePlot")).toBe("Eigenvalue plot");
    expect(viewTitle("SkipTrigramTable")).toBe("Skip trigram table");
    expect(viewTitle("PositionalQK")).toBe("Positional QK");
    expect(viewTitle(undefined)).toBe("");
  });

  it("states the selection the view's traits hold, and nothing for what it lacks", () => {
    const traits = { layer: 1, head: 6, selected_pair: [0, 3, 1, 2], position: 4, neuron: -1 };
    expect(selectionCaption((k) => traits[k])).toBe("head L1.H6 · pair L0.H3 → L1.H2 · position 4");
    expect(selectionCaption(() => undefined)).toBe("");
    expect(selectionCaption((k) => ({ layer: 0, neuron: 5 })[k])).toBe("neuron 5");
  });

  it("names its file after its title", () => {
    expect(figureFileName("Skip-trigrams of the selected head", "svg")).toBe("skip-trigrams-of-the-selected-head.svg");
    expect(figureFileName("", "png")).toBe("figure.png");
  });
});

describe("a figure's PNG", () => {
  it("says its dpi in a pHYs chunk right after its header, with a correct CRC", () => {
    const png = withDpi(ONE_PIXEL, 288);
    expect(chunks(png).map(([type]) => type)).toEqual(["IHDR", "pHYs", "IDAT", "IEND"]);
    const at = 8 + 25; // after the signature and IHDR
    const view = new DataView(png.buffer);
    expect(Math.round(view.getUint32(at + 8) * 0.0254)).toBe(288);
    expect(png[at + 16]).toBe(1); // per metre
    // the CRC of "pHYs" + its data (x = y = 11339 px/m, unit 1), as Python's zlib.crc32 gives it
    expect(view.getUint32(at + 17)).toBe(0xa53d96a9);
  });
});

describe("a figure's SVG", () => {
  it("holds the view's title, selection and labels, and none of its chrome", () => {
    const mount = document.createElement("div");
    document.body.append(mount);
    mount.innerHTML = `<div class="pcw-view"><div data-chrome><button>⤓ figure</button></div>
      <span class="legend-label">loss (nats)</span><p class="pcw-note hint" data-chrome>click a token</p><p class="pcw-note hint">loss of each token</p>
      <textarea>a text</textarea><span class="pcw-busy">recomputing…</span></div>`;
    registerFigure(mount, { model: { get: (k) => ({ _view: "ColoredTokens", position: 4 })[k] }, title: "Per-token loss" });
    const { svg } = figureSvg(mount.firstElementChild);
    const doc = new DOMParser().parseFromString(svg, "image/svg+xml");
    const text = doc.documentElement.textContent;
    expect(doc.documentElement.localName).toBe("svg");
    expect(doc.querySelector("title").textContent).toBe("Per-token loss: position 4");
    expect(text).toContain("loss (nats)");
    expect(text).toContain("loss of each token"); // an explanation, kept
    for (const chrome of ["⤓ figure", "click a token", "a text", "recomputing"]) expect(text).not.toContain(chrome);
    mount.remove();
  });

  it("carries a picture for tools that draw no HTML, which browsers pass over", () => {
    const svg = svgDocument({ body: "<div xmlns='http://www.w3.org/1999/xhtml'>L1.H6</div>", width: 10, height: 5,
                              label: "a < b" }, "data:image/png;base64,AAAA");
    const doc = new DOMParser().parseFromString(svg, "image/svg+xml");
    const choice = doc.querySelector("switch");
    expect([...choice.children].map((c) => c.localName)).toEqual(["foreignObject", "image"]);
    expect(choice.children[1].getAttribute("href")).toBe("data:image/png;base64,AAAA");
    expect(doc.querySelector("title").textContent).toBe("a < b");
    expect(svgDocument({ body: "", width: 1, height: 1, label: "" })).not.toContain("<switch>");
  });
});
