"""ModelConfig: the shape and architecture facts every model in the weight view shares."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

POSITIONAL = ("shortformer", "learned", "rotary", "none")
NORMALIZATION = ("layernorm", "rmsnorm", None)
ACT_FNS = ("gelu", "gelu_new", "relu", "silu", "relu2")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
QK_NORMS = ("rmsnorm", "layernorm", None)
_INT_FIELDS = ("n_layers", "n_heads", "d_model", "d_head", "d_vocab", "n_ctx", "n_kv_heads", "d_mlp", "rotary_dim",
               "n_experts", "experts_per_token")


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

    Features of other decoder families (defaults: off, the forward above unchanged). Each is one
    step of ``CircuitModel``'s forward; ``nonlinear_features`` lists those that are not a linear
    map on the residual stream, which the analyses read:

    * ``rope`` (Hugging Face rope parameters: ``rope_type`` one of ``ROPE_TYPES`` and its fields,
      e.g. ``factor``, ``original_max_position_embeddings``, ``low_freq_factor``): the frequency
      rule; ``layer_rope`` (one such dict per layer, with ``rope_theta``) overrides it per layer
      (Gemma 3's local/global bases); ``rotary_layers`` (one bool per layer) says which layers
      rotate at all (SmolLM3's no-rotary layers). ``models.rotary.rotary_frequencies(cfg, layer)``
      is the one function that turns these into a layer's inverse frequencies and scaling.
    * ``window`` (one int or None per layer): sliding-window attention, a query at ``i`` sees keys
      ``j`` with ``i - window < j <= i``.
    * ``qk_norm``: a norm of each query and key before rotary (``w_qnorm/w_knorm`` weights);
      ``qk_norm_heads`` False normalises all heads of a position together (OLMo 2).
    * ``post_norms``: the attention and MLP outputs are normalised (``w_post_attn``,
      ``w_post_mlp``) before they are added to the residual stream (Gemma 2/3, OLMo 2);
      ``pre_norm`` False: layers read the residual stream as is (only the unembedding normalises).
    * ``attn_softcap`` / ``final_softcap``: ``cap * tanh(x / cap)`` of the attention scores /
      the logits (Gemma 2).
    * ``alibi_slopes`` (one float per head): ALiBi, ``slope_h * (j - i)`` added to the score of
      key ``j`` from query ``i`` (BLOOM, MPT).
    * ``clip_qkv``: queries, keys and values are clamped to ``[-clip_qkv, clip_qkv]`` (OLMo, MPT).
    * ``n_experts`` / ``experts_per_token``: a mixture-of-experts MLP (Mixtral). ``W_in``, ``W_gate``
      and ``W_out`` hold the experts side by side (``d_mlp = n_experts * d_expert``, expert ``e``'s
      neurons at ``e * d_expert ...``); the router ``W_router [L, d_model, n_experts]`` picks the top
      ``experts_per_token`` experts of each token (softmax, renormalised over those chosen), and each
      expert's neurons are multiplied by its weight (zero for experts not chosen).
    Multipliers, norm offsets and embedding scales fold into the weights at load (no field).
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
    rope: dict | None = None
    layer_rope: list | None = None
    rotary_layers: list | None = None
    window: list | None = None
    qk_norm: str | None = None
    qk_norm_heads: bool = True
    post_norms: bool = False
    pre_norm: bool = True
    attn_softcap: float | None = None
    final_softcap: float | None = None
    alibi_slopes: list | None = None
    clip_qkv: float | None = None
    n_experts: int | None = None
    experts_per_token: int | None = None

    def __post_init__(self):
        for field in _INT_FIELDS:  # bool is an int subclass: True would pass for 1
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"ModelConfig.{field} must be an int, got {value!r} ({type(value).__name__})")
        for field in ("n_heads", "d_model", "d_head", "d_vocab", "n_ctx"):
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.n_layers < 0:
            raise ValueError(f"ModelConfig.n_layers must be an int >= 0, got {self.n_layers!r}")
        for field in ("attn_only", "gated_mlp", "parallel_attn_mlp", "b_in_outside_gate", "qk_norm_heads",
                      "post_norms", "pre_norm"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"ModelConfig.{field} must be a bool, got {getattr(self, field)!r}")  # noqa: TRY004
        _positive_finite("eps", self.eps, allow_zero=True)
        _positive_finite("pos_scale", self.pos_scale)
        _positive_finite("rotary_base", self.rotary_base)
        if self.attn_scale is not None:
            _positive_finite("attn_scale", self.attn_scale)
        for field in ("attn_softcap", "final_softcap", "clip_qkv"):
            if getattr(self, field) is not None:
                _positive_finite(field, getattr(self, field))
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"ModelConfig.qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.qk_norm is not None and self.normalization is None:
            raise ValueError("ModelConfig.qk_norm needs a normalization for its eps (normalization=None given)")
        if self.post_norms and self.normalization is None:
            raise ValueError("ModelConfig.post_norms needs normalization='layernorm' or 'rmsnorm'")
        for rope in [self.rope] + list(self.layer_rope or []):
            if rope is not None:
                _check_rope(rope)
        for field, kind in (("layer_rope", dict), ("rotary_layers", bool), ("window", int)):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or len(value) != self.n_layers:
                raise ValueError(f"ModelConfig.{field} must be a list of one entry per layer ({self.n_layers}), "
                                 f"got {value!r}")
            bad = [v for v in value if not (v is None or (isinstance(v, kind) and not (kind is int and
                                                                                          isinstance(v, bool))))]
            if bad or (kind is int and any(v is not None and v < 1 for v in value)):
                raise ValueError(f"ModelConfig.{field} entries must be {kind.__name__} (or None), got {value!r}")
        if self.n_experts is not None:
            k = self.experts_per_token
            if self.attn_only or self.d_mlp % self.n_experts or k is None or not 1 <= k <= self.n_experts:
                raise ValueError(f"ModelConfig: a mixture of n_experts={self.n_experts} needs MLPs, d_mlp={self.d_mlp} "
                                 f"a multiple of it and 1 <= experts_per_token <= n_experts (got {k!r})")
        if self.alibi_slopes is not None:
            if len(self.alibi_slopes) != self.n_heads:
                raise ValueError(f"ModelConfig.alibi_slopes needs one slope per head ({self.n_heads}), "
                                 f"got {len(self.alibi_slopes)}")
            for slope in self.alibi_slopes:
                if isinstance(slope, bool) or not isinstance(slope, (int, float)) or not math.isfinite(slope):
                    raise ValueError(f"ModelConfig.alibi_slopes must be finite numbers, got {slope!r}")
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
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.d_head and self.rotary_dim % 2 == 0):
            raise ValueError(f"ModelConfig.rotary_dim must be even and in 2..d_head={self.d_head}, "
                             f"got {self.rotary_dim}")

    @property
    def nonlinear_features(self) -> tuple[str, ...]:
        """The forward's steps that are not linear maps on the residual stream (with the attention
        patterns and the norms' divisions frozen), beyond what every transformer has: ``"qk_norm"``
        (QK circuits are before the query/key norm), ``"post_norms"`` (a head's write is divided by
        a norm of the whole layer's output), ``"attn_softcap"``, ``"final_softcap"`` (logits are
        ``cap * tanh(. / cap)`` of the linear readout), ``"clip_qkv"`` (OV and QK hold where no query,
        key or value coordinate reaches the clamp), ``"moe"`` (an MLP neuron's activation is scaled by
        its expert's routing weight for the token, zero when the expert is not chosen). ALiBi and sliding windows are positional
        terms (the QK circuit is unchanged; only which keys, and a per-offset bias, differ)."""
        names = []
        if self.qk_norm is not None:
            names.append("qk_norm")
        if self.post_norms:
            names.append("post_norms")
        if self.attn_softcap is not None:
            names.append("attn_softcap")
        if self.final_softcap is not None:
            names.append("final_softcap")
        if self.clip_qkv is not None:
            names.append("clip_qkv")
        if self.n_experts is not None:
            names.append("moe")
        return tuple(names)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """Build from a dict (e.g. a checkpoint's JSON); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)


def _positive_finite(field: str, value, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero) or value > 1e15:
        expected = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"ModelConfig.{field} must be {expected} (at most 1e15), got {value!r}")


def _check_rope(rope: dict) -> None:
    if not isinstance(rope, dict):
        raise ValueError(f"ModelConfig rope parameters must be a dict, got {rope!r}")  # noqa: TRY004
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"ModelConfig: rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")


def short_name(name: str) -> str:
    """A model's name as its user calls it: the last part of a path or hub id
    (``/home/me/models/SmolLM-135M/`` -> ``SmolLM-135M``; a site-packages path -> its folder's name).
    The loaders name a model so (``ModelConfig.name``): no folder of the author's machine reaches a
    store, a caption or a saved page."""
    name = str(name).rstrip("/\\")
    return name.replace("\\", "/").rsplit("/", 1)[-1] or name


def named(model, name):
    """``model`` with ``cfg.name`` set to ``name`` (a loader's ``name=``; None keeps the loader's own),
    refused unless a non-empty one-line string."""
    if name is None:
        return model
    if not isinstance(name, str) or not name.strip() or "\n" in name:
        raise ValueError(f"name must be a non-empty one-line string (how captions, stores and pages name the "
                         f"model), got {name!r}")
    model.cfg.name = name
    return model
