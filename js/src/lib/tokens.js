// Token display. Tokens are always rendered as text (Svelte escapes `{text}`), never as
// HTML; here we only make whitespace visible, with the same mapping as the Python side
// (pycircuits_widgets.models.tokenizer): space "·", newline "↵", tab "→".

const VISIBLE = { " ": "·", "\n": "↵", "\t": "→", "\r": "␍" };

/** @param {string} token */
export function visibleWhitespace(token) {
  return String(token).replace(/[ \n\t\r]/g, (c) => VISIBLE[c]);
}

/** Does the token end a line (so the view should break after it)? */
export function endsLine(token) {
  return /\n$|↵$/.test(String(token));
}

/** Compact, exact-enough number formatting for read-outs. */
export function formatValue(v, digits = 4) {
  if (v == null || Number.isNaN(v)) return "—";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e4 || a < 1e-3) return v.toExponential(digits - 1);
  return Number(v.toPrecision(digits)).toString();
}

/** "a", "a and b", "a, b and c": a list of phrases in a sentence. */
export function listText(items) {
  if (items.length <= 1) return items.join("");
  return `${items.slice(0, -1).join(", ")} and ${items[items.length - 1]}`;
}
