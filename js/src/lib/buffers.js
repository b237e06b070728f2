// Decoding of binary payloads sent by pycircuits_widgets.widgets.core.payload.encode_array:
// {view: DataView, dtype: string, shape: number[], encoding?: "deflate"}.

import { Inflate } from "fflate";

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
  if (payload.encoding === "deflate") {
    const size = declaredBytes(payload);
    return decodeArray({ view: inflated(payload.view, size), dtype: payload.dtype, shape: payload.shape });
  }
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

/** float16 (the compact saved answers, widgets/core/offline.py) widened to a Float32Array. */
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

/**
 * Most bytes one deflated payload may inflate to (64 MiB; GPT-2-XL's attention overview is
 * 10 MB). A saved page's payloads are data from whoever wrote it: a 1 MB page could
 * otherwise inflate to gigabytes.
 */
export const MAX_INFLATED = 64 << 20;
// Deflated bytes inflated per step: one step writes at most ~1032 times as many (deflate's
// largest ratio), so a payload that inflates past its declared size is stopped within 8 MiB.
const INFLATE_STEP = 8 << 10;
const BYTES = { float16: 2, ...Object.fromEntries(Object.entries(TYPED).map(([k, T]) => [k, T.BYTES_PER_ELEMENT])) };

/** The bytes a payload's dtype and shape declare, checked against MAX_INFLATED before anything is allocated. */
function declaredBytes(payload) {
  const { dtype, shape } = payload;
  if (!BYTES[dtype]) throw new Error(`decodeArray: unsupported dtype "${dtype}"`);
  if (!Array.isArray(shape) || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
    throw new Error(`decodeArray: shape ${JSON.stringify(shape)?.slice(0, 100)} is not a list of sizes`);
  }
  const size = shape.reduce((a, b) => a * b, BYTES[dtype]);
  if (!(size <= MAX_INFLATED)) {
    throw new Error(`decodeArray: a deflated ${dtype} payload of shape [${shape}] would inflate to ${size} bytes, ` +
      `over the limit of ${MAX_INFLATED} bytes; not inflated`);
  }
  return size;
}

// Inflated bytes per saved buffer: views decode the same payload on every redraw, and
// synchronously (the browser's DecompressionStream is async only, hence fflate).
const INFLATED = new WeakMap();

/**
 * The raw-deflate bytes of a `"deflate"` payload (payload.deflate in Python) inflated into
 * exactly `size` bytes (what its dtype and shape declare), step by step: inflating stops
 * as soon as the data would go past `size`.
 */
function inflated(view, size) {
  let out = INFLATED.get(view);
  if (!out) {
    const { buffer, byteOffset, byteLength } = toBytes(view);
    const input = new Uint8Array(buffer, byteOffset, byteLength);
    const result = new Uint8Array(size);
    let filled = 0;
    const stream = new Inflate((chunk) => {
      if (filled + chunk.length > size) {
        throw new Error(
          `decodeArray: a deflated payload inflates past the ${size} bytes its shape declares; not inflated`,
        );
      }
      result.set(chunk, filled);
      filled += chunk.length;
    });
    let at = 0;
    do {
      stream.push(input.subarray(at, at + INFLATE_STEP), at + INFLATE_STEP >= input.length);
      at += INFLATE_STEP;
    } while (at < input.length);
    if (filled !== size) {
      throw new Error(`decodeArray: a deflated payload inflates to ${filled} bytes, its shape declares ${size}`);
    }
    out = result;
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
