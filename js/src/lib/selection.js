// The one selection vocabulary, shared by every view and the explorer (same names and rules
// as pycircuits_widgets/widgets/core/selection.py; which view follows which keys, and each head's
// strongest K-composition writer, are the kernel's data: the explorer's `sections` and
// `strongest_writers` traits):
//   layer, head  a head, written `L1.H6` everywhere (headLabel)
//   position     an index into the text (-1: none)
//   token        a vocabulary id (-1: none)
//   selected_pair  a head pair [l1, h1, l2, h2], earlier head -> later head ([]: none)
// The explorer links its child views here, in the browser, so a page without a kernel
// (save_html, an exported notebook) stays coherent; with a kernel the same change also
// reaches Python, which recomputes and follows the same selection.

export const SELECTION_KEYS = ["layer", "head", "position", "token", "selected_pair"];

/** The one way a head is written in the UI. */
export function headLabel(layer, head) {
  return `L${layer}.H${head}`;
}

/** Same selection value (numbers, or pairs compared element by element)? */
export function sameValue(a, b) {
  if (Array.isArray(a) || Array.isArray(b)) {
    return Array.isArray(a) && Array.isArray(b) && a.length === b.length && a.every((v, i) => v === b[i]);
  }
  return a === b;
}

/**
 * The full selection after `change` (some of layer/head/position/token/selected_pair), kept
 * consistent as in the kernel (selection.py resolve_selection, tested against this on the same
 * cases): a position selects its token; a token selects its
 * last position in the text (-1 if absent); no token means no position; a pair selects its
 * later head; a head in layer >= 1 that is not the pair's later head brings the pair of its
 * strongest K-composition writer, `writerOf(layer, head) -> [l1, h1] | null`.
 * @param {{layer:number, head:number, position:number, token:number, selected_pair?:number[]}} current
 * @param {Partial<typeof current>} change
 * @param {ArrayLike<number>} tokenIds  vocabulary id of each text position
 * @param {(layer:number, head:number) => number[] | null} [writerOf]
 */
export function resolveSelection(current, change, tokenIds = [], writerOf = null) {
  const next = { ...current, ...change };
  const pair = next.selected_pair;
  if ("selected_pair" in change && pair?.length === 4) {
    next.layer = pair[2];
    next.head = pair[3];
  } else if (("layer" in change || "head" in change) && next.layer >= 1 && writerOf) {
    if (!(pair?.length === 4 && pair[2] === next.layer && pair[3] === next.head)) {
      const writer = writerOf(next.layer, next.head);
      if (writer) next.selected_pair = [writer[0], writer[1], next.layer, next.head];
    }
  }
  if ("position" in change && next.position >= 0) {
    next.token = tokenIds[next.position] ?? next.token;
  } else if ("token" in change) {
    if (next.token < 0) next.position = -1;
    else if (next.position < 0 || tokenIds[next.position] !== next.token) {
      next.position = lastIndexOf(tokenIds, next.token);
    }
  }
  return next;
}

function lastIndexOf(ids, t) {
  for (let i = ids.length - 1; i >= 0; i--) if (ids[i] === t) return i;
  return -1;
}

/**
 * Move the explorer and its child views to `selection`: every model that shows a key gets
 * the new value (one `save_changes` per model that changed, so a kernel hears of it too).
 * Where `kernelLinks()` is true after the explorer's own change (a live kernel, `trackKernel`),
 * only the explorer is moved and saved: its Python side moves the child views (explorer.py
 * `_to_views`) and their models hear it from the kernel. One message a click instead of one per
 * view (each is a kernel request with its echo and two status messages; benchmarks/README.md has
 * the live JupyterLab A/B). A child set here but not saved would keep the value in its unsent
 * changes and send it, stale, with its next save: so either both or neither.
 * @param {{get:Function, set:Function, save_changes:Function}} explorer
 * @param {Record<string, {get:Function, set:Function, save_changes:Function}>} children by view name
 * @param {Record<string, string[]>} follows  view name -> the selection keys it shows (the explorer's `sections`)
 * @param {() => boolean} [kernelLinks]
 */
export function applySelection(explorer, children, selection, follows, kernelLinks = () => false) {
  moveModel(explorer, SELECTION_KEYS, selection);
  if (kernelLinks()) return;
  for (const [name, model] of Object.entries(children)) moveModel(model, follows[name] ?? [], selection);
}

function moveModel(model, keys, selection) {
  let changed = false;
  for (const key of keys) {
    if (key in selection && !sameValue(model.get(key), selection[key])) {
      model.set(key, selection[key]);
      changed = true;
    }
  }
  if (changed) model.save_changes();
}

/**
 * Whether the explorer's changes reach a live kernel, which links its child views itself: read
 * from each change event of its selection keys, whose first argument is the model that changed
 * (ipywidgets' model, whose `comm_live` says whether its comm is connected; lib/host.js's models
 * have `comm_live` too). False until such an event says otherwise, and for a host that does not
 * say (its children are then moved here, as without a kernel). Returns `[kernelLinks, stop]`.
 * @param {{on:Function, off:Function}} explorer
 * @returns {[() => boolean, () => void]}
 */
export function trackKernel(explorer) {
  let live = false;
  const seen = (emitter) => (live = emitter?.comm_live === true);
  for (const key of SELECTION_KEYS) explorer.on(`change:${key}`, seen);
  return [() => live, () => SELECTION_KEYS.forEach((key) => explorer.off(`change:${key}`, seen))];
}

/**
 * The selected head's result: `bindings[name]` when its payload (which carries `layer`/`head`)
 * is for the selected head, else null (the kernel has not answered yet, or there is no kernel
 * and no saved answer: the view says so).
 */
export function headData(bindings, name) {
  const current = bindings[name];
  const { layer, head } = bindings;
  return current && current.layer === layer && current.head === head ? current : null;
}

/**
 * `(layer, head) -> [l1, h1] | null` read from the kernel's strongest-writer table (the explorer's
 * `strongest_writers`, decoded: row-major int32 [L, H, 2], -1 for none), or null without one.
 * @param {ArrayLike<number> | null} writers
 */
export function writerLookup(writers, nLayers, nHeads) {
  if (!writers) return null;
  return (layer, head) => {
    if (layer < 1 || layer >= nLayers || head < 0 || head >= nHeads) return null;
    const i = (layer * nHeads + head) * 2;
    return writers[i] >= 0 ? [writers[i], writers[i + 1]] : null;
  };
}
