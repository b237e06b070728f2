// Sorting and paging of the skip-trigram table (pure functions, tested in vitest).

/**
 * Row indices of a table ordered by one numeric column, descending (NaN last); stable.
 * @param {ArrayLike<number>} column
 * @returns {number[]}
 */
export function orderBy(column) {
  const idx = Array.from({ length: column.length }, (_, i) => i);
  const key = (i) => (Number.isNaN(column[i]) ? -Infinity : column[i]);
  return idx.sort((a, b) => key(b) - key(a) || a - b);
}

/**
 * One page of `items`, with the page number clamped into range.
 * @template T
 * @param {T[]} items
 * @param {number} page
 * @param {number} size
 * @returns {{rows: T[], page: number, pages: number, start: number}}
 */
export function paginate(items, page, size) {
  const n = Math.max(1, Math.floor(size) || 1);
  const pages = Math.max(1, Math.ceil(items.length / n));
  const p = Math.min(pages - 1, Math.max(0, Math.floor(page) || 0));
  return { rows: items.slice(p * n, p * n + n), page: p, pages, start: p * n };
}
