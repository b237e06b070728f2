import { describe, expect, it } from "vitest";
import { rankDescending, termsAtPosition, pairKey, samePair, searchVocab } from "../src/lib/paths.js";

describe("rankDescending", () => {
  it("orders indices by value, NaN last, ties by index", () => {
    expect(rankDescending([1, NaN, 3, 3, -2])).toEqual([2, 3, 0, 4, 1]);
    expect(rankDescending(new Float32Array([0.5, 2, 1]), 2)).toEqual([1, 2]);
  });
});

describe("termsAtPosition", () => {
  // 3 terms x 2 positions, row-major
  const c = new Float32Array([1, -1, 5, 0.5, -2, 2]);
  it("splits one position's column into raising and lowering terms, strongest first", () => {
    expect(termsAtPosition(c, 3, 2, 0)).toEqual({ raise: [{ term: 1, value: 5 }, { term: 0, value: 1 }], lower: [{ term: 2, value: -2 }] });
    expect(termsAtPosition(c, 3, 2, 1).raise.map((r) => r.term)).toEqual([2, 1]);
  });
  it("is empty for a position without a next token", () => {
    expect(termsAtPosition(c, 3, 2, 2)).toEqual({ raise: [], lower: [] });
    expect(termsAtPosition(c, 3, 2, -1)).toEqual({ raise: [], lower: [] });
  });
});

describe("pairs and search", () => {
  it("keys and compares pairs", () => {
    expect(pairKey([0, 4, 1, 6])).toBe("0,4,1,6");
    expect(samePair([0, 4, 1, 6], [0, 4, 1, 6])).toBe(true);
    expect(samePair([0, 4, 1, 6], [0, 4, 1, 5])).toBe(false);
    expect(samePair([], [0, 4, 1, 6])).toBe(false);
  });
  it("finds exact matches first, then substrings", () => {
    const vocab = ["·the", "the", "other", "x"];
    expect(searchVocab(vocab, "the")).toEqual([1, 0, 2]);
    expect(searchVocab(vocab, "")).toEqual([]);
    expect(searchVocab(vocab, "the", 1)).toEqual([1]);
  });
});
