// Kernel-less answers (pycircuits_widgets/widgets/core/offline.py): a view's `_offline` trait holds,
// for each result that depends on the selection, the patch the kernel would send for every
// other selection. When a selection trait changes and the model has no live kernel
// connection (a saved notebook opened without its kernel, an exported or save_html page), the
// precomputed patch is applied as the kernel would apply it; with a live kernel nothing
// happens here (the kernel answers fresh). One mechanism for JupyterLab, export and save_html.

import { decodeText } from "./buffers.js";

export const NONFINITE = "__pcw_nonfinite__";

/** JSON.parse of saved JSON whose non-finite numbers are tagged `{NONFINITE: "NaN"}`. */
export function parseTagged(text) {
  return JSON.parse(text, (_key, value) =>
    value !== null && typeof value === "object" && NONFINITE in value ? Number(value[NONFINITE]) : value,
  );
}

/**
 * Whether a model has a live kernel connection. `events` is the first argument of a change
 * event: ipywidgets (Backbone) passes the model itself, whose `comm_live` says whether its
 * comm is connected; the kernel-less host (lib/host.js) has `comm_live` too. An unknown
 * host counts as live, so a precomputed answer is never shown where a kernel might answer.
 */
export function isLive(...candidates) {
  for (const m of candidates) if (m && typeof m.comm_live === "boolean") return m.comm_live;
  return true;
}

/** The selection key Python builds (offline.key): each value as JSON, joined by ",". */
export function selectionKey(model, names) {
  return names.map((name) => JSON.stringify(model.get(name))).join(",");
}

/** The view's error line for saved answers that cannot be read (malformed, or over decodeArray's size limit). */
function unreadable(err) {
  return `This page's saved answers for other selections cannot be read (${err.message}); they need a running kernel.`;
}

// Each `_offline` value's rules, read once: a click would otherwise inflate and parse every head's
// saved answers again (6.6 of 61 ms of main-thread work a click, a 30 x 9 explorer's page). A new
// value of the trait is a new object, so it is read anew. Callers never modify the rules.
const readRules = new WeakMap();

/** The rules of an `_offline` state: JSON text, or (as Python saves them) a deflated uint8 payload of it. */
function savedRules(saved) {
  if (readRules.has(saved)) return readRules.get(saved);
  let rules = saved.rules;
  if (typeof rules === "string") rules = parseTagged(rules);
  else if (rules?.view != null) rules = parseTagged(decodeText(rules));
  readRules.set(saved, rules);
  return rules;
}

/** Resolve `{packed: [offset, dtype, shape]}` references into array payloads over `data`. */
function unpack(value, data) {
  if (Array.isArray(value)) return value.map((v) => unpack(v, data));
  if (value === null || typeof value !== "object" || value instanceof DataView) return value;
  if (Array.isArray(value.packed)) {
    const [offset, dtype, shape] = value.packed;
    const bytes = { float16: 2, uint16: 2, int16: 2, uint8: 1, int8: 1 }[dtype] ?? 4;
    const n = shape.reduce((a, b) => a * b, 1);
    return { view: new DataView(data.buffer, data.byteOffset + offset, n * bytes), dtype, shape };
  }
  return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, unpack(v, data)]));
}

function merged(base, patch) {
  const out = { ...base };
  for (const [k, v] of Object.entries(patch)) {
    if (k === "__proto__") continue; // an own key of parsed JSON; assigning it would swap out's prototype
    const b = out[k];
    const plain = (x) => x !== null && typeof x === "object" && !Array.isArray(x) && !(x instanceof DataView);
    out[k] = plain(v) && plain(b) ? merged(b, v) : v;
  }
  return out;
}

/**
 * The trait patch for the model's current selection under each rule touched by `changed`
 * (trait names), or the rule's reason that it needs a kernel; plus the kernel-only
 * controls among `changed`. Pure: returns the patch, the caller applies it. A reason is a
 * limit of a page without a kernel, not a fault: it goes to `_offline_note` (a front-end-only
 * value the views show as a neutral note), never to `error`; an answer clears it.
 * @param {{get: (name: string) => any}} model
 * @param {string[]} changed
 */
export function offlinePatch(model, changed) {
  const saved = model.get("_offline");
  if (!saved || !saved.rules) return {};
  let rules;
  try {
    rules = savedRules(saved);
  } catch (err) {
    return { error: unreadable(err) }; // a bad or oversized saved payload: said in the view
  }
  const data = saved.data ?? new DataView(new ArrayBuffer(0));
  let patch = {};
  for (const rule of rules) {
    if (!rule.on.some((name) => changed.includes(name))) continue;
    const answer = rule.patches[selectionKey(model, rule.on)];
    if (!answer) {
      patch = { ...patch, _offline_note: rule.missing };
      continue;
    }
    const found = unpack(merged({ _offline_note: "", ...rule.base }, answer), data);
    for (const name of rule.merge ?? []) found[name] = { ...model.get(name), ...found[name] }; // adds entries
    patch = merged(patch, found);
  }
  const kernel = saved.kernel ?? {};
  for (const name of changed) if (kernel[name]) patch._offline_note = kernel[name];
  return patch;
}

/** Names whose change may need a kernel-less answer (rules' selection traits, kernel-only controls). */
function watched(model) {
  const saved = model.get("_offline");
  if (!saved || !saved.rules) return [];
  const rules = savedRules(saved);
  return [...new Set([...rules.flatMap((r) => r.on), ...Object.keys(saved.kernel ?? {})])];
}

/**
 * Answer selection changes of `model` from its `_offline` trait while it has no live kernel
 * connection; returns the function that stops. Changes made in one go (layer then head) are
 * answered once, after the current task, for the final selection. Kernel-only controls are
 * marked (`_needs_kernel`, a front-end-only value the views disable controls with) as soon as
 * the model is known to have no kernel.
 * @param {{get: Function, set: Function, on: Function, off: Function, comm_live?: boolean}} model
 */
export function answerOffline(model) {
  let names;
  try {
    names = watched(model);
  } catch (err) {
    model.set("error", unreadable(err)); // the view still shows its saved state
    return () => {};
  }
  let changed = new Set();
  let scheduled = false;
  let applying = false; // the answer's own sets are not selection changes
  const markKernelOnly = () => {
    const kernel = model.get("_offline")?.kernel ?? {};
    if (Object.keys(kernel).length && !model.get("_needs_kernel")) model.set("_needs_kernel", kernel);
  };
  const answer = () => {
    scheduled = false;
    const patch = offlinePatch(model, [...changed]);
    changed = new Set();
    applying = true;
    try {
      for (const [name, value] of Object.entries(patch)) model.set(name, value);
    } finally {
      applying = false;
    }
  };
  const listeners = names.map((name) => {
    const cb = (emitter) => {
      if (applying || isLive(emitter, model)) return;
      markKernelOnly();
      changed.add(name);
      if (!scheduled) {
        scheduled = true;
        queueMicrotask(answer);
      }
    };
    model.on(`change:${name}`, cb);
    return [name, cb];
  });
  if (model.comm_live === false) markKernelOnly();
  return () => listeners.forEach(([name, cb]) => model.off(`change:${name}`, cb));
}
