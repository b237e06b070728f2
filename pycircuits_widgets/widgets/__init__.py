"""The anywidget views. Each class's front end is one Svelte file in js/src/views/."""

from .attention import AttentionPatterns
from .base import CircuitWidget
from .bigram_table import BigramTable
from .colored_tokens import ColoredTokens
from .composition_matrix import CompositionMatrix
from .eigenvalue_plot import EigenvaluePlot
from .explorer import CircuitExplorer
from .induction_mechanism import InductionMechanism
from .path_expansion_view import PathExpansion
from .positional_qk import PositionalQK
from .skip_trigram_table import SkipTrigramTable
from .virtual_heads_view import VirtualHeads

__all__ = ["AttentionPatterns", "BigramTable", "CircuitExplorer", "CircuitWidget", "ColoredTokens", "CompositionMatrix",
           "EigenvaluePlot", "InductionMechanism", "PathExpansion", "PositionalQK", "SkipTrigramTable", "VirtualHeads"]
