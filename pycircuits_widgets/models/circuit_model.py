"""CircuitModel: the one weight view every model is analysed through.

Weights (row-vector convention, ``x @ W``), with **layer norm folded in** (``folding.py``):
centering is folded into the weights that write the residual stream and every learned scale
into the weight that reads it, so circuits read directly from these tensors, e.g.
``W_E @ OV[l, h] @ W_U``, are the paper's circuits. The only part of normalization left is
the division by the norm, one scalar per position and read, reported as ``cache.ln_scale``.

=============  ===================================  ==========================================
attribute      shape                                meaning
=============  ===================================  ==========================================
``W_E``        ``[d_vocab, d_model]``               token embedding (writes the residual)
``W_U``        ``[d_model, d_vocab]``               unembedding (final scale folded in)
``W_pos``      ``[n_ctx, d_model]`` or None         "shortformer": table added to the inputs of
                                                    W_Q and W_K only; "learned": added to the
                                                    residual stream; None otherwise
``W_Q/K/V``    ``[n_layers, n_heads, d_model,       per head; grouped-query models repeat the
               d_head]``                            shared K/V heads
``W_O``        ``[n_layers, n_heads, d_head,
               d_model]``
``W_in``       ``[n_layers, d_model, d_mlp]``       None when attention-only (``W_gate`` same
``W_out``      ``[n_layers, d_mlp, d_model]``       shape, gated MLPs only)
``b_*``        ``b_Q/b_K/b_V [L, H, d_head]``,      optional biases (None in the paper's models)
               ``b_O [L, d_model]``, ``b_in [L,
               d_mlp]``, ``b_out [L, d_model]``,
               ``b_U [d_vocab]``, ``b_gate [L,
               d_mlp]``
``w_qnorm``,   ``[L, H, d_head]`` (``b_qnorm``,     QK-norm scale (and bias) per query / key
``w_knorm``    ``b_knorm`` optional)                head, ``cfg.qk_norm`` only
``w_post_*``   ``w_post_attn/w_post_mlp [L,         post-norm scales, ``cfg.post_norms`` only
               d_model]``
``W_router``   ``[L, d_model, n_experts]``          mixture of experts only (``cfg.n_experts``)
``OV``         FactoredMatrix ``[L, H]`` of         ``W_V @ W_O`` (paper: ``W_O W_V``)
               ``d_model x d_model``
``QK``         FactoredMatrix ``[L, H]`` of         ``W_Q @ W_K^T`` (paper: ``W_Q^T W_K``);
               ``d_model x d_model``                for rotary models the position-free part
=============  ===================================  ==========================================

An adapter fills a ``ModelConfig``, these tensors (already folded, see ``folding``) and a
tokenizer exposing ``encode(str) -> list[int]`` and ``display_token(id) -> str``. The forward pass over
them (``run_with_cache``, interventions, resumption) is ``forward.Forward``; what it records,
``activation_cache.ActivationCache``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..factored import FactoredMatrix
from .config import ModelConfig
from .forward import Forward
from .tokenizer import escape_invisible

_WEIGHTS = ("W_E", "W_U", "W_pos", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "W_gate",
            "b_Q", "b_K", "b_V", "b_O", "b_in", "b_out", "b_U", "b_gate",
            "w_qnorm", "b_qnorm", "w_knorm", "b_knorm", "w_post_attn", "w_post_mlp", "W_router")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_weight(name: str, value, where: str = "CircuitModel") -> None:
    """Refuse a weight that is not a finite floating-point tensor, naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where}: {name} has dtype {str(value.dtype).removeprefix('torch.')}; expected a "
                        "real floating-point tensor (float16, bfloat16, float32 or float64)")
    if value.device.type == "meta":
        raise ValueError(f"{where}: {name} is on the meta device (shapes only, no values); load the weights "
                         "first (e.g. from_pretrained without device_map='meta', or to_empty() then "
                         "load_state_dict())")
    # one sum first (25x cheaper than isfinite at W_E's size; NaN and inf propagate through it); the
    # elementwise check only when the sum is not finite, which also tells a sum that overflowed apart
    if value.numel() and bool(torch.isfinite(value.sum())):
        return
    finite = torch.isfinite(value)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise ValueError(f"{where}: {name} has {int((~finite).sum())} non-finite values (NaN or inf), first at "
                         f"index {tuple(bad)}; weights must be finite")


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...] | None]:
    """Shape of every ``CircuitModel`` weight under ``cfg`` (None: must be absent)."""
    L, H, d, dh = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    mlp = not cfg.attn_only
    return {
        "W_E": (cfg.d_vocab, d), "W_U": (d, cfg.d_vocab),
        "W_pos": (cfg.n_ctx, d) if cfg.positional in ("shortformer", "learned") else None,
        "W_Q": (L, H, d, dh), "W_K": (L, H, d, dh), "W_V": (L, H, d, dh), "W_O": (L, H, dh, d),
        "W_in": (L, d, cfg.d_mlp) if mlp else None, "W_out": (L, cfg.d_mlp, d) if mlp else None,
        "W_gate": (L, d, cfg.d_mlp) if mlp and cfg.gated_mlp else None,
        "b_Q": (L, H, dh), "b_K": (L, H, dh), "b_V": (L, H, dh), "b_O": (L, d),
        "b_in": (L, cfg.d_mlp) if mlp else None, "b_out": (L, d) if mlp else None, "b_U": (cfg.d_vocab,),
        "b_gate": (L, cfg.d_mlp) if mlp and cfg.gated_mlp else None,
        **{name: (L, H, dh) if cfg.qk_norm else None for name in ("w_qnorm", "b_qnorm", "w_knorm", "b_knorm")},
        "w_post_attn": (L, d) if cfg.post_norms else None,
        "w_post_mlp": (L, d) if cfg.post_norms and mlp else None,
        "W_router": (L, d, cfg.n_experts) if cfg.n_experts else None,
    }


