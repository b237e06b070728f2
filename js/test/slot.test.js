// Development mode's hand-over between bundles (lib/slot.js), run through the stub the
// kernel sends (bundle.py `_STUB`, read from the Python source so the two cannot drift).
import { readFileSync } from "node:fs";
import { resolve } from "node:path";
import { describe, expect, it } from "vitest";
import { DEV_KEY, mountTracked, publish } from "../src/lib/slot.js";

const source = readFileSync(resolve(__dirname, "../../pycircuits_widgets/widgets/core/bundle.py"), "utf8");
const STUB = source.match(/_STUB = """([\s\S]*?)"""/)[1];

/** The stub module for `key`, as anywidget imports a view's `_esm`. */
async function stub(key) {
  const code = STUB.replace("%(key)s", key);
  return (await import(`data:text/javascript,${encodeURIComponent(code)}`)).default;
}

/** A bundle stand-in: mounts write its name into `el`, and it records each cleanup. */
function bundle(name, key) {
  const log = [];
  const mount = (ctx) => {
    const node = document.createElement("span");
    node.textContent = `${name}:${ctx.model.state}`;
    ctx.el.append(node);
    log.push(`mount ${ctx.model.state}`);
    return () => {
      node.remove();
      log.push(`cleanup ${ctx.model.state}`);
    };
  };
  const definition = { render: (ctx) => mountTracked(key, ctx, mount) };
  return { definition, mount, log };
}

function view(state) {
  return { model: { state }, el: document.createElement("div") };
}

describe("bundle slot", () => {
  it("re-mounts the views shown under the dev key with each newer bundle, keeping their model", async () => {
    const render = (await stub(DEV_KEY)).render;
    const a = bundle("A", DEV_KEY);
    const one = view("one");
    const shown = render(one); // waits for a bundle
    publish(DEV_KEY, a.definition, a.mount);
    const cleanup = await shown;
    expect(one.el.textContent).toBe("A:one");

    const b = bundle("B", DEV_KEY);
    publish(DEV_KEY, b.definition, b.mount);
    expect(one.el.textContent).toBe("B:one"); // the new code, the same model
    expect(a.log).toEqual(["mount one", "cleanup one"]);

    const two = view("two");
    await render(two); // a view shown later gets the newest bundle
    expect(two.el.textContent).toBe("B:two");

    cleanup(); // anywidget's cleanup of the first render reaches the latest mount
    expect(one.el.textContent).toBe("");
    expect(b.log).toEqual(["mount one", "mount two", "cleanup one"]);
    const c = bundle("C", DEV_KEY);
    publish(DEV_KEY, c.definition, c.mount);
    expect(c.log).toEqual(["mount two"]); // the removed view is not brought back
    expect(two.el.textContent).toBe("C:two");
  });

  it("keeps the first bundle of a hash key: a second carrier of the same build re-mounts nothing", async () => {
    const key = "0123456789abcdef";
    const render = (await stub(key)).render;
    const a = bundle("A", key);
    publish(key, a.definition, a.mount);
    const one = view("one");
    await render(one);
    const b = bundle("B", key);
    publish(key, b.definition, b.mount);
    await render(view("two"));
    expect(one.el.textContent).toBe("A:one");
    expect(a.log).toEqual(["mount one", "mount two"]);
    expect(b.log).toEqual([]);
  });
});

describe("bundle slot, a broken edit", () => {
  it("shows the error in the view that failed and still re-mounts the others", async () => {
    const render = (await stub(DEV_KEY)).render;
    const a = bundle("A", DEV_KEY);
    publish(DEV_KEY, a.definition, a.mount);
    const [one, two] = [view("one"), view("two")];
    await render(one);
    await render(two);
    const broken = (ctx) => {
      if (ctx.model.state === "one") throw new Error("boom");
      return a.mount(ctx);
    };
    const errors = [];
    const consoleError = console.error;
    console.error = (e) => errors.push(String(e));
    try {
      publish(DEV_KEY, { render: (ctx) => mountTracked(DEV_KEY, ctx, broken) }, broken);
    } finally {
      console.error = consoleError;
    }
    expect(one.el.textContent).toContain("failed to mount: Error: boom");
    expect(two.el.textContent).toBe("A:two");
    expect(errors).toEqual(["Error: boom"]);
    const fixed = bundle("F", DEV_KEY);
    publish(DEV_KEY, fixed.definition, fixed.mount); // the failed view comes back, nothing cleaned twice
    expect([one.el.textContent, two.el.textContent]).toEqual(["F:one", "F:two"]);
    expect(a.log.filter((entry) => entry === "cleanup one")).toHaveLength(1);
  });
});
