import { defineConfig } from "vite";
import { svelte } from "@sveltejs/vite-plugin-svelte";

// One self-contained ES module: anywidget loads `_esm` from a Blob URL, where
// relative imports of split chunks cannot resolve.
export default defineConfig({
  plugins: [svelte({ compilerOptions: { runes: true } })],
  build: {
    outDir: "../pycircuits_widgets/static",
    emptyOutDir: true,
    lib: {
      entry: "src/index.js",
      formats: ["es"],
      fileName: () => "widget.js",
      cssFileName: "widget",
    },
    rollupOptions: { output: { inlineDynamicImports: true } },
    target: "es2020",
    minify: true,
  },
  test: {
    environment: "happy-dom",
    include: ["test/**/*.test.js"],
  },
  resolve: process.env.VITEST ? { conditions: ["browser"] } : undefined,
});
