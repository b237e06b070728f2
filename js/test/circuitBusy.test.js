import { afterEach, describe, expect, it } from "vitest";
import { cleanup, render } from "@testing-library/svelte";
import CircuitBusy from "../src/components/CircuitBusy.svelte";

const progress = { text: "precomputing heads", done: 37, total: 144 };

afterEach(cleanup);

describe("CircuitBusy", () => {
  it("shows how far a long kernel job is while the kernel is attached", () => {
    const { getByTestId } = render(CircuitBusy, { props: { busy: false, progress, model: { comm_live: true } } });
    const line = getByTestId("progress");
    expect(line.textContent).toContain("precomputing heads 37/144");
    expect(line.querySelector("progress").getAttribute("value")).toBe("37");
  });

  it("never shows a stale count on a page without a kernel, nor an empty one", () => {
    for (const props of [{ progress, model: { comm_live: false } }, { progress: {}, model: { comm_live: true } }]) {
      const { queryByTestId, unmount } = render(CircuitBusy, { props });
      expect(queryByTestId("progress")).toBeNull();
      unmount();
    }
  });

  it("keeps the spinner and its text while busy", () => {
    const { getByTestId } = render(CircuitBusy, { props: { busy: true, text: "recomputing…" } });
    expect(getByTestId("busy").textContent).toContain("recomputing…");
  });
});
