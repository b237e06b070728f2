"""One module per view, the explorer, and the explorer's view registry (``registry``). Imports ``core`` only."""
