"""The anywidget views. Each class's front end is one Svelte file in js/src/views/."""

from .attention import AttentionPatterns
from .base import CircuitWidget
from .colored_tokens import ColoredTokens
from .composition_matrix import CompositionMatrix
from .eigenvalue_plot import EigenvaluePlot
from .explorer import CircuitExplorer
from .skip_trigram_table import SkipTrigramTable

__all__ = ["AttentionPatterns", "CircuitExplorer", "CircuitWidget", "ColoredTokens", "CompositionMatrix", "EigenvaluePlot", "SkipTrigramTable"]
