// The time-left part of a kernel job's progress line (pycircuits_widgets/widgets/core/meter.py):
// `left_s` is measured by the kernel from the pieces done; none before the first piece.

/** ", ~40 s left" (or "~3 min left"; "" without an estimate). */
export function timeLeft(progress) {
  const left = progress?.left_s;
  if (typeof left !== "number" || !Number.isFinite(left) || !(progress.done > 0)) return "";
  if (left < 90) return `, ~${Math.max(1, Math.round(left))} s left`;
  return `, ~${Math.round(left / 60)} min left`;
}
