import { afterEach, describe, expect, it, vi } from "vitest";
import { cleanup, fireEvent, render } from "@testing-library/svelte";
import Busy from "../src/components/Busy.svelte";
import OnDemand from "../src/components/OnDemand.svelte";
import { timeLeft } from "../src/lib/progress.js";

const progress = { text: "precomputing heads", done: 37, total: 144 };

afterEach(cleanup);

describe("Busy", () => {
  it("shows how far a long kernel job is while the kernel is attached", () => {
    const { getByTestId } = render(Busy, { props: { busy: false, progress, model: { comm_live: true } } });
    const line = getByTestId("progress");
    expect(line.textContent).toContain("precomputing heads 37/144");
    expect(line.querySelector("progress").getAttribute("value")).toBe("37");
  });

  it("never shows a stale count on a page without a kernel, nor an empty one", () => {
    for (const props of [{ progress, model: { comm_live: false } }, { progress: {}, model: { comm_live: true } }]) {
      const { queryByTestId, unmount } = render(Busy, { props });
      expect(queryByTestId("progress")).toBeNull();
      unmount();
    }
  });

  it("keeps the spinner and its text while busy", () => {
    const { getByTestId } = render(Busy, { props: { busy: true, text: "recomputing…" } });
    expect(getByTestId("busy").textContent).toContain("recomputing…");
  });
});

describe("a long job's count, estimate and cancel", () => {
  const counted = { text: "induction: K-composition eigenvalues", done: 12, total: 270, unit: "layer pairs", left_s: 40.2 };

  it("shows the count, the unit and the time left at the measured rate", () => {
    const { getByTestId } = render(Busy, { props: { busy: true, progress: counted, model: { comm_live: true } } });
    expect(getByTestId("progress").textContent).toContain("induction: K-composition eigenvalues 12/270 layer pairs, ~40 s left");
  });

  it("gives no estimate before the first piece, and minutes past 90 s", () => {
    expect(timeLeft({ ...counted, done: 0, left_s: null })).toBe("");
    expect(timeLeft({ ...counted, left_s: 600 })).toBe(", ~10 min left");
  });

  it("a page saved while the view computed says it is not computed (never with a kernel)", () => {
    const saved = { state: "not computed", text: "Not computed: InductionMechanism was still computing pairs" };
    const page = render(Busy, { props: { progress: saved, model: { comm_live: false } } });
    expect(page.getByTestId("not-computed").textContent).toContain("Not computed");
    page.unmount();
    const live = render(Busy, { props: { progress: saved, model: { comm_live: true } } });
    expect(live.queryByTestId("not-computed")).toBeNull();
  });

  it("OnDemand: a running job offers cancel, which asks the kernel to stop", async () => {
    const oncancel = vi.fn();
    const { getByTestId } = render(OnDemand, {
      props: { active: true, busy: true, ready: false, what: "induction mechanism", progress: counted, model: { comm_live: true }, oncancel },
    });
    expect(getByTestId("running").textContent).toContain("12/270 layer pairs, ~40 s left");
    await fireEvent.click(getByTestId("cancel"));
    expect(oncancel).toHaveBeenCalledOnce();
  });

  it("OnDemand: cancelled says so with the count reached and offers restart", async () => {
    const onstart = vi.fn();
    const cancelled = { text: counted.text, done: 12, total: 270, unit: "layer pairs", state: "cancelled" };
    const { getByTestId, queryByTestId } = render(OnDemand, {
      props: { active: false, busy: false, ready: false, what: "induction mechanism", progress: cancelled, model: { comm_live: true }, onstart },
    });
    expect(getByTestId("cancelled").textContent).toContain("cancelled at 12/270 layer pairs");
    expect(queryByTestId("compute")).toBeNull();
    await fireEvent.click(getByTestId("restart"));
    expect(onstart).toHaveBeenCalledOnce();
  });

  it("OnDemand: a saved page of a section still computing shows 'not computed', no spinner", () => {
    const saved = { state: "not computed", text: "Not computed: still computing when this page was saved" };
    const { getByTestId, queryByTestId } = render(OnDemand, {
      props: { active: true, busy: false, ready: false, what: "induction mechanism", progress: saved, model: { comm_live: false } },
    });
    expect(getByTestId("not-computed").textContent).toContain("Not computed");
    expect(queryByTestId("busy")).toBeNull();
  });
});
