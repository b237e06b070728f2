"""Pages and pictures that need no kernel: standalone HTML, notebook export, static pictures and fallbacks.
Imports ``core`` only."""
