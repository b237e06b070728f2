// The packed bundle's CSS (lib/styles.js): added where views are shown, once per document or
// shadow root, and not at all where the host adds anywidget's `_css` itself.
import { afterEach, describe, expect, it } from "vitest";
import { applyStyles, STYLE_MARK, useStyles } from "../src/lib/styles.js";

const CSS = ".pcw-view .token { border-radius: 2px; }";
const marked = (root) => [...root.querySelectorAll(`style[${STYLE_MARK}]`)];

/** A view's element attached under `parent`. */
function viewIn(parent) {
  const el = document.createElement("div");
  parent.append(el);
  return el;
}

afterEach(() => {
  useStyles(null);
  document.head.replaceChildren();
  document.body.replaceChildren();
});

describe("the bundle's CSS", () => {
  it("is added nowhere when no loader handed it over (marimo, development mode: the host adds `_css`)", () => {
    applyStyles(viewIn(document.body));
    expect(marked(document)).toEqual([]);
  });

  it("is added to the document's head once, however many views mount", () => {
    useStyles(CSS);
    for (let i = 0; i < 5; i++) applyStyles(viewIn(document.body));
    applyStyles(document.createElement("div")); // not attached yet (JupyterLab renders first): the head too
    const styles = marked(document);
    expect(styles.length).toBe(1);
    expect(styles[0].parentNode).toBe(document.head);
    expect(styles[0].textContent).toBe(CSS);
  });

  it("is added inside each shadow root a view is shown in, once per root", () => {
    useStyles(CSS);
    const roots = [0, 1].map(() => viewIn(document.body).attachShadow({ mode: "open" }));
    for (const root of roots) {
      applyStyles(viewIn(root));
      applyStyles(viewIn(viewIn(root))); // deeper in the same root
    }
    for (const root of roots) {
      const styles = [...root.children].filter((c) => c.localName === "style");
      expect(styles.length).toBe(1);
      expect(styles[0].textContent).toBe(CSS);
    }
    expect(marked(document)).toEqual([]); // the document's head does not reach into a shadow root
  });

  it("of another build is added beside the first", () => {
    useStyles(CSS);
    applyStyles(viewIn(document.body));
    useStyles(`${CSS} .other { color: red; }`);
    applyStyles(viewIn(document.body));
    expect(marked(document).length).toBe(2);
  });
});
