// A kernel-less anywidget host: a model object with anywidget's front-end API
// (get/set/on/off/save_changes/send) backed by a saved widget state. The standalone HTML
// export uses it as is (views answer from their saved `_offline` trait, lib/offline.js);
// the browser test harness passes `onSave`/`onSend` to forward changes to a live Python
// widget.
import { decodeBase64 } from "./buffers.js";

/** Most keys in one buffer path (ours are 2 to 5 deep). */
export const MAX_BUFFER_PATH = 16;
// Keys that would reach an object's prototype instead of its own data.
const FORBIDDEN_KEYS = new Set(["__proto__", "constructor", "prototype"]);

function checkedPath(path) {
  const ok =
    Array.isArray(path) &&
    path.length >= 1 &&
    path.length <= MAX_BUFFER_PATH &&
    path.every((k) => (typeof k === "string" && !FORBIDDEN_KEYS.has(k)) || (Number.isSafeInteger(k) && k >= 0));
  if (!ok) {
    throw new Error(
      `pycircuits_widgets: saved buffer path ${JSON.stringify(path)?.slice(0, 200)} refused: expected 1 to ` +
        `${MAX_BUFFER_PATH} keys (strings other than __proto__, constructor, prototype, or indices)`,
    );
  }
  return path;
}

/**
 * Put binary buffers back into a state object at their paths (ipywidgets' buffer_paths).
 * A saved page's paths are data from whoever wrote the notebook: each is checked
 * (`checkedPath`) and followed only through the state's own objects and arrays, so no path
 * reaches a prototype (`["__proto__", "polluted"]` used to set `({}).polluted`).
 * @param {Record<string, any>} state  JSON state (mutated)
 * @param {Array<Array<string|number>>} paths
 * @param {DataView[]} buffers
 */
export function restoreBuffers(state, paths, buffers) {
  if (!Array.isArray(paths) || !Array.isArray(buffers) || paths.length !== buffers.length) {
    throw new Error(`pycircuits_widgets: saved state has ${paths?.length} buffer paths for ${buffers?.length} buffers`);
  }
  paths.forEach((path, i) => {
    let obj = state;
    for (const key of checkedPath(path).slice(0, -1)) {
      obj = Object.hasOwn(obj, key) ? obj[key] : undefined;
      if (obj === null || typeof obj !== "object") {
        throw new Error(`pycircuits_widgets: saved buffer path ${JSON.stringify(path)} leads nowhere in the state`);
      }
    }
    obj[path[path.length - 1]] = buffers[i];
  });
  return state;
}

export class HostModel {
  /**
   * @param {string} id
   * @param {Record<string, any>} state
   * @param {{onSave?: (id: string, changes: Record<string, any>) => any, onSend?: (id: string, content: any, buffers: any[]) => any}} hooks
   */
  constructor(id, state, hooks = {}) {
    this.model_id = id;
    this._state = { ...state };
    this._dirty = {};
    this._listeners = new Map();
    this._hooks = hooks;
  }
  /** Whether a kernel answers (as ipywidgets' WidgetModel.comm_live): only through hooks. */
  get comm_live() {
    return Boolean(this._hooks.onSave);
  }
  get(name) {
    return this._state[name];
  }
  set(name, value) {
    if (this._state[name] === value) return;
    this._state[name] = value;
    this._dirty[name] = value;
    this._emit(`change:${name}`, this, value);
  }
  /** Apply a state update coming from the kernel (no echo back). */
  update(changes) {
    for (const [name, value] of Object.entries(changes)) {
      this._state[name] = value;
      delete this._dirty[name];
      this._emit(`change:${name}`, this, value);
    }
  }
  save_changes() {
    const changes = this._dirty;
    this._dirty = {};
    if (!Object.keys(changes).length) return;
    if (this._hooks.onSave) this._hooks.onSave(this.model_id, changes);
  }
  send(content, _callbacks, buffers = []) {
    if (this._hooks.onSend) this._hooks.onSend(this.model_id, content, buffers);
  }
  /** Deliver a custom message from the kernel. */
  receive(content, buffers = []) {
    this._emit("msg:custom", content, buffers);
  }
  on(event, cb) {
    if (!this._listeners.has(event)) this._listeners.set(event, new Set());
    this._listeners.get(event).add(cb);
  }
  off(event, cb) {
    if (event == null) this._listeners.clear();
    else if (cb == null) this._listeners.delete(event);
    else this._listeners.get(event)?.delete(cb);
  }
  _emit(event, ...args) {
    for (const cb of [...(this._listeners.get(event) ?? [])]) cb(...args);
  }
}

/**
 * Create a host for widget states saved by `pycircuits_widgets.widgets.sharing.standalone`.
 * @param {{onSave?: Function, onSend?: Function}} hooks
 */
export function createHost(widgetDef, hooks = {}) {
  const models = new Map();
  const host = {
    models,
    /**
     * Resolve a child widget reference ("anywidget:<id>" as anywidget's `host.getModel`
     * takes in Jupyter, "IPY_MODEL_<id>" as ipywidgets syncs it, or a bare id).
     */
    async getModel(ref) {
      const id = String(ref).replace(/^(IPY_MODEL_|anywidget:)/, "");
      const model = models.get(id);
      if (!model) throw new Error(`pycircuits_widgets: no saved state for widget ${id}`);
      return model;
    },
    /**
     * Create the model for a saved widget state without showing it (children of composite
     * views are shown by their parent).
     * @param {{model_id: string, state: object, buffer_paths: any[], buffers: string[]}} saved
     *   buffers are base64 strings
     */
    register(saved) {
      const state = restoreBuffers(
        structuredClone(saved.state),
        saved.buffer_paths,
        saved.buffers.map(decodeBase64),
      );
      const model = new HostModel(saved.model_id, state, hooks);
      models.set(saved.model_id, model);
      return model;
    },
    /** Register a saved widget and show it in `el`. */
    mount(el, saved) {
      const model = models.get(saved.model_id) ?? host.register(saved);
      widgetDef.render({ model, el, host });
      return model;
    },
  };
  return host;
}

/**
 * Resolve a child widget reference through a host's getModel, retrying while it is not
 * found: JupyterLab can render a parent before a child model is registered (models restored
 * from a kernel arrive one by one) and its own getModel gives up after 2 s.
 * @param {{getModel: (ref: string) => Promise<any>}} host
 * @param {string} ref
 * @param {{tries?: number, delay?: number}} options  ms between tries (20 x 500 ms by default)
 */
export async function resolveModel(host, ref, { tries = 20, delay = 500 } = {}) {
  for (let i = 1; ; i++) {
    try {
      return await host.getModel(ref);
    } catch (err) {
      if (i >= tries) throw err;
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }
}
