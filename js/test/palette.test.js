// One palette (components/view.css): every colour a view's CSS or canvas uses is a `--pcw-*`
// token, each defined there once as JupyterLab's variable with one fallback. A second palette
// (a `var(--jp-…, fallback)` of a view's own, a colour literal in a view's style, a colour
// of the standalone page's own) fails here.
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { describe, expect, it } from "vitest";

const SRC = join(import.meta.dirname, "../src");
const PALETTE = join(SRC, "components/view.css");
const STANDALONE = join(import.meta.dirname, "../../pycircuits_widgets/widgets/sharing/standalone.py");

/** [path relative to src, text] of every Svelte, JavaScript and CSS source file. */
function sources(dir = SRC) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) return sources(path);
    return /\.(svelte|js|css)$/.test(entry.name) ? [[path.slice(SRC.length + 1), readFileSync(path, "utf8")]] : [];
  });
}

/** token -> its definitions ("var(--jp-x, fallback)") in the palette rule of view.css. */
function palette() {
  const css = readFileSync(PALETTE, "utf8");
  const rule = css.match(/:where\(\.pcw-view[^{]*\{([^}]*)\}/)[1];
  const tokens = new Map();
  for (const [, name, value] of rule.matchAll(/(--pcw-[a-z-]+)\s*:\s*([^;]+);/g)) {
    tokens.set(name, [...(tokens.get(name) ?? []), value.trim()]);
  }
  return tokens;
}

/** What a Svelte file styles: its <style> block and its style="…" attributes. */
function styling(text) {
  const blocks = [...text.matchAll(/<style>([\s\S]*?)<\/style>/g)].map((m) => m[1]);
  const attributes = [...text.matchAll(/\sstyle="([^"]*)"/g)].map((m) => m[1]);
  return [...blocks, ...attributes].join("\n");
}

describe("the palette", () => {
  const tokens = palette();

  it("defines each token once, as JupyterLab's variable with one fallback", () => {
    expect(tokens.size).toBeGreaterThan(10);
    for (const [name, values] of tokens) {
      expect(values, name).toHaveLength(1);
      expect(values[0], name).toMatch(/^var\(--jp-[a-z0-9-]+, [^,()]+\)$/);
    }
    const variables = [...tokens.values()].map(([v]) => v.match(/--jp-[a-z0-9-]+/)[0]);
    expect(new Set(variables).size).toBe(variables.length); // one token per variable
  });

  it("is the only place that reads JupyterLab's variables", () => {
    const readers = sources()
      .filter(([path, text]) => path !== "components/view.css" && /--jp-/.test(text))
      .map(([path]) => path);
    expect(readers).toEqual([]);
  });

  it("defines every token a view uses, and a view gives none a fallback of its own", () => {
    for (const [path, text] of sources()) {
      for (const [use, name, fallback] of text.matchAll(/var\((--pcw-[a-z-]+)\s*(,[^)]*)?\)/g)) {
        expect(tokens.has(name), `${path}: ${use}`).toBe(true);
        expect(fallback, `${path}: ${use}`).toBeUndefined();
      }
      for (const [use, name] of text.matchAll(/paletteColor\([^,]+,\s*"([^"]+)"\)/g)) {
        expect(tokens.has(name), `${path}: ${use}`).toBe(true);
      }
    }
  });

  it("leaves no colour literal in a view's styles", () => {
    const literal = /#[0-9a-f]{3,8}\b|\brgba?\(|\bhsla?\(/i;
    for (const [path, text] of sources()) {
      if (!path.endsWith(".svelte")) continue;
      const found = styling(text).split("\n").filter((line) => literal.test(line));
      expect(found, path).toEqual([]);
    }
  });

  it("is the standalone page's palette too: the page names no colour of its own", () => {
    const page = readFileSync(STANDALONE, "utf8");
    const css = [...page.matchAll(/_(?:THEME|PLACEHOLDER)_CSS = """([\s\S]*?)"""/g)].map((m) => m[1]);
    expect(css).toHaveLength(2);
    for (const sheet of css) {
      expect(sheet).not.toMatch(/--jp-|#[0-9a-f]{3,8}\b|\brgba?\(/i);
      for (const [use, name] of sheet.matchAll(/var\((--pcw-[a-z-]+)\)/g)) expect(tokens.has(name), use).toBe(true);
    }
  });
});
