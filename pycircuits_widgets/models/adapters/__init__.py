"""Adapters from other libraries into the ``CircuitModel`` weight view.

``from_transformer_lens(model)`` (TransformerLens ``TransformerBridge`` / ``HookedTransformer``) and
``from_hf(model, tokenizer)`` (Hugging Face causal LMs of the families in ``families.py``) fold the
norms, keep the source's biases in the forward, repeat grouped-query K/V per query head
(``cfg.n_kv_heads`` records the sharing) and describe rotary models with
``cfg.positional == "rotary"``. ``from_safetensors(folder)`` gives ``from_hf``'s weight view of a
checkpoint folder of those families, read layer by layer (weights only, no forward).
Neither library is imported until an adapter is called with one of its models.
"""

from .checkpoint_model import CheckpointModel, from_safetensors
from .hf import from_hf
from .transformer_lens import from_transformer_lens

__all__ = ["CheckpointModel", "from_hf", "from_safetensors", "from_transformer_lens"]
