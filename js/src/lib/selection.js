// The one selection vocabulary, shared by every view and the explorer (same names and rules
// as pycircuits_widgets/widgets/selection.py and explorer.py):
//   layer, head  a head, written `L1.H6` everywhere (headLabel)
//   position     an index into the text (-1: none)
//   token        a vocabulary id (-1: none)
//   selected_pair  a head pair [l1, h1, l2, h2], earlier head -> later head ([]: none)
// The explorer links its child views here, in the browser, so a page without a kernel
// (save_html, an exported notebook) stays coherent; with a kernel the same change also
// reaches Python, which recomputes and follows the same selection.

export const SELECTION_KEYS = ["layer", "head", "position", "token", "selected_pair"];

/** Child view -> the selection traits it shows (explorer.py FOLLOWS). */
export const FOLLOWS = {
  loss: ["position"],
  attention: ["layer", "head", "position"],
  trigrams: ["layer", "head", "token"],
  composition: ["layer", "head", "selected_pair"],
  eigen: ["layer", "head"],
  paths: ["layer", "head", "position", "selected_pair"],
  induction: ["layer", "head", "token", "selected_pair"],
  positional: ["layer", "head"],
  virtual: ["layer", "head", "selected_pair"],
  bigrams: ["token"],
};

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
 * consistent as in the kernel (explorer.py): a position selects its token; a token selects its
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
 * @param {{get:Function, set:Function, save_changes:Function}} explorer
 * @param {Record<string, {get:Function, set:Function, save_changes:Function}>} children by view name
 */
export function applySelection(explorer, children, selection) {
  const targets = [[explorer, SELECTION_KEYS], ...Object.entries(children).map(([name, m]) => [m, FOLLOWS[name] ?? []])];
  for (const [model, keys] of targets) {
    let changed = false;
    for (const key of keys) {
      if (key in selection && !sameValue(model.get(key), selection[key])) {
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

/**
 * The strongest K-composition writer into each head, from a K-composition table (the
 * composition view's `scores.K.correct`, decoded: row-major [L, H, L, H], NaN where undefined):
 * `(layer, head) -> [l1, h1]` with the largest finite score over l1 < layer (first on ties,
 * as numpy's argmax in explorer.py), or null (layer 0, or no finite score: refused under rotary).
 * @param {ArrayLike<number> | null} scores
 */
export function strongestWriter(scores, nLayers, nHeads) {
  return (layer, head) => {
    if (!scores || layer < 1 || layer >= nLayers) return null;
    let best = null;
    let bestValue = -Infinity;
    for (let l1 = 0; l1 < layer; l1++) {
      for (let h1 = 0; h1 < nHeads; h1++) {
        const v = scores[((l1 * nHeads + h1) * nLayers + layer) * nHeads + head];
        if (Number.isFinite(v) && v > bestValue) {
          bestValue = v;
          best = [l1, h1];
        }
      }
    }
    return best;
  };
}
