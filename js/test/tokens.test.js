// Tokens show every character: bidi controls, zero-width characters and lone surrogates as
// escapes, as Python's models.tokenizer.escape_invisible does (issue 27).
import { describe, expect, it } from "vitest";
import { visibleWhitespace } from "../src/lib/tokens.js";

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
