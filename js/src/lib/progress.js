// A kernel job's progress (pycircuits_widgets/widgets/core/meter.py) as text, for the busy
// indicator (components/Busy.svelte) and the note of a cancelled job (OnDemand.svelte).

/** "37/144" or "12/270 layer pairs": how far the job is. */
export function count(progress) {
  return `${progress.done}/${progress.total}${progress.unit ? ` ${progress.unit}` : ""}`;
}

/** ", ~40 s left" (or "~3 min left"; "" without an estimate). `left_s` is measured by the
 * kernel from the pieces done; none before the first piece. */
export function timeLeft(progress) {
  const left = progress?.left_s;
  if (typeof left !== "number" || !Number.isFinite(left) || !(progress.done > 0)) return "";
  if (left < 90) return `, ~${Math.max(1, Math.round(left))} s left`;
  return `, ~${Math.round(left / 60)} min left`;
}
