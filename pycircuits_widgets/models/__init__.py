"""Models: the paper's attention-only transformer, the weight view, tokenizer, checkpoints.

``load_pretrained(name)`` returns a ``CircuitModel`` (folded weights, see ``circuit_model``)
for one of the shipped checkpoints in ``pycircuits_widgets/checkpoints/``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..progress import progress
from .activation_cache import ActivationCache
from .adapters import CheckpointModel, from_hf, from_safetensors, from_transformer_lens
from .attn_only import AttnOnlyTransformer, attn_only_config
from .checkpoints import CheckpointError, load_json, load_tensors
from .circuit_model import CircuitModel
from .config import ModelConfig
from .folding import fold_attn_only
from .interventions import Interventions
from .rotary import rotary_frequencies
from .tokenizer import Tokenizer

CHECKPOINT_DIR = Path(__file__).resolve().parent.parent / "checkpoints"
PRETRAINED = ("attn-only-0l", "attn-only-1l", "attn-only-2l")

__all__ = ["PRETRAINED", "ActivationCache", "AttnOnlyTransformer", "CheckpointError", "CheckpointModel", "CircuitModel",
           "Interventions", "ModelConfig", "Tokenizer", "attn_only_config", "from_attn_only", "from_hf",
           "from_safetensors", "from_transformer_lens", "load_attn_only", "load_pretrained", "rotary_frequencies",
           "weight_view_hint"]


def from_attn_only(model: AttnOnlyTransformer, tokenizer: Tokenizer | None = None) -> CircuitModel:
    """The folded weight view of a trained ``AttnOnlyTransformer``."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    return CircuitModel(model.cfg, tokenizer=tokenizer, **fold_attn_only(params, model.cfg))


def load_attn_only(weights: str | Path, config: str | Path,
                   tokenizer: str | Path | None = None) -> tuple[AttnOnlyTransformer, dict, Tokenizer | None]:
    """Load the raw trained model from ``weights`` (safetensors) + ``config`` (JSON), checking that
    shapes match the config and (when given) that the tokenizer is the one it was trained with."""
    meta = load_json(config)
    if "config" not in meta:
        raise CheckpointError(f"checkpoint config {config} has no 'config' entry")
    try:
        cfg = ModelConfig.from_dict(meta["config"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint config {config}: {err}") from err
    with torch.device("meta"):  # shapes only: nothing the config sizes is allocated before the header check
        expected = {name: tuple(p.shape) for name, p in AttnOnlyTransformer(cfg).named_parameters()}
    tensors = load_tensors(weights, expected)
    file_size = sum(t.numel() for t in tensors.values())
    if cfg.n_ctx * cfg.d_model > file_size:  # the positional table is computed, not stored
        raise CheckpointError(f"checkpoint config {config}: n_ctx * d_model = {cfg.n_ctx} * {cfg.d_model} asks for "
                              f"a positional table larger than all {file_size} weights in {weights}")
    model = AttnOnlyTransformer(cfg)
    model.load_state_dict(tensors, strict=False)
    tok = None
    if tokenizer is not None:
        tok = Tokenizer.load(tokenizer)
        if tok.vocab_size != cfg.d_vocab or tok.fingerprint() != meta.get("tokenizer_fingerprint"):
            raise CheckpointError(f"tokenizer {tokenizer} (vocab {tok.vocab_size}, fingerprint {tok.fingerprint()}) "
                                  f"does not match checkpoint {config} (d_vocab {cfg.d_vocab}, fingerprint "
                                  f"{meta.get('tokenizer_fingerprint')})")
    return model, meta, tok


def load_pretrained(name: str) -> CircuitModel:
    """One of the shipped models, ``"attn-only-0l"``, ``"attn-only-1l"``, ``"attn-only-2l"``, as a
    ``CircuitModel`` (float32; stored as float16). ``model.metadata`` holds the training record
    (corpus sha256, validation loss, training arguments)."""
    if not isinstance(name, str):
        raise TypeError(f"load_pretrained takes the name of a shipped model ({', '.join(PRETRAINED)}), "
                        f"got {type(name).__name__}{weight_view_hint(name)}")
    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained model {name!r}; valid names: {', '.join(PRETRAINED)}"
                         f"{weight_view_hint(name)}")
    with progress(f"load_pretrained {name}", total=2, unit="step") as bar:
        bar.note("reading the checkpoint")
        raw, meta, tok = load_attn_only(CHECKPOINT_DIR / f"{name}.safetensors", CHECKPOINT_DIR / f"{name}.json",
                                        CHECKPOINT_DIR / "tokenizer.json")
        bar.update()
        bar.note("folding into a weight view")
        model = from_attn_only(raw, tok)
        bar.update()
    model.metadata = meta
    return model


def weight_view_hint(value) -> str:
    """The clause an error appends when ``value`` is a model in another library's form, or the name
    of one, instead of a weight view: how to read it (``pcw.from_hf``, ``pcw.from_transformer_lens``);
    "" for anything else."""
    if isinstance(value, str):
        return (f". For a Hugging Face model ({value!r} as a hub name or a local folder) use "
                f"pcw.from_hf({value!r}): it loads the model and its tokenizer with transformers and reads them")
    if isinstance(value, torch.nn.Module) and hasattr(value, "config"):
        return (f". {type(value).__name__} is a Hugging Face model: read it through pcw.from_hf(model, tokenizer) "
                "(the tokenizer: transformers.AutoTokenizer.from_pretrained of the same name)")
    if isinstance(value, torch.nn.Module) and type(value).__module__.startswith("transformer_lens"):
        return f". {type(value).__name__} is a TransformerLens model: read it through pcw.from_transformer_lens(model)"
    return ""
