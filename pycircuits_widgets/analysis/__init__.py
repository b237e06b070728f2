"""The analysis core: pure functions of a model (no widgets, IPython or anywidget here).

Modules: ``circuits`` (OV/QK/full circuits, composition terms, MLP paths, tensor-product
terms), ``eigen`` (eigenvalue positivity), ``composition`` (Q/K/V composition scores),
``skip_trigrams``, ``activations`` (``run``), ``path_expansion``, ``head_scores``, ``induction`` (one
pair's induction mechanism), ``positional`` (attention by relative offset), ``virtual_heads``
(V-composition), ``bigrams`` (the direct path's top next tokens), ``neurons`` (MLP neuron activations and token circuits),
``ablation`` (heads and neurons removed from a forward, the loss change), ``path_patching`` (one head's
output removed from one later head's query, key or value; measured composition), ``patching`` (a
counterfactual ``Task`` and exact activation patching between its clean and corrupted runs),
``attribution`` (attribution patching: the first-order estimate of every cell of a site at once),
``edges`` (edge attribution patching, EAP and EAP-IG, a circuit of the top edges and its exact faithfulness),
``effective_embedding`` (the token representation a deeper layer's heads read: ``W_E``, ``W_E`` through
block 0, or a corpus's mean stream).
"""

from .ablation import AblationResult, ablate, head_loss_changes
from .activations import RunResult, run
from .attribution import Agreement, AttributionResult, attribution_patch
from .bigrams import bigram_top
from .circuits import (
    TensorProductTerm,
    direct_path,
    embedding,
    embedding_note,
    full_ov_circuit,
    full_qk_circuit,
    full_virtual_ov_circuit,
    head_mlp_circuit,
    k_composition_circuit,
    mlp_in_circuit,
    mlp_out_circuit,
    ov,
    positional_qk_circuit,
    q_composition_circuit,
    qk,
    virtual_head_ov,
)
from .composition import CompositionDetail, composition_detail, composition_scores, random_baseline, strongest_writers
from .edges import Circuit, EdgeAttribution, Faithfulness, edge_attribution
from .effective_embedding import EffectiveEmbedding, effective_embedding
from .eigen import eigenvalue_positivity, eigenvalues
from .head_scores import head_scores
from .induction import (
    InductionPair,
    PairVerdict,
    classify_pair,
    induction_pair,
    k_composition_positivity,
    pair_verdicts,
)
from .neurons import neuron_activations, neuron_out_norms, neuron_terms
from .patching import PatchResult, Task, activation_patch
from .path_expansion import NonlinearFeatureError, PathExpansion, PathTerm, path_expansion
from .path_patching import PathPatchResult, measured_composition, path_patch
from .positional import attention_by_offset, positional_scores_by_offset
from .skip_trigrams import SkipTrigram, circuit_query, skip_trigrams
from .virtual_heads import VirtualHead, top_virtual_heads

__all__ = [
    "AblationResult",
    "Agreement",
    "AttributionResult",
    "Circuit",
    "CompositionDetail",
    "EdgeAttribution",
    "EffectiveEmbedding",
    "Faithfulness",
    "InductionPair",
    "NonlinearFeatureError",
    "PairVerdict",
    "PatchResult",
    "PathExpansion",
    "PathPatchResult",
    "PathTerm",
    "RunResult",
    "SkipTrigram",
    "Task",
    "TensorProductTerm",
    "VirtualHead",
    "ablate",
    "activation_patch",
    "attention_by_offset",
    "attribution_patch",
    "bigram_top",
    "circuit_query",
    "classify_pair",
    "composition_detail",
    "composition_scores",
    "direct_path",
    "edge_attribution",
    "effective_embedding",
    "eigenvalue_positivity",
    "eigenvalues",
    "embedding",
    "embedding_note",
    "full_ov_circuit",
    "full_qk_circuit",
    "full_virtual_ov_circuit",
    "head_loss_changes",
    "head_mlp_circuit",
    "head_scores",
    "induction_pair",
    "k_composition_circuit",
    "k_composition_positivity",
    "measured_composition",
    "mlp_in_circuit",
    "mlp_out_circuit",
    "neuron_activations",
    "neuron_out_norms",
    "neuron_terms",
    "ov",
    "pair_verdicts",
    "path_expansion",
    "path_patch",
    "positional_qk_circuit",
    "positional_scores_by_offset",
    "q_composition_circuit",
    "qk",
    "random_baseline",
    "run",
    "skip_trigrams",
    "strongest_writers",
    "top_virtual_heads",
    "virtual_head_ov",
]
