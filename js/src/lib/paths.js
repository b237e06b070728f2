// Pure helpers of the path-expansion and head-pair views (vitest-tested): ranking terms,
// the terms behind one position's next token, pair keys, and text search of a vocabulary.

/**
 * Indices of the `n` largest values, largest first (NaN last).
 * @param {ArrayLike<number>} values
 */
export function rankDescending(values, n = values.length) {
  const idx = Array.from(values, (_, i) => i);
  const key = (i) => (Number.isFinite(values[i]) ? values[i] : -Infinity);
  idx.sort((a, b) => key(b) - key(a) || a - b);
  return idx.slice(0, n);
}

/**
 * The terms that raise (or lower) the logit of the next token at position `p` most.
 * `contributions` is the row-major [nTerms, nPos] payload data (nPos = tokens - 1).
 * @returns {{raise: {term: number, value: number}[], lower: {term: number, value: number}[]}}
 */
export function termsAtPosition(contributions, nTerms, nPos, p, n = 6) {
  if (p < 0 || p >= nPos) return { raise: [], lower: [] };
  const col = Array.from({ length: nTerms }, (_, t) => contributions[t * nPos + p]);
  const order = rankDescending(col);
  const pick = (ids) => ids.map((t) => ({ term: t, value: col[t] }));
  return {
    raise: pick(order.filter((t) => col[t] > 0).slice(0, n)),
    lower: pick(order.filter((t) => col[t] < 0).reverse().slice(0, n)),
  };
}

/** "l1,h1,l2,h2": the key of a pair in the views' per-pair data. */
export function pairKey(pair) {
  return pair.join(",");
}

/** Is `pair` ([l1, h1, l2, h2]) the same as `other`? */
export function samePair(pair, other) {
  return !!pair && !!other && pair.length === 4 && other.length === 4 && pair.every((v, i) => v === other[i]);
}

/**
 * Vocabulary ids whose display string contains `query` (exact matches first, then by id), at most `n`.
 * @param {string[]} vocab
 */
export function searchVocab(vocab, query, n = 40) {
  if (!query) return [];
  const exact = [];
  const partial = [];
  for (let i = 0; i < vocab.length && exact.length < n; i++) {
    if (vocab[i] === query) exact.push(i);
    else if (partial.length < n && vocab[i].includes(query)) partial.push(i);
  }
  return [...exact, ...partial].slice(0, n);
}
