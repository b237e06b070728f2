// The one anywidget entry point. Every Svelte file in ./views/ is a view, registered by
// its file name; the Python class names the view it wants in its `_view` trait. Adding a
// view is adding one .svelte file here and one small Python class.
import { defineWidget } from "@anywidget/svelte";
import { createHost } from "./lib/host.js";

const modules = import.meta.glob("./views/*.svelte", { eager: true });

/** view name -> anywidget definition factory (props: `model`, `bindings`) */
export const views = Object.fromEntries(
  Object.entries(modules).map(([path, mod]) => [
    path.slice("./views/".length, -".svelte".length),
    defineWidget(mod.default),
  ]),
);

function viewFor(model) {
  const name = model.get("_view");
  const factory = views[name];
  if (!factory) {
    throw new Error(
      `pycircuits_widgets: unknown view "${name}"; this bundle has: ${Object.keys(views).join(", ")}`,
    );
  }
  return factory();
}

export default {
  // anywidget may share one definition object between models, so each render builds its
  // own per-model bindings instead of keeping them in a closure set by initialize().
  render({ model, el }) {
    const widget = viewFor(model);
    widget.initialize({ model });
    return widget.render({ model, el });
  },
};

// Kernel-less host (standalone HTML export and the browser test harness).
export { createHost };
