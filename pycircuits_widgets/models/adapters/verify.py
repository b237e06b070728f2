"""Verification at load: no translated model enters silently wrong.

Two checks, in order:

1. ``check_module_heads``: the config the translation read against what the modules hold (head
   counts, ``d_head``, projection sizes). A config edited after the model was built (``n_head`` 8
   on modules built with 4) reshapes the same weights into other heads without any shape error, so
   this compares the attention modules' own attributes and weight shapes with the config.
   ``check_rotary_modules`` likewise compares the rotary rule the translation read from the config
   with the source's built rotary embedding modules (their frequencies, attention scaling and, for
   dynamic NTK, the length they were built for): the source's forward keeps those, whatever the
   config says later.
2. ``probe``: a short forward (``PROBE_TOKENS`` random ids, fixed seed) through the translated model
   and through the source model's own forward; logits, and the attention patterns where the source
   returns them, must agree within ``tolerance`` (a rounding-error bound, below). A rotary rule that
   depends on the length (dynamic NTK, LongRoPE) acts only past a threshold, so a second probe runs one
   token past it (where that is at most ``LONG_PROBE_MAX`` tokens). A disagreement raises
   ``TranslationError`` naming the family, the errors and the likely feature: the features of the
   first layer whose patterns disagree, or those after attention when the patterns agree.

Tolerance: two correct forwards differ only by rounding, and how they round differs between CPUs
(the order and blocking of each sum: AVX2 against AVX-512/AMX kernels), so the bound is derived,
not observed. Rounding errors along a chain of ``n`` roundings behave as independent zero-mean
variables (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019): their sum stays within
``LAMBDA sqrt(n) u`` times the size of what was summed, except with probability below
``2 n exp(-LAMBDA^2 / 2)`` (1e-13 per value at ``LAMBDA = 8``). For each of the two forwards:

* ``n`` (``chain_length``): the terms summed along the longest path (per layer the norm, the
  query/key/value projections, ``pattern @ v``, the output projection, the MLP; then the final norm
  and the unembedding); ``u`` float32's unit roundoff (2^-24) for float32 and float64 models,
  since sources compute parts in float32 whatever their dtype (GPT-Neo's attention, rotary
  tables). In half precision the products accumulate in float32 and each stored activation is
  rounded to the half type: ``n`` counts those roundings (``HALF_ROUNDINGS_PER_LAYER`` a layer)
  at the half type's ``u``.
* the logits' size: the largest absolute sum the unembedding forms, ``max(|x_norm| @ |W_U|)``
  (larger than ``max|logit|`` where terms cancel, which is where rounding shows).
* patterns: the scores' spread ``log(p_max / p_min)`` within a row, and a softmax moves each
  probability by at most half the largest score error. In half precision this bound exceeds 0.5
  at any size (rounding flips near-tied attention), so only the logits are compared.

So a bound grows with the model (``sqrt(n)``): GPT-2-small's logits get about 3e-4 of their sums' size
where a fixed 1e-4 could refuse a correct translation on another CPU.

Cost (``benchmarks/bench_verify.py``): one source forward and one weight-view forward of 16 tokens,
and one more unembedding-sized product for the bound (``|x_norm| @ |W_U|``, in vocabulary blocks);
the same again at the long probe's length, for a length-dependent rotary rule.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .hf_weights import qkv_weights, submodule

PROBE_TOKENS = 16
LONG_PROBE_MAX = 256
"""Longest second probe (a length-dependent rotary rule's threshold + 1); past it the rotary module
check alone guards the rule (the weight view's forward keeps every pattern: L x H x n^2 floats)."""
LAMBDA = 8.0
"""Standard deviations of the rounding-error bound (module docstring)."""
HALF_ROUNDINGS_PER_LAYER = 13
"""Activations a half-precision layer stores (so rounds): the normed input, q, k, v, the pattern,
z, the attention output, the residual sum; the MLP's normed input, hidden, activation, output and
residual sum."""
HALF = (torch.float16, torch.bfloat16)


class TranslationError(ValueError):
    """The translated model disagrees with its source (a config/shape contradiction or the probe)."""


def chain_length(cfg, n_tokens: int, to: str = "logits") -> int:
    """Terms summed along the longest path of a forward pass of ``n_tokens`` up to the logits, or
    up to the last layer's attention scores (``to="scores"``); a mixture of experts counts its
    chosen experts' MLPs as one wider MLP."""
    d_mlp = (cfg.d_mlp or 0) * (cfg.experts_per_token or 1)
    layer = 2 * cfg.d_model + n_tokens + cfg.n_heads * cfg.d_head + (2 * cfg.d_model + d_mlp if d_mlp else 0)
    if to == "scores":
        return (cfg.n_layers - 1) * layer + 2 * cfg.d_model + cfg.d_head
    return cfg.n_layers * layer + 2 * cfg.d_model


UNEMBED_BLOCK = 8192
"""Vocabulary columns of ``|W_U|`` taken at a time (a block's copy, not the whole unembedding's)."""


def _unembed_magnitude(model, cache) -> float:
    """``max(|x_norm| @ |W_U| + |b_U|)`` over the run's positions: the size of the logits' sums
    (float32 is ample for a size; blocks of ``UNEMBED_BLOCK`` tokens bound the memory)."""
    resid = cache.resid[:, -1].float()
    if model.cfg.normalization == "layernorm":
        resid = resid - resid.mean(-1, keepdim=True)
    x = (resid / cache.ln_scale[:, -1, :, None].float()).abs()
    largest = 0.0
    for start in range(0, model.cfg.d_vocab, UNEMBED_BLOCK):
        sums = x @ model.W_U[:, start:start + UNEMBED_BLOCK].float().abs()
        if model.b_U is not None:
            sums = sums + model.b_U[start:start + UNEMBED_BLOCK].float().abs()
        largest = max(largest, float(sums.max()))
    return largest


def _score_spread(patterns: torch.Tensor) -> float:
    """Largest ``log(p_max / p_min)`` of a row over its nonzero entries (an underflowed entry
    counts at the dtype's smallest normal)."""
    p = patterns.double()
    logs = p.clamp_min(torch.finfo(patterns.dtype).tiny).log()
    visible = p > 0
    hi = logs.masked_fill(~visible, -math.inf).amax(-1)
    lo = torch.where(visible.any(-1), logs.masked_fill(~visible, math.inf).amin(-1), hi)
    return float((hi - lo).max())


def tolerance(model, cache, n_tokens: int) -> tuple[float, float | None]:
    """(max logit error, max pattern error or None: not compared) that two correct forwards of
    ``model`` on ``n_tokens`` may show, from this run's ``cache`` (module docstring)."""
    cfg = model.cfg
    if model.dtype in HALF:
        u, n = torch.finfo(model.dtype).eps / 2, HALF_ROUNDINGS_PER_LAYER * cfg.n_layers + 2
    else:
        u, n = torch.finfo(torch.float32).eps / 2, chain_length(cfg, n_tokens)
    logit_tol = 2 * LAMBDA * math.sqrt(n) * u * _unembed_magnitude(model, cache)
    if model.dtype in HALF:
        return logit_tol, None
    # two forwards' score errors, each LAMBDA sqrt(n) u spread; a softmax passes on half of it
    return logit_tol, LAMBDA * math.sqrt(chain_length(cfg, n_tokens, "scores")) * u * _score_spread(cache.patterns)


_HEAD_ATTRIBUTES = {"num_heads": "n_heads", "num_attention_heads": "n_heads", "n_head": "n_heads",
                    "head_dim": "d_head", "head_size": "d_head", "num_key_value_heads": "n_kv_heads",
                    "num_kv_heads": "n_kv_heads", "kv_heads": "n_kv_heads"}


def check_module_heads(model, family, cfg) -> None:
    """Refuse a config whose head counts or ``d_head`` contradict the attention modules (their own
    attributes) or the projection shapes, naming both numbers."""
    body = submodule(model, family.body)
    n_kv = cfg.n_kv_heads or cfg.n_heads
    heads_field = getattr(model.config, "attribute_map", {}).get("num_attention_heads", "num_attention_heads")
    source = {"n_heads": f"config.{heads_field}", "d_head": "config.head_dim (or hidden size / heads)",
              "n_kv_heads": "config.num_key_value_heads (or the family's multi-query flag)"}
    for index, layer in enumerate(submodule(body, family.layers)):
        attn = submodule(layer, family.attn)
        for attr, ours in _HEAD_ATTRIBUTES.items():
            value = attn.__dict__.get(attr)
            expected = n_kv if ours == "n_kv_heads" else getattr(cfg, ours)
            if isinstance(value, int) and not isinstance(value, bool) and value != expected:
                raise TranslationError(
                    f"from_hf: {cfg.name!r}: {source[ours]} gives {ours}={expected}, but layer {index}'s attention "
                    f"module has {attr}={value}; the config contradicts the weights it describes (was it edited "
                    "after the model was built?)")
        try:
            shapes = [tuple(W.shape) for W, _ in qkv_weights(attn, family, cfg)]
        except RuntimeError as err:
            raise TranslationError(f"from_hf: {cfg.name!r}: layer {index}'s query/key/value weights do not fit "
                                   f"n_heads={cfg.n_heads}, n_kv_heads={n_kv}, d_head={cfg.d_head}: {err}") from err
        expected = [(cfg.d_model, cfg.n_heads * cfg.d_head), (cfg.d_model, n_kv * cfg.d_head),
                    (cfg.d_model, n_kv * cfg.d_head)]
        if shapes != expected:
            raise TranslationError(f"from_hf: {cfg.name!r}: layer {index}'s query/key/value weights are {shapes} "
                                   f"([d_model, heads * d_head]); the config gives {expected} (n_heads={cfg.n_heads}, "
                                   f"n_kv_heads={n_kv}, d_head={cfg.d_head}, d_model={cfg.d_model})")


def check_rotary_modules(model, cfg) -> None:
    """Refuse a rotary rule (read from ``model.config``) that the source's built rotary embedding
    modules (Hugging Face ``*RotaryEmbedding``: ``original_inv_freq``, ``attention_scaling``,
    ``original_max_seq_len``; per layer type where the config has ``layer_types``) do not hold.

    Those values are what the source's forward rotates by: a config edited after the model was built
    (``rope_theta``, the rope parameters, ``max_position_embeddings``) changes the translation but not
    them. Dynamic NTK re-reads the config when it grows past the built length, so a length raised
    after building is the source's rule too (it equals the config's rule at every length); a length
    lowered after building is not (the module keeps the built frequencies up to the built length,
    then grows by the new one), and is refused."""
    from ..rotary import is_rotary_layer, layer_rope, rotary_frequencies
    layer_types = getattr(model.config, "layer_types", None)
    for name, module in model.named_modules():
        if not hasattr(module, "original_max_seq_len"):
            continue
        for layer in range(cfg.n_layers):
            prefix = f"{layer_types[layer]}_" if layer_types and hasattr(
                module, f"{layer_types[layer]}_original_inv_freq") else ""
            built = getattr(module, f"{prefix}original_inv_freq", None)
            if built is None or built.device.type == "meta" or not is_rotary_layer(cfg, layer):
                continue  # (a meta model is refused with its weights)
            rule = layer_rope(cfg, layer)
            inv, scaling = rotary_frequencies(cfg, layer)  # the built length: no length-dependent growth
            # both are float32 base ** (-2i / d), whose rounding ln(base) amplifies; a model cast to half
            # precision casts the buffer too (one rounding to its dtype, which its forward then uses)
            rtol = (4 * torch.finfo(torch.float32).eps * (1 + math.log(max(float(rule["rope_theta"]), math.e)))
                    + torch.finfo(built.dtype).eps)
            built = built.detach().float().cpu()
            where = f"from_hf: {cfg.name!r}: the rotary embedding {name!r} (layer {layer})"
            edited = "; was the config edited after the model was built?"
            if built.shape != inv.shape or not torch.allclose(inv, built, rtol=rtol, atol=0):
                raise TranslationError(
                    f"{where} was built with inverse frequencies {_few(built)}, but the config's rotary rule "
                    f"({rule['rope_type']!r}, base {rule['rope_theta']:g}, rotary_dim {cfg.rotary_dim}) gives "
                    f"{_few(inv)}{edited}")
            built_scaling = float(getattr(module, f"{prefix}attention_scaling", 1.0))
            if not math.isclose(built_scaling, scaling, rel_tol=rtol):
                raise TranslationError(f"{where} was built with attention scaling {built_scaling:g}, but the config's "
                                       f"rotary rule gives {scaling:g}{edited}")
            trained = rule.get("max_position_embeddings", cfg.n_ctx)
            if rule["rope_type"] == "dynamic" and module.original_max_seq_len > trained:
                raise TranslationError(
                    f"{where} was built for max_position_embeddings={module.original_max_seq_len} and keeps its "
                    f"frequencies up to that length, then grows them by the config's {trained}: its forward follows "
                    f"the dynamic NTK rule of neither length{edited}")


def _few(t: torch.Tensor) -> str:
    values = ", ".join(f"{v:.6g}" for v in t[:4].tolist())
    return f"[{values}{', ...' if t.numel() > 4 else ''}] ({t.numel()})"


def probe_lengths(cfg) -> list[int]:
    """``PROBE_TOKENS``, then one token past the threshold of a length-dependent rotary rule (dynamic
    NTK's trained length, LongRoPE's original length) where that is within ``n_ctx`` and
    ``LONG_PROBE_MAX``: the length where the rule first acts. Capped at ``n_ctx``."""
    from ..rotary import is_rotary_layer, layer_rope
    lengths = [min(PROBE_TOKENS, cfg.n_ctx)]
    for layer in range(cfg.n_layers):
        if not is_rotary_layer(cfg, layer):
            continue
        rule = layer_rope(cfg, layer)
        threshold = {"dynamic": rule.get("max_position_embeddings", cfg.n_ctx),
                     "longrope": rule.get("original_max_position_embeddings")}.get(rule["rope_type"])
        if threshold is not None and lengths[0] < threshold + 1 <= min(cfg.n_ctx, LONG_PROBE_MAX):
            lengths.append(threshold + 1)
    return sorted(set(lengths))


def probe_tokens(cfg, device, n: int | None = None) -> torch.Tensor:
    """``[1, n]`` random token ids (fixed seed); ``n`` default ``min(PROBE_TOKENS, n_ctx)``."""
    n = min(PROBE_TOKENS, cfg.n_ctx) if n is None else n
    return torch.randint(0, cfg.d_vocab, (1, n), generator=torch.Generator().manual_seed(0)).to(device)


def attention_features(cfg, layer: int) -> list[str]:
    """What layer ``layer``'s attention does beyond ``softmax(q k^T / sqrt(d_head))``."""
    from ..rotary import is_rotary_layer, layer_rope
    out = []
    if is_rotary_layer(cfg, layer):
        rule = layer_rope(cfg, layer)
        out.append(f"rotary (rope_type {rule['rope_type']!r}, rotary_dim {cfg.rotary_dim} of d_head {cfg.d_head}, "
                   f"base {rule['rope_theta']:g}, scale {cfg.rotary_scale:g})")
    elif cfg.positional == "rotary":
        out.append("no rotary in this layer")
    if cfg.window is not None and cfg.window[layer] is not None:
        out.append(f"sliding window {cfg.window[layer]}")
    if cfg.qk_norm:
        out.append(f"QK-norm ({cfg.qk_norm}, {'per head' if cfg.qk_norm_heads else 'across heads'})")
    if cfg.alibi_slopes is not None:
        out.append("ALiBi")
    if cfg.attn_softcap is not None:
        out.append(f"attention soft-cap {cfg.attn_softcap:g}")
    if abs(cfg.attn_scale - cfg.d_head ** 0.5) > 1e-9:
        out.append(f"attention scale 1/{cfg.attn_scale:g}")
    if cfg.n_kv_heads:
        out.append(f"grouped-query attention ({cfg.n_kv_heads} key/value heads)")
    return out or ["plain attention"]


def output_features(model) -> list[str]:
    """What the model does after attention that could explain a logit-only disagreement."""
    cfg = model.cfg
    out = [f"MLP ({'gated ' if cfg.gated_mlp else ''}{cfg.act_fn})"]
    if cfg.parallel_attn_mlp:
        out.append("parallel attention + MLP")
    if cfg.post_norms:
        out.append("post-norms")
    if not cfg.pre_norm:
        out.append("no pre-norms")
    if cfg.final_softcap is not None:
        out.append(f"final soft-cap {cfg.final_softcap:g}")
    out += [f"folded {name} {value:g}" for name, value in model.metadata.get("folded", {}).items()]
    out.append(f"{cfg.normalization} (eps {cfg.eps:g})")
    return out


def compare(model, logits: torch.Tensor, patterns: torch.Tensor | None, family: str, source: str) -> dict:
    """Compare ``model`` on ``probe_tokens`` (as many as ``logits`` has) with the source's ``logits
    [1, n, d_vocab]`` and ``patterns [1, L, H, n, n]`` (or None); raise ``TranslationError`` on a
    disagreement, else return the errors."""
    tokens = probe_tokens(model.cfg, model.device, logits.shape[1])
    with torch.no_grad():
        ours, cache = model.run_with_cache(tokens)
    logit_tol, pattern_tol = tolerance(model, cache, tokens.shape[1])
    if pattern_tol is None:
        patterns = None
    scale = float(logits.float().abs().max()) or 1.0
    err = float((ours.float() - logits.float()).abs().max())
    layer_errors = []
    if patterns is not None:
        layer_errors = (cache.patterns.float() - patterns.float()).abs().amax((0, 2, 3, 4)).tolist()
    pattern_err = max(layer_errors, default=None)
    report = {"tokens": tokens.shape[1], "max_logit_error": err, "relative_logit_error": err / scale,
              "logit_tolerance": logit_tol, "max_pattern_error": pattern_err, "pattern_tolerance": pattern_tol,
              "patterns_checked": patterns is not None}
    bad_layer = next((i for i, e in enumerate(layer_errors) if not e <= pattern_tol), None)
    if err <= logit_tol and bad_layer is None:
        return report
    if bad_layer is not None:
        where = (f"first disagreeing attention pattern: layer {bad_layer} (max error {layer_errors[bad_layer]:.3g}, "
                 f"tolerance {pattern_tol:.3g}); likely feature: {'; '.join(attention_features(model.cfg, bad_layer))}")
    elif patterns is not None:
        where = f"attention patterns agree; likely feature: {'; '.join(output_features(model))}"
    else:
        where = ("attention patterns not compared (non-eager attention or half precision); likely feature, attention: "
                 f"{'; '.join(attention_features(model.cfg, 0))}; after attention: {'; '.join(output_features(model))}")
    raise TranslationError(
        f"{source}: the {family} translation disagrees with the source model's own forward on a "
        f"{tokens.shape[1]}-token probe: max logit error {err:.3g} ({err / scale:.2g} x max|logit| {scale:.3g}, "
        f"tolerance {logit_tol:.3g}); {where}. The model is refused (pass verify=False to skip this check only "
        "if you have checked the translation another way)")


def probe_hf(source, model, family: str) -> dict:
    """``compare`` against a Hugging Face model's own forward at each of ``probe_lengths``, in eval mode
    (no dropout); the errors of the longest probe are returned. Patterns need eager attention: a model
    loaded with another implementation (``sdpa``, the default) is switched to eager for the probe and
    back, where transformers allows it; otherwise only the logits are compared. The model's training
    mode is restored, and so is the state of its rotary modules (``rotary_state_kept``)."""
    reports = [_probe_hf(source, model, family, n) for n in probe_lengths(model.cfg)]
    return reports[-1]


@contextlib.contextmanager
def rotary_state_kept(source):
    """Run a forward of ``source`` and put its rotary embedding modules back as they were: Hugging
    Face's dynamic NTK keeps the frequencies of the longest sequence it has seen (until one shorter
    than the built length resets them) and LongRoPE switches its frequencies in place, so a probe
    would otherwise change what the source computes next."""
    saved = []
    for module in source.modules():
        if hasattr(module, "original_max_seq_len"):
            buffers = {k: b.clone() for k, b in module._buffers.items() if b is not None}
            plain = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"
                     and isinstance(v, (int, float, torch.Tensor))}
            saved.append((module, buffers, plain))
    try:
        yield
    finally:
        for module, buffers, plain in saved:
            module._buffers.update(buffers)
            for key in [k for k in vars(module) if "inv_freq" in k and k not in plain and k not in buffers]:
                delattr(module, key)  # computed during the probe (LongRoPE's long frequencies)
            vars(module).update(plain)


def _probe_hf(source, model, family: str, n: int) -> dict:
    tokens = probe_tokens(model.cfg, model.device, n)
    loaded = getattr(source.config, "_attn_implementation", "eager")
    switch = loaded != "eager" and hasattr(source, "set_attn_implementation")
    training = source.training  # a model built with from_config is in training mode: dropout on
    try:
        source.eval()
        if switch:
            source.set_attn_implementation("eager")
        with torch.no_grad(), rotary_state_kept(source):
            out = source(tokens.to(source.device), output_attentions=True)
    finally:
        if switch:
            source.set_attn_implementation(loaded)
        source.train(training)
    attentions = getattr(out, "attentions", None)
    patterns = None
    if attentions and all(isinstance(a, torch.Tensor) for a in attentions):
        patterns = torch.stack(attentions, 1).to(model.device)
    return compare(model, out.logits.to(model.device), patterns, family, "from_hf")
