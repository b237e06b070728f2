"""Adapters from other libraries into the ``CircuitModel`` weight view.

``from_transformer_lens(model)`` (TransformerLens ``TransformerBridge`` / ``HookedTransformer``) and
``from_hf(model, tokenizer)`` (every Hugging Face decoder family in ``families.FAMILIES``, one
declarative entry each). Both fold the norms, keep the source's biases in the forward, repeat
grouped-query K/V per query head (``cfg.n_kv_heads`` records the sharing) and describe rotary
models with ``cfg.positional == "rotary"``; both verify the translation at load (``verify.py``).
``from_safetensors(folder)`` gives ``from_hf``'s weight view of a checkpoint folder of those
families, read layer by layer (weights only, no forward).
Neither library is imported until an adapter is called with one of its models.
"""

from .checkpoint_model import CheckpointModel, from_safetensors
from .hf import from_hf
from .transformer_lens import from_transformer_lens
from .verify import TranslationError

__all__ = ["CheckpointModel", "TranslationError", "from_hf", "from_safetensors", "from_transformer_lens"]
