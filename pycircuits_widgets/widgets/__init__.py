"""The anywidget views. Each class's front end is one Svelte file in js/src/views/.

Layers (imports point one way: ``views`` -> ``core``, ``sharing`` -> ``core``; ``core`` imports
neither at module import):

* ``core/``: what every view is made of: the base class (``base``), the selection traits
  (``selection``), the runner of recomputes (``runner``), the run an explorer shows (``shown_run``), the view mixins (``on_demand``,
  ``text_data``, ``offset_window``), the wire format (``payload``), kernel-less answers
  (``offline``) and the front-end bundle (``bundle``);
* ``views/``: one module per view, the explorer, and the explorer's view registry (``registry``);
* ``sharing/``: pages and pictures without a kernel (``standalone``, ``notebook_export``,
  ``pictures``, ``fallback``).
"""

from .core.base import CircuitWidget
from .views.attention import AttentionPatterns
from .views.bigram_table import BigramTable
from .views.causal_checks import CausalChecks
from .views.colored_tokens import ColoredTokens
from .views.composition_matrix import CompositionMatrix
from .views.dataset_examples import DatasetExamples
from .views.eigenvalue_plot import EigenvaluePlot
from .views.explorer import CircuitExplorer
from .views.induction_mechanism import InductionMechanism
from .views.neurons import NeuronView
from .views.path_expansion import PathExpansion
from .views.positional_qk import PositionalQK
from .views.skip_trigram_table import SkipTrigramTable
from .views.task_circuit import TaskCircuit
from .views.virtual_heads import VirtualHeads

__all__ = ["AttentionPatterns", "BigramTable", "CausalChecks", "CircuitExplorer", "CircuitWidget", "ColoredTokens", "CompositionMatrix",
           "DatasetExamples", "EigenvaluePlot", "InductionMechanism", "NeuronView", "PathExpansion", "PositionalQK", "SkipTrigramTable", "TaskCircuit",
           "VirtualHeads"]