class CircuitModel(Forward):
    """The weight view (table in the module docstring). Construct with folded weights."""

    def __init__(self, cfg: ModelConfig, *, tokenizer=None, **weights: torch.Tensor | None):
        unknown = sorted(set(weights) - set(_WEIGHTS))
        if unknown:
            raise TypeError(f"CircuitModel: unknown weights {unknown}; expected some of {list(_WEIGHTS)}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.metadata: dict = {}
        for name in _WEIGHTS:
            setattr(self, name, weights.get(name))
        self._token_strings: list[str] | None = None
        self._check_shapes()

    # --- shapes, dtypes, values -------------------------------------------------------------
    def _check_shapes(self) -> None:
        """Every weight: a floating tensor of the config's shape, one dtype for all, finite values
        (a NaN weight would otherwise come out of eig/top-k as a plausible number)."""
        required = {"W_E", "W_U", "W_Q", "W_K", "W_V", "W_O"}
        c = self.cfg
        if c.positional in ("shortformer", "learned"):
            required.add("W_pos")
        if not c.attn_only:
            required |= {"W_in", "W_out"} | ({"W_gate"} if c.gated_mlp else set())
        if c.qk_norm is not None:
            required |= {"w_qnorm", "w_knorm"}
        if c.post_norms:
            required |= {"w_post_attn"} | (set() if c.attn_only else {"w_post_mlp"})
        if c.n_experts:
            required.add("W_router")
        for name, shape in weight_shapes(c).items():
            value = getattr(self, name)
            if value is None:
                if name in required:
                    raise ValueError(f"CircuitModel: {name} is required for {c.name!r} (shape {shape})")
                continue
            if shape is None:
                raise ValueError(f"CircuitModel: {name} must be None for this config "
                                 f"(positional={c.positional!r}, attn_only={c.attn_only})")
            check_weight(name, value)
            if tuple(value.shape) != shape:
                raise ValueError(f"CircuitModel: {name} has shape {tuple(value.shape)}, expected {shape}")
        dtypes = {name: getattr(self, name).dtype for name in _WEIGHTS if getattr(self, name) is not None}
        if len(set(dtypes.values())) > 1:
            listed = ", ".join(f"{n} {str(d).removeprefix('torch.')}" for n, d in dtypes.items())
            raise ValueError(f"CircuitModel: weights mix dtypes ({listed}); expected one floating dtype for all "
                             "(cast them, e.g. with .to(torch.float32))")

    # --- circuits -------------------------------------------------------------------------
    @property
    def OV(self) -> FactoredMatrix:
        """``W_V @ W_O`` per head: ``[n_layers, n_heads]`` of ``d_model x d_model``, rank <= d_head."""
        return FactoredMatrix(self.W_V, self.W_O)

    @property
    def QK(self) -> FactoredMatrix:
        """``W_Q @ W_K^T`` per head: ``[n_layers, n_heads]`` of ``d_model x d_model``, rank <= d_head.
        Scores are ``x_dest @ QK @ x_src^T / attn_scale`` (plus positional terms)."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-1, -2))

    def vocab_blocks(self) -> list[slice]:
        """The blocks of token ids vocab-sized contractions run over (``token_gram``): one, the whole
        vocabulary; a checkpoint view (``from_safetensors``) reads its embeddings a block at a time."""
        return [slice(None)]

    def token_rows(self, name: str, rows: slice) -> torch.Tensor:
        """``W_E[rows] [n, d_model]`` (``name == "W_E"``) or ``W_U[:, rows] [d_model, n]`` (``"W_U"``): one block
        of ``n`` tokens of the vocabulary."""
        return self.W_E[rows] if name == "W_E" else self.W_U[:, rows]

    @property
    def device(self) -> torch.device:
        return self.W_E.device

    @property
    def dtype(self) -> torch.dtype:
        return self.W_E.dtype

    def to(self, *args, **kwargs) -> CircuitModel:
        """A copy with every weight moved/cast like ``Tensor.to``."""
        moved = {n: getattr(self, n).to(*args, **kwargs) for n in _WEIGHTS if getattr(self, n) is not None}
        model = CircuitModel(self.cfg, tokenizer=self.tokenizer, **moved)
        model.metadata = self.metadata
        return model

    # --- tokens ---------------------------------------------------------------------------
    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.cfg.name!r} has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def to_tokens(self, text: str | list[str]) -> torch.Tensor:
        """``str`` -> ``LongTensor [pos]``; ``list[str]`` of equal token length -> ``[batch, pos]``."""
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            rows = [self.to_tokens(t) for t in text]
            lengths = sorted({len(r) for r in rows})
            if len(lengths) > 1:
                raise ValueError(f"to_tokens: texts tokenize to different lengths {lengths}; "
                                 "pass texts of equal token length (no padding is added)")
            return torch.stack(rows)
        if not isinstance(text, str):
            raise TypeError(f"to_tokens expects a str or a non-empty list of str, got {type(text).__name__}")
        if not text:
            raise ValueError("to_tokens: empty text")
        ids = self._require_tokenizer().encode(text)
        return self._validate_tokens(torch.tensor(ids, dtype=torch.long))

    def to_str_tokens(self, text_or_tokens) -> list[str] | list[list[str]]:
        """Display strings (visible whitespace: see ``tokenizer.VISIBLE_WHITESPACE``) of the
        tokens of a text, or of token ids (``[pos]`` -> list, ``[batch, pos]`` -> list of lists)."""
        tokens = self.to_tokens(text_or_tokens) if isinstance(text_or_tokens, str) else self._as_tokens(text_or_tokens)
        strings = self.token_strings
        if tokens.ndim == 2:
            return [[strings[i] for i in row.tolist()] for row in tokens]
        return [strings[i] for i in tokens.tolist()]

    @property
    def token_strings(self) -> list[str]:
        """Display string of every vocab id, ``[d_vocab]`` (computed once); ``"<id N>"`` for a
        model without a tokenizer, so ids-only models still label their tokens. Whatever the
        tokenizer returns, invisible and bidi characters show as escapes (``escape_invisible``)."""
        if self._token_strings is None:
            tok = self.tokenizer
            show = (lambda i: f"<id {i}>") if tok is None else tok.display_token
            self._token_strings = [escape_invisible(show(i)) for i in range(self.cfg.d_vocab)]
        return self._token_strings

    def _as_tokens(self, tokens) -> torch.Tensor:
        """Text (``str`` / list of ``str``) or token ids (list, tuple, integer tensor or numpy array,
        ``[pos]`` or ``[batch, pos]``) -> validated int64 ids on the model's device, same rank."""
        if isinstance(tokens, str) or (isinstance(tokens, list) and tokens and isinstance(tokens[0], str)):
            return self.to_tokens(tokens)
        if isinstance(tokens, (list, tuple)):
            try:
                tokens = torch.tensor(tokens)
            except (TypeError, ValueError, RuntimeError) as err:
                raise TypeError(f"tokens: token ids must be ints (ragged or non-numeric list given): {err}") from err
        elif isinstance(tokens, np.ndarray):
            if not np.issubdtype(tokens.dtype, np.integer):
                raise TypeError(f"tokens: token ids must be an integer array, got numpy dtype {tokens.dtype}")
            tokens = torch.from_numpy(tokens)
        if not isinstance(tokens, torch.Tensor):
            # bytes/bytearray are not ids: torch would read them as uint8 byte values
            raise TypeError("tokens must be text (str or list of str) or token ids (list of int, or an integer "
                            f"tensor/array of shape [pos] or [batch, pos]), got {type(tokens).__name__}")
        return self._validate_tokens(tokens)

    def _validate_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor (integers), got dtype {tokens.dtype}")
        if tokens.ndim not in (1, 2):
            raise ValueError(f"token ids must be [pos] or [batch, pos], got shape {tuple(tokens.shape)}")
        if tokens.shape[-1] == 0 or tokens.numel() == 0:
            raise ValueError("empty token sequence")
        if tokens.shape[-1] > self.cfg.n_ctx:
            raise ValueError(f"sequence of {tokens.shape[-1]} tokens is longer than n_ctx={self.cfg.n_ctx}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.cfg.d_vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} out of range: token ids must lie in 0..{self.cfg.d_vocab - 1} "
                             f"(d_vocab={self.cfg.d_vocab})")
        return tokens.long().to(self.device)

    def __repr__(self) -> str:
        c = self.cfg
        return (f"CircuitModel({c.name!r}: n_layers={c.n_layers}, n_heads={c.n_heads}, d_model={c.d_model}, "
                f"d_head={c.d_head}, d_vocab={c.d_vocab}, n_ctx={c.n_ctx}, positional={c.positional!r})")
