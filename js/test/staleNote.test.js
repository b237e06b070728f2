// The note over a greyed result (components/StaleNote.svelte), shared by the head and pair
// views: what the selection lacks, why, and whose result is shown.
import { afterEach, describe, expect, it } from "vitest";
import { cleanup, render } from "@testing-library/svelte";
import StaleNote from "../src/components/StaleNote.svelte";

afterEach(cleanup);

/** The note's text as read (its whitespace collapsed), rendered alone. */
function text(props) {
  const { getByTestId, unmount } = render(StaleNote, { props });
  const read = getByTestId("stale-note").textContent.replace(/\s+/g, " ").trim();
  unmount();
  return read;
}

describe("StaleNote", () => {
  it("says the kernel is computing the selection's result, or that it needs one", () => {
    const props = { missing: "table of head L1.H2", shown: "head L0.H0's" };
    expect(text({ ...props, busy: true })).toBe("No table of head L1.H2 yet: the kernel is computing it; greyed below: head L0.H0's, the last one shown.");
    expect(text({ ...props, busy: false })).toBe("No table of head L1.H2 here: it needs a running kernel; greyed below: head L0.H0's, the last one shown.");
  });

  it("speaks of several results in the plural, and of no selection", () => {
    expect(text({ missing: "examples of the selected head L1.H2", shown: "head L0.H0's", plural: true }))
      .toBe("No examples of the selected head L1.H2 here: they need a running kernel; greyed below: head L0.H0's, the last ones shown.");
    expect(text({ missing: null, shown: "Q-composition L0.H0 → L1.H0" })).toBe("Nothing selected; greyed below: Q-composition L0.H0 → L1.H0, the last one shown.");
  });
});
