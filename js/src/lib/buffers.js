// Decoding of binary payloads sent by pycircuits_widgets.widgets.payload.encode_array:
// {view: DataView, dtype: string, shape: number[], encoding?: "deflate"}.

import { inflateSync } from "fflate";

const TYPED = {
  uint8: Uint8Array,
  int8: Int8Array,
  uint16: Uint16Array,
  int16: Int16Array,
  uint32: Uint32Array,
  int32: Int32Array,
  float32: Float32Array,
  float64: Float64Array,
};

/**
 * View a binary payload as a typed array (copying only if the buffer is misaligned).
 * @param {{view: DataView|ArrayBuffer|Uint8Array, dtype: string, shape: number[]}} payload
 * @returns {{data: ArrayLike<number>, shape: number[]}}
 */
export function decodeArray(payload) {
  if (!payload || payload.view == null) throw new Error("decodeArray: payload has no `view` buffer");
  if (payload.encoding === "deflate") return decodeArray({ view: inflated(payload.view), dtype: payload.dtype, shape: payload.shape });
  if (payload.encoding != null) throw new Error(`decodeArray: unsupported encoding "${payload.encoding}"`);
  if (payload.dtype === "float16") return decodeFloat16(payload);
  const Typed = TYPED[payload.dtype];
  if (!Typed) throw new Error(`decodeArray: unsupported dtype "${payload.dtype}"`);
  const { buffer, byteOffset, byteLength } = toBytes(payload.view);
  const n = byteLength / Typed.BYTES_PER_ELEMENT;
  const expected = payload.shape.reduce((a, b) => a * b, 1);
  if (n !== expected) {
    throw new Error(`decodeArray: ${n} ${payload.dtype} values for shape [${payload.shape}]`);
  }
  const data =
    byteOffset % Typed.BYTES_PER_ELEMENT === 0
      ? new Typed(buffer, byteOffset, n)
      : new Typed(buffer.slice(byteOffset, byteOffset + byteLength));
  return { data, shape: payload.shape };
}

/** The UTF-8 text of a uint8 payload (payload.encode_json in Python: JSON text, deflated). */
export function decodeText(payload) {
  return new TextDecoder().decode(decodeArray(payload).data);
}

/**
 * A list or dict trait Python sends as a JSON buffer (payload.JSON_BUFFER: the deflated UTF-8
 * JSON text), or as plain JSON; `fallback` when absent. Views read it through `$derived`, so it
 * is parsed once per change.
 */
export function jsonOf(value, fallback) {
  if (value == null) return fallback;
  return value.view != null ? JSON.parse(decodeText(value)) : value;
}

/** float16 (the compact saved answers, widgets/offline.py) widened to a Float32Array. */
function decodeFloat16(payload) {
  const bits = decodeArray({ ...payload, dtype: "uint16" }).data;
  const out = new Float32Array(bits.length);
  for (let i = 0; i < bits.length; i++) {
    const h = bits[i];
    const sign = h & 0x8000 ? -1 : 1;
    const exp = (h >> 10) & 0x1f;
    const frac = h & 0x3ff;
    out[i] =
      exp === 0 ? sign * 2 ** -14 * (frac / 1024)
      : exp === 31 ? (frac ? NaN : sign * Infinity)
      : sign * 2 ** (exp - 15) * (1 + frac / 1024);
  }
  return { data: out, shape: payload.shape };
}

// Inflated bytes per saved buffer: views decode the same payload on every redraw, and
// synchronously (the browser's DecompressionStream is async only, hence fflate).
const INFLATED = new WeakMap();

/** The raw-deflate bytes of a `"deflate"` payload (payload.deflate in Python) inflated. */
function inflated(view) {
  let out = INFLATED.get(view);
  if (!out) {
    const { buffer, byteOffset, byteLength } = toBytes(view);
    out = inflateSync(new Uint8Array(buffer, byteOffset, byteLength));
    INFLATED.set(view, out);
  }
  return out;
}

function toBytes(view) {
  if (view instanceof ArrayBuffer) return { buffer: view, byteOffset: 0, byteLength: view.byteLength };
  return { buffer: view.buffer, byteOffset: view.byteOffset, byteLength: view.byteLength };
}

/** @param {string} b64 @returns {DataView} */
export function decodeBase64(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new DataView(bytes.buffer);
}
