// The slot a view's `_esm` stub awaits (pycircuits_widgets/widgets/core/bundle.py `_STUB`): one
// per key (the bundle's hash; "dev" in development mode), on `globalThis` so that every
// module of the page, every bundle loaded into it included, shares it.
//
// Development mode: the kernel's carrier re-sends the bundle on every rebuild and anywidget
// loads it as a new module. Its `publish` makes it the slot's bundle for views shown from
// then on and re-mounts the views already shown (each with its model, so its current
// state), so an edited view appears without a kernel restart.

/** The key the stubs wait under in development mode (bundle.py DEV_KEY). */
export const DEV_KEY = "dev";

/**
 * The slot for `key`: `{promise, resolve}` as the stub makes it (the stub reads `promise` at
 * each render); `mounted` (development mode) holds the views rendered through it.
 * @param {string} key
 */
export function bundleSlot(key) {
  const sym = Symbol.for(`pycircuits_widgets:${key}`);
  return (globalThis[sym] ??= (() => {
    let resolve;
    const promise = new Promise((r) => (resolve = r));
    return { promise, resolve };
  })());
}

/**
 * Make `definition` (a bundle's anywidget definition) the one the stubs waiting under `key`
 * render with. The first bundle of a key serves every view; under DEV_KEY each newer one
 * takes over and re-mounts the views already shown.
 * @param {string} key
 * @param {object} definition  the bundle's anywidget definition
 * @param {(ctx: any) => () => void} mount  the bundle's own mount (re-mounts a view)
 */
export function publish(key, definition, mount) {
  const slot = bundleSlot(key);
  slot.resolve(definition);
  if (key !== DEV_KEY) return;
  slot.promise = Promise.resolve(definition);
  slot.mounted ??= new Set();
  for (const view of [...slot.mounted]) {
    if (!slot.mounted.has(view)) continue; // removed while an earlier view re-mounted
    view.cleanup();
    view.cleanup = () => {};
    view.ctx.el.replaceChildren();
    try {
      view.cleanup = mount(view.ctx);
    } catch (error) {
      // an edit that breaks one view: say so in its place, and re-mount the others
      console.error(error);
      view.ctx.el.textContent = `pycircuits_widgets (development mode): this view failed to mount: ${error}`;
    }
  }
}

/**
 * Render through `mount` and, under DEV_KEY, keep the view in the slot so that a newer
 * bundle can re-mount it. Returns the cleanup (it calls the cleanup of the latest mount).
 * @param {string | null} key  the slot's key, null when the view came through no stub
 * @param {any} ctx  anywidget's render context ({model, el, ...})
 * @param {(ctx: any) => () => void} mount
 */
export function mountTracked(key, ctx, mount) {
  if (key !== DEV_KEY) return mount(ctx);
  const slot = bundleSlot(key);
  const view = { ctx, cleanup: mount(ctx) };
  (slot.mounted ??= new Set()).add(view);
  return () => {
    slot.mounted.delete(view);
    view.cleanup();
  };
}
