// The bundle's CSS, added where a view is shown, once per document or shadow root.
//
// A saved notebook's carrier and a saved page carry the CSS gzipped with the javascript
// (pycircuits_widgets/widgets/core/bundle.py `bundle_packed`): their loader unpacks it and
// hands it to `useStyles`, and each view's mount adds it (`applyStyles`) to the root its
// element lives in: the document's <head>, or the shadow root of a host that renders widgets
// inside one (a style in the document's <head> does not reach into a shadow root). Where
// the host puts anywidget's `_css` itself (marimo, development mode), `useStyles` is never
// called and nothing is added here.

/** Attribute marking the <style> elements added here. */
export const STYLE_MARK = "data-pcw-styles";

/** @type {string | null} the bundle's CSS, once its loader handed it over */
let styles = null;

/**
 * Set the CSS that every view mounted from now on adds to its root.
 * @param {string} css
 */
export function useStyles(css) {
  styles = css;
}

/**
 * Add the bundle's CSS to the root `el` lives in: its shadow root, else the document's
 * <head> (also for an element not yet attached, as JupyterLab renders before it attaches,
 * where anywidget puts `_css` too). A root that holds the same CSS already is left as is,
 * so a page of many views holds it once.
 * @param {Element} el
 */
export function applyStyles(el) {
  if (!styles) return;
  const root = el.getRootNode();
  // a shadow root (checked by shape: one made in another frame is not this window's ShadowRoot)
  const inShadow = root.nodeType === 11 && "host" in root;
  const parent = inShadow ? root : el.ownerDocument.head;
  for (const child of parent.children) {
    if (child.localName === "style" && child.hasAttribute(STYLE_MARK) && child.textContent === styles) return;
  }
  const style = el.ownerDocument.createElement("style");
  style.setAttribute(STYLE_MARK, "");
  style.textContent = styles;
  parent.append(style);
}

/**
 * The bundle's CSS as it applies to `el`: the loader's (`useStyles`), else the <style> elements
 * of el's root that style the views (where the host added anywidget's `_css` itself). A figure
 * (lib/figure.js) carries it, since an SVG drawn as an image sees no stylesheet of the page.
 * @param {Element} el
 * @returns {string}
 */
export function stylesFor(el) {
  if (styles) return styles;
  const root = el.getRootNode();
  return [...(root.querySelectorAll?.("style") ?? [])]
    .map((s) => s.textContent)
    .filter((css) => css.includes(".pcw-view"))
    .join("\n");
}
