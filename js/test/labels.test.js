// Labels, model names and headings (text from the user or a checkpoint) show with the same
// escapes as token strings (lib/tokens.js visibleWhitespace): a bidi override, a control or a
// lone surrogate shows as its escape and reorders nothing; markup stays text (issue 38).
import { afterEach, describe, expect, it } from "vitest";
import { cleanup, render } from "@testing-library/svelte";
import Legend from "../src/components/Legend.svelte";
import { colorScale } from "../src/lib/color.js";
import { visibleLabel } from "../src/lib/tokens.js";

afterEach(cleanup);

const HOSTILE = "\u202eloss <script>window.__pwned = 1</script> lo\ud800ne";
const SHOWN = "\\u202eloss <script>window.__pwned = 1</script> lo\\ud800ne";

describe("visibleLabel", () => {
  const cases = {
    [HOSTILE]: SHOWN,
    "per-token loss": "per-token loss", // the space is a label's, not a token's "·"
    "a\u200bb\u2066c\u2069": "a\\u200bb\\u2066c\\u2069",
    "two\nlines\tand\x00": "two\\u000alines\\u0009and\\u0000",
    "\u00a0\u3164\ufffd\u{e0041}": "\\u00a0\\u3164\\ufffd\\U000e0041",
    "日本語 naïve 🙂": "日本語 naïve 🙂",
  };
  for (const [label, shown] of Object.entries(cases)) {
    it(`shows ${JSON.stringify(label)} as ${shown}`, () => {
      expect(visibleLabel(label)).toBe(shown);
      expect(visibleLabel(shown)).toBe(shown); // the shown text is plain: nothing left to escape
    });
  }
  it("shows nothing for a missing label", () => {
    expect(visibleLabel(undefined)).toBe("");
  });
});

describe("Legend", () => {
  it("renders a hostile label inert and visible", () => {
    const scale = colorScale(new Float32Array([0, 1]), { mode: "sequential" });
    const { getByTestId, container } = render(Legend, { props: { scale, label: HOSTILE } });
    expect(getByTestId("legend-label").textContent).toBe(SHOWN);
    expect(container.querySelector("script")).toBeNull();
  });
});
