"""ModelConfig: the shape and architecture facts every model in the weight view shares."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

POSITIONAL = ("shortformer", "learned", "rotary", "none")
NORMALIZATION = ("layernorm", "rmsnorm", None)
ACT_FNS = ("gelu", "gelu_new", "relu", "silu")


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer as seen by the weight view.

    ``positional`` says where position enters:
      * ``"shortformer"``: a fixed table ``W_pos [n_ctx, d_model]`` is added to the inputs of
        ``W_Q`` and ``W_K`` only (after the layer norm), so the residual stream carries token
        identity alone (the paper's models);
      * ``"learned"``: ``W_pos`` is added to the residual stream with the token embedding;
      * ``"rotary"``: queries and keys are rotated (GPT-NeoX ``rotate_half`` layout) over the
        first ``rotary_dim`` dimensions of each head, base ``rotary_base``;
      * ``"none"``: no positional information.

    ``normalization`` is what happens where a layer reads the residual stream
    (``None`` = read it as is). ``n_kv_heads`` only records grouped-query attention of the
    source model: the weight view always stores one ``W_K``/``W_V`` per query head.
    ``attn_scale`` divides the attention scores (default ``sqrt(d_head)``). ``pos_scale`` is the
    amplitude of the paper-model's sinusoidal table (``AttnOnlyTransformer``; the weight view's
    ``W_pos`` already includes it).
    ``parallel_attn_mlp`` (GPT-NeoX, GPT-J): the MLP of a layer reads the same residual stream as
    its attention, ``x + attn(x) + mlp(x)``, instead of ``x + attn(x)``.
    ``b_in_outside_gate`` (gated MLPs): where ``b_in`` is added. False (Hugging Face, the
    TransformerLens 4.x bridge): ``act(x W_gate) * (x W_in + b_in)``; True (TransformerLens 2.x
    ``GatedMLP``): ``act(x W_gate) * (x W_in) + b_in``.
    ``rotary_scale`` (linear RoPE scaling, Hugging Face ``rope_type="linear"``): rotary angles use
    ``position / rotary_scale``.
    """

    n_layers: int
    n_heads: int
    d_model: int
    d_head: int
    d_vocab: int
    n_ctx: int
    n_kv_heads: int | None = None
    positional: str = "shortformer"
    normalization: str | None = "layernorm"
    attn_only: bool = True
    d_mlp: int | None = None
    act_fn: str | None = None
    gated_mlp: bool = False
    name: str = "model"
    eps: float = 1e-5
    attn_scale: float | None = None
    rotary_dim: int | None = None
    rotary_base: float = 10000.0
    pos_scale: float = 1.0
    parallel_attn_mlp: bool = False
    b_in_outside_gate: bool = False
    rotary_scale: float = 1.0

    def __post_init__(self):
        for field in ("n_heads", "d_model", "d_head", "d_vocab", "n_ctx"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if not isinstance(self.n_layers, int) or self.n_layers < 0:
            raise ValueError(f"ModelConfig.n_layers must be an int >= 0, got {self.n_layers!r}")
        if self.positional not in POSITIONAL:
            raise ValueError(f"ModelConfig.positional must be one of {POSITIONAL}, got {self.positional!r}")
        if self.normalization not in NORMALIZATION:
            raise ValueError(
                f"ModelConfig.normalization must be one of {NORMALIZATION}, got {self.normalization!r}"
            )
        if self.attn_only and self.d_mlp is not None:
            raise ValueError("ModelConfig: an attention-only model has d_mlp=None")
        if not self.attn_only:
            if not isinstance(self.d_mlp, int) or self.d_mlp < 1:
                raise ValueError(f"ModelConfig.d_mlp must be a positive int with MLPs, got {self.d_mlp!r}")
            if self.act_fn not in ACT_FNS:
                raise ValueError(f"ModelConfig.act_fn must be one of {ACT_FNS}, got {self.act_fn!r}")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ValueError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if not (isinstance(self.rotary_scale, (int, float)) and math.isfinite(self.rotary_scale)
                and self.rotary_scale > 0):
            raise ValueError(f"ModelConfig.rotary_scale must be a finite number > 0, got {self.rotary_scale!r}")
        if self.attn_scale is None:
            self.attn_scale = math.sqrt(self.d_head)
        if self.positional == "rotary" and self.rotary_dim is None:
            self.rotary_dim = self.d_head

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """Build from a dict (e.g. a checkpoint's JSON); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)
