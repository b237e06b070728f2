// Token display. Tokens are always rendered as text (Svelte escapes `{text}`), never as
// HTML; here we make whitespace visible, with the same mapping as the Python side
// (pycircuits_widgets.models.tokenizer): space "·", newline "↵", tab "→"; and, as its
// `escape_invisible`, every character that draws nothing or reorders the text after it
// (bidi controls, zero-width and other format characters, controls, separators, lone
// surrogates, Hangul fillers) and the replacement character U+FFFD as its escape "\u202e". That string is exact; a view shows
// `compactToken`, which counts long whitespace runs ("↵·×23"), and keeps the exact one in
// the token's title.

const VISIBLE = { " ": "·", "\n": "↵", "\t": "→", "\r": "␍" };
// Python's "not str.isprintable()" (categories C* and Z*), plus letters that draw nothing
// and the replacement character (bytes a decoder lost: a box to a reader, not text).
const INVISIBLE = /[\p{C}\p{Z}\u115F\u1160\u3164\uFFA0\uFFFD]/gu;

function escapeCode(c) {
  const code = c.codePointAt(0);
  return code <= 0xffff ? `\\u${code.toString(16).padStart(4, "0")}` : `\\U${code.toString(16).padStart(8, "0")}`;
}

/** A token as shown: visible whitespace, invisible characters as escapes. @param {string} token */
export function visibleWhitespace(token) {
  return String(token).replace(/[ \n\t\r]/g, (c) => VISIBLE[c]).replace(INVISIBLE, escapeCode);
}

/**
 * Text from the user or a checkpoint shown as a label (a legend, a model name, a heading): the
 * same escapes as a token's (`visibleWhitespace`), so a bidi override, a control or a lone
 * surrogate shows as "\u202e" and reorders nothing; the ordinary space is kept (a label's words
 * are not a token's whitespace). @param {string} text
 */
export function visibleLabel(text) {
  return String(text ?? "").replace(INVISIBLE, (c) => (c === " " ? c : escapeCode(c)));
}

/** Runs of at least this many of one whitespace glyph are shown counted ("·×23"): up to
 * four (a code indent) are read at a glance, more would have to be counted by eye. */
export const RUN_MIN = 5;
const RUN = new RegExp(`([·↵→␍])\\1{${RUN_MIN - 1},}`, "g");

/**
 * A token as a view shows it: `visibleWhitespace`, then each run of RUN_MIN or more of one
 * whitespace glyph written once with its length ("\n" + 23 spaces -> "↵·×23"). Lossy on
 * purpose: show `visibleWhitespace(token)` (exact) in its title. @param {string} token
 */
export function compactToken(token) {
  return visibleWhitespace(token).replace(RUN, (run, glyph) => `${glyph}×${run.length}`);
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
