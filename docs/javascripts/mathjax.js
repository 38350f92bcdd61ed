// MathJax 3 configuration for pymdownx.arithmatex in generic mode: arithmatex writes
// inline math as \( ... \) and display math ($$ ... $$) as \[ ... \], each inside an
// element of class "arithmatex"; MathJax typesets only those elements. The MathJax
// component itself (tex-svg.js) is vendored in javascripts/vendor/mathjax/ and loaded
// after this file (mkdocs.yml, extra_javascript).
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex"
  }
};

// Material's instant navigation swaps pages without reloading: typeset each new page.
document$.subscribe(() => {
  MathJax.typesetPromise && MathJax.typesetPromise()
})
