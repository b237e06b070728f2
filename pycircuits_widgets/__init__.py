"""pycircuits_widgets: reverse-engineer transformer circuits interactively in Jupyter.

The public API (see README) is exported lazily, so that ``import pycircuits_widgets``
stays cheap and the analysis core can be used without IPython or anywidget.
"""

import sys
from importlib import import_module

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "FactoredMatrix": "pycircuits_widgets.factored",
    "NonFiniteError": "pycircuits_widgets.linalg",
    "load_pretrained": "pycircuits_widgets.models",
    "from_transformer_lens": "pycircuits_widgets.models",
    "from_hf": "pycircuits_widgets.models",
    "from_safetensors": "pycircuits_widgets.models",
    "CheckpointError": "pycircuits_widgets.models",
    "run": "pycircuits_widgets.analysis",
    "composition_scores": "pycircuits_widgets.analysis",
    "eigenvalue_positivity": "pycircuits_widgets.analysis",
    "skip_trigrams": "pycircuits_widgets.analysis",
    "head_scores": "pycircuits_widgets.corpus",  # analysis.head_scores, or over a Corpus a scores-only sweep
    "ablate": "pycircuits_widgets.analysis",
    "head_loss_changes": "pycircuits_widgets.analysis",
    "path_patch": "pycircuits_widgets.analysis",
    "measured_composition": "pycircuits_widgets.analysis",
    "Task": "pycircuits_widgets.analysis",
    "activation_patch": "pycircuits_widgets.analysis",
    "attribution_patch": "pycircuits_widgets.analysis",
    "edge_attribution": "pycircuits_widgets.analysis",
    "effective_embedding": "pycircuits_widgets.analysis",
    "Corpus": "pycircuits_widgets.corpus",
    "CorpusError": "pycircuits_widgets.corpus",
    "StoreMismatch": "pycircuits_widgets.corpus",
    "StoreCorrupt": "pycircuits_widgets.corpus",
    "sweep": "pycircuits_widgets.corpus",
    "Sweep": "pycircuits_widgets.corpus",
    "trigram_counts": "pycircuits_widgets.corpus",
    "ColoredTokens": "pycircuits_widgets.widgets",
    "AttentionPatterns": "pycircuits_widgets.widgets",
    "SkipTrigramTable": "pycircuits_widgets.widgets",
    "CompositionMatrix": "pycircuits_widgets.widgets",
    "EigenvaluePlot": "pycircuits_widgets.widgets",
    "CircuitExplorer": "pycircuits_widgets.widgets",
    "PathExpansion": "pycircuits_widgets.widgets",
    "InductionMechanism": "pycircuits_widgets.widgets",
    "PositionalQK": "pycircuits_widgets.widgets",
    "VirtualHeads": "pycircuits_widgets.widgets",
    "BigramTable": "pycircuits_widgets.widgets",
    "NeuronView": "pycircuits_widgets.widgets",
    "DatasetExamples": "pycircuits_widgets.widgets",
    "CausalChecks": "pycircuits_widgets.widgets",
    "TaskCircuit": "pycircuits_widgets.widgets",
}

# subpackages reachable as attributes (``pcw.analysis``) without an explicit import
_SUBMODULES = ("analysis", "corpus", "factored", "models", "screen", "widgets")

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (the lazy exports' one list: _EXPORTS)


def _import(module: str):
    """``module``, imported. The first import that brings in torch takes seconds (13 s measured in a
    fresh notebook on a cold disk), so it shows a bar while it runs: the first cell is not silent."""
    if "torch" in sys.modules:
        return import_module(module)
    from .progress import progress

    with progress("pycircuits_widgets", total=1, unit="step", delay=0) as bar:
        bar.note("importing torch and the analysis core (first use; seconds on a cold start)")
        imported = import_module(module)
        bar.update()
    return imported


def __getattr__(name):
    if name in _SUBMODULES:
        value = _import(f"{__name__}.{name}")
    elif name in _EXPORTS:
        value = getattr(_import(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'pycircuits_widgets' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
