// The one anywidget entry point. Every Svelte file in ./views/ is a view, registered by
// its file name; the Python class names the view it wants in its `_view` trait. Adding a
// view is adding one .svelte file here and one small Python class. (A large view's parts
// live in a folder beside it, e.g. ./views/attention/, and are not registered.)
import { defineWidget } from "@anywidget/svelte";
import { createHost } from "./lib/host.js";
import { figure, registerFigure } from "./lib/figure.js";
import { answerOffline, parseTagged } from "./lib/offline.js";
import { SELECTION_KEYS } from "./lib/selection.js";
import { mountTracked, publish } from "./lib/slot.js";
import { applyStyles, useStyles } from "./lib/styles.js";

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

/**
 * Mount the view named by the model's `_view` trait into `el`; returns the cleanup.
 * Composite views (the explorer) use it to show child widgets resolved through `host`, and
 * pass `select(change)`: the child's own writes of selection traits (a click) then go to the
 * explorer, which moves every view (lib/selection.js) instead of this one alone, and `title`:
 * the section's, which the view's figure carries (lib/figure.js).
 */
export function mountView({ model, el, host, select = null, title = "" }) {
  // anywidget may share one definition object between models, so each render builds its
  // own per-model bindings instead of keeping them in a closure set by initialize().
  const widget = viewFor(model);
  applyStyles(el); // the bundle's CSS where this view is shown, once per root (lib/styles.js)
  registerFigure(el, { model, title }); // what the view's figure states: its title, its selection
  const withHost = {
    get: (name) => model.get(name),
    set: (name, value) =>
      select && SELECTION_KEYS.includes(name) ? select({ [name]: value }) : model.set(name, value),
    save_changes: () => model.save_changes(),
    send: (content, callbacks, buffers) => model.send(content, callbacks, buffers),
    on: (name, cb) => model.on(name, cb),
    off: (name, cb) => model.off(name, cb),
    widget_manager: model.widget_manager,
    // whether a kernel answers (ipywidgets' comm_live; lib/host.js has it too): views read it
    // through lib/offline.js isLive, which counts a model without it as live
    get comm_live() {
      return model.comm_live;
    },
    // anywidget >= 0.10 passes `host` to render: it resolves "IPY_MODEL_<id>" references
    // to child models. The kernel-less host (lib/host.js) provides the same call.
    host,
    // how a composite view shows a child widget: handed down here, so that
    // components/ChildView.svelte need not import this entry point back
    mountChild: ({ model: child, el: childEl, select: childSelect = null, title: childTitle = "" }) =>
      mountView({ model: child, el: childEl, host, select: childSelect, title: childTitle }),
  };
  widget.initialize({ model: withHost });
  // no kernel attached: selection changes are answered from the view's saved `_offline`
  const stopAnswering = answerOffline(model);
  const cleanup = widget.render({ model: withHost, el });
  return () => {
    stopAnswering();
    if (typeof cleanup === "function") cleanup();
  };
}

// The bundle's key once its carrier published it (lib/slot.js); null for a view whose
// `_esm` is the whole bundle (marimo) or on a kernel-less page.
let published = null;

const definition = {
  // Only the kernel's hidden carrier has `bundle_key`: anywidget calls initialize when it
  // creates the model, and the views' stubs then render with this bundle.
  initialize({ model }) {
    const key = model.get("bundle_key");
    if (!key) return;
    published = key;
    publish(key, definition, mountView);
  },
  render: (ctx) => mountTracked(published, ctx, mountView),
};

export default definition;

// Kernel-less host (standalone HTML export and the browser test harness) and its JSON reader
// (non-finite numbers tagged, pycircuits_widgets/widgets/core/offline.py NONFINITE); the
// loaders of the packed bundle hand its CSS to `useStyles`; a view's figure (`save_figure` in
// Python calls it in a saved page).
export { createHost, figure, parseTagged, useStyles };
