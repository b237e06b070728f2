// Child widget references as the explorer's ChildView passes them to the kernel-less host.
import { describe, expect, it } from "vitest";
import { createHost, resolveModel } from "../src/lib/host.js";

describe("kernel-less host getModel", () => {
  const host = createHost({ render() {} });
  const child = host.register({ model_id: "abc", state: { x: 1 }, buffer_paths: [], buffers: [] });

  it("resolves anywidget:, IPY_MODEL_ and bare references to the same model", async () => {
    for (const ref of ["anywidget:abc", "IPY_MODEL_abc", "abc"]) expect(await host.getModel(ref)).toBe(child);
  });

  it("names the missing widget", async () => {
    await expect(host.getModel("anywidget:nope")).rejects.toThrow("no saved state for widget nope");
  });
});

describe("resolveModel", () => {
  it("waits for a child model registered after its parent renders", async () => {
    let calls = 0;
    const late = { getModel: async () => { if (++calls < 3) throw new Error("widget model not found"); return "child"; } };
    expect(await resolveModel(late, "anywidget:x", { delay: 1 })).toBe("child");
    expect(calls).toBe(3);
  });
  it("gives up after its tries with the host's error", async () => {
    const never = { getModel: async () => { throw new Error("widget model not found"); } };
    await expect(resolveModel(never, "anywidget:x", { tries: 3, delay: 1 })).rejects.toThrow("widget model not found");
  });
});
