// An attention pattern drawn on a canvas, for the head grid's thumbnails and the heatmap:
// each cell in the pattern's colour (lib/attention.js patternPixels), the causal mask hatched.
import { MASK_RGB, maskPolygon, patternPixels } from "../../lib/attention.js";

let hatch = null; // the mask's 6 x 6 tile, drawn once
function hatchPattern(ctx) {
  if (!hatch) {
    hatch = document.createElement("canvas");
    hatch.width = hatch.height = 6;
    const g = hatch.getContext("2d");
    g.fillStyle = `rgb(${MASK_RGB.join(",")})`;
    g.fillRect(0, 0, 6, 6);
    g.strokeStyle = "rgba(110,110,110,0.8)";
    g.beginPath();
    g.moveTo(0, 6);
    g.lineTo(6, 0);
    g.stroke();
  }
  return ctx.createPattern(hatch, "repeat");
}

/**
 * Draw an [res, res] uint8 pattern at (x0, y0) with `px` pixels per cell, in the colours of
 * `lut`; a causal pattern's masked half hatched.
 */
export function drawPattern(ctx, values, res, x0, y0, px, lut, causal) {
  const off = document.createElement("canvas");
  off.width = off.height = res;
  off.getContext("2d").putImageData(new ImageData(patternPixels(values, res, lut, causal), res, res), 0, 0);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(off, x0, y0, res * px, res * px);
  if (!causal || res < 2) return;
  ctx.save();
  ctx.translate(x0, y0);
  ctx.beginPath();
  for (const [i, [x, y]] of maskPolygon(res, px).entries()) (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y));
  ctx.closePath();
  ctx.fillStyle = hatchPattern(ctx);
  ctx.fill();
  ctx.restore();
}
