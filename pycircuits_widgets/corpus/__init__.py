"""Corpus work: documents and their windows (``documents``, with ``globs`` for file patterns; ``windows``),
the check of count arguments (``arguments``), what a sweep records per batch
(``record``) and how it merges (``accumulators``), the store on disk (``store``), memory handed back between shards (``memory``), the engines (``engines``:
serial; ``ray_engine``), the sweep and its reader (``sweeps``). Imports the analysis and the models, never
the widgets; views read a ``Sweep``, never run one. ``trigram_counts``: a head's skip-trigrams counted
over a sweep's windows."""

from .documents import Corpus, CorpusError
from .store import StoreCorrupt, StoreMismatch
from .sweeps import Sweep, SweepProgress, head_scores, model_fingerprint, sweep
from .trigram_counts import TrigramCounts, trigram_counts

__all__ = ["Corpus", "CorpusError", "StoreCorrupt", "StoreMismatch", "Sweep", "SweepProgress", "TrigramCounts", "head_scores",
           "model_fingerprint", "sweep", "trigram_counts"]
