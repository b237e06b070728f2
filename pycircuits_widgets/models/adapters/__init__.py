"""Adapters from other libraries into the ``CircuitModel`` weight view.

``from_transformer_lens(model)`` (TransformerLens ``TransformerBridge`` / ``HookedTransformer``) and
``from_hf(model, tokenizer)`` (Hugging Face GPT-2, GPT-NeoX, LLaMA). Both fold the norms, keep the
source's biases in the forward, repeat grouped-query K/V per query head (``cfg.n_kv_heads``
records the sharing) and describe rotary models with ``cfg.positional == "rotary"``.
Neither library is imported until an adapter is called with one of its models.
"""

from .hf import from_hf
from .transformer_lens import from_transformer_lens

__all__ = ["from_hf", "from_transformer_lens"]
