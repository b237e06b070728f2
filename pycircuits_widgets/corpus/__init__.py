"""Corpus work: documents and their windows (``documents``, ``windows``), what a sweep records per batch
(``record``) and how it merges (``accumulators``), the store on disk (``store``), the engines (``engines``:
serial; ``ray_engine``), the sweep and its reader (``sweeps``). Imports the analysis and the models, never
the widgets; views read a ``Sweep``, never run one."""

from .documents import Corpus, CorpusError
from .store import StoreMismatch
from .sweeps import Sweep, SweepProgress, head_scores, model_fingerprint, sweep

__all__ = ["Corpus", "CorpusError", "StoreMismatch", "Sweep", "SweepProgress", "head_scores", "model_fingerprint",
           "sweep"]
