// The one selection vocabulary, shared by every view and the explorer (same names and rules
// as pycircuits_widgets/widgets/selection.py and explorer.py):
//   layer, head  a head, written `L1.H6` everywhere (headLabel)
//   position     an index into the text (-1: none)
//   token        a vocabulary id (-1: none)
// The explorer links its child views here, in the browser, so a page without a kernel
// (save_html, an exported notebook) stays coherent; with a kernel the same change also
// reaches Python, which recomputes and follows the same selection.

export const SELECTION_KEYS = ["layer", "head", "position", "token"];

/** Child view -> the selection traits it shows (explorer.py FOLLOWS). */
export const FOLLOWS = {
  loss: ["position"],
  attention: ["layer", "head", "position"],
  trigrams: ["layer", "head", "token"],
  composition: ["layer", "head"],
  eigen: ["layer", "head"],
};

/** The one way a head is written in the UI. */
export function headLabel(layer, head) {
  return `L${layer}.H${head}`;
}

/**
 * The full selection after `change` (some of layer/head/position/token), with position and
 * token kept consistent against the text's token ids: a position selects its token; a token
 * selects its last position in the text (-1 if absent); no token means no position.
 * @param {{layer:number, head:number, position:number, token:number}} current
 * @param {Partial<typeof current>} change
 * @param {ArrayLike<number>} tokenIds  vocabulary id of each text position
 */
export function resolveSelection(current, change, tokenIds = []) {
  const next = { ...current, ...change };
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
 * @param {{get:Function, set:Function, save_changes:Function}} explorer
 * @param {Record<string, {get:Function, set:Function, save_changes:Function}>} children by view name
 */
export function applySelection(explorer, children, selection) {
  const targets = [[explorer, SELECTION_KEYS], ...Object.entries(children).map(([name, m]) => [m, FOLLOWS[name] ?? []])];
  for (const [model, keys] of targets) {
    let changed = false;
    for (const key of keys) {
      if (model.get(key) !== selection[key]) {
        model.set(key, selection[key]);
        changed = true;
      }
    }
    if (changed) model.save_changes();
  }
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
