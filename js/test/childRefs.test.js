// Child widget references as the explorer's ChildView passes them to the kernel-less host.
import { describe, expect, it } from "vitest";
import { createHost } from "../src/lib/host.js";

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
