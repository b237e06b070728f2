// Tokens show every character: bidi controls, zero-width characters and lone surrogates as
// escapes, as Python's models.tokenizer.escape_invisible does (issue 27).
import { describe, expect, it } from "vitest";
import { compactToken, RUN_MIN, visibleWhitespace } from "../src/lib/tokens.js";
// the cases Python's display_bytes is tested on too (tests/test_token_display.py)
import cases from "../../tests/token_display_cases.json";

describe("tokens show every character", () => {
  // the same cases as tests/test_trust.py (Python's escape_invisible, after visible whitespace)
  const cases = {
    "lo\ud800ne": "lo\\ud800ne",
    "\u202e": "\\u202e",
    "a\u200bb": "a\\u200bb",
    "\ufeff": "\\ufeff",
    "\u3164": "\\u3164",
    "x\x00": "x\\u0000",
    "\u{e0041}": "\\U000e0041",
    "\u00a0x\u2028": "\\u00a0x\\u2028",
    "\ufffd": "\\ufffd",
    " a\tb\n": "·a→b↵",
    "日本語 naïve 🙂 <b>": "日本語·naïve·🙂·<b>",
  };
  for (const [token, shown] of Object.entries(cases)) {
    it(`shows ${JSON.stringify(token)} as ${shown}`, () => {
      expect(visibleWhitespace(token)).toBe(shown);
      expect(visibleWhitespace(shown)).toBe(shown);
    });
  }
});

describe("tokens as a view shows them", () => {
  for (const c of [...cases.shipped, ...cases.more]) {
    it(`shows ${c.exact} as ${c.shown}`, () => {
      expect(visibleWhitespace(c.exact)).toBe(c.exact); // the display string is kept exactly
      expect(compactToken(c.exact)).toBe(c.shown);
    });
  }
  it("counts a raw whitespace run from its first glyph, at RUN_MIN and not below", () => {
    expect(compactToken("\n" + " ".repeat(23))).toBe("↵·×23");
    expect(compactToken(" ".repeat(RUN_MIN))).toBe(`·×${RUN_MIN}`);
    expect(compactToken(" ".repeat(RUN_MIN - 1))).toBe("·".repeat(RUN_MIN - 1));
    expect(compactToken("\t\t\t\t\t\t x")).toBe("→×6·x");
  });
});
