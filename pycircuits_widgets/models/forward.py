"""The forward pass of a ``CircuitModel``: the stream read through the folded norms, each layer's
attention and MLP, interventions (``interventions.Interventions``) and resumption from a clean run,
recorded in an ``ActivationCache``.

:class:`Forward` is the half of ``CircuitModel`` that runs the weights; ``circuit_model`` holds them (the
weight container: shapes, checks, tokenizer, the paper's ``OV``/``QK``). The computations follow each
family's own Hugging Face forward (``tests/test_families.py``), in the model's dtype with the steps
Hugging Face runs in float32 widened (:func:`widened`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation_cache import ActivationCache
from .interventions import VIAS, Interventions, LayerEdits
from .rotary import is_rotary_layer, rotary_frequencies

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "relu2": lambda x: F.relu(x).square(),
}
"""``cfg.act_fn`` -> the MLP activation the forward applies (``analysis.neurons`` applies the same)."""


HALF = (torch.float16, torch.bfloat16)


def widened(x: torch.Tensor) -> torch.Tensor:
    """``x [...]`` in float32 if it is half precision, else unchanged (same shape): the steps Hugging Face
    runs in float32 (norm statistics, scores, softmax, rotary) keep float64 models in float64."""
    return x.float() if x.dtype in HALF else x


def _normalize(x: torch.Tensor, kind: str | None, eps: float, dtype: torch.dtype | None = None):
    """``(x_normed, scale)`` in ``dtype`` (default ``x``'s): layernorm centres then divides by
    ``sqrt(mean(x^2) + eps)``, rmsnorm only divides; None is the identity. Statistics in float32
    for half-precision ``x``."""
    dtype = dtype or x.dtype
    if kind is None:
        return x.to(dtype), torch.ones(x.shape[:-1], dtype=dtype, device=x.device)
    xf = widened(x)
    if kind == "layernorm":
        xf = xf - xf.mean(-1, keepdim=True)
    scale = torch.sqrt(xf.pow(2).mean(-1) + eps)
    return (xf / scale[..., None]).to(dtype), scale.to(dtype)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``[batch, pos - 1]`` (nats) of ``logits[:, :-1]`` against ``tokens[:, 1:]``."""
    logits = logits[:, :-1]
    logits = widened(logits)  # log-softmax in half precision is too coarse
    logp = F.log_softmax(logits, dim=-1)
    return -logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


class Forward:
    """The forward pass over a weight container's tensors (``self.W_E``, ``self.cfg``, ...: ``CircuitModel``)."""

    def read(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x [..., d_model]`` as a layer reading the residual stream does (centering for
        layernorm, then division by the norm; the learned scale is folded into the reader):
        ``(x_normed [..., d_model], scale [...])``. Identity and ones when normalization is None.
        Half-precision streams are normalised in float32 (as Hugging Face's norms compute); the
        result is in ``dtype``, default the model's (the forward keeps a half-precision model's stream
        in float32; an analysis widening 16-bit weights asks for its working dtype)."""
        return _normalize(x, self.cfg.normalization, self.cfg.eps, dtype or self.dtype)

    def unembed(self, xn: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the final-normed stream ``xn [..., d_model]``: ``xn @ W_U + b_U``, soft-capped where
        the model caps, ``[..., d_vocab]``; with ``columns`` (token ids ``[n]``) only those, ``[..., n]``."""
        W_U = self.W_U if columns is None else self.W_U[:, columns]
        out = xn @ W_U
        if self.b_U is not None:
            out = out + (self.b_U if columns is None else self.b_U[columns])
        if self.cfg.final_softcap is not None:
            out = torch.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
        return out

    def _rotary_tables(self, layer: int, pos: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin) [pos, rotary_dim]`` of layer ``layer``'s rotary angles (``rotary.rotary_frequencies``,
        the attention scaling multiplied in), float32 on ``like``'s device. Kept per frequency rule for
        the last length: layers (and Q and K) with the same rule share them."""
        inv, scaling = rotary_frequencies(self.cfg, layer, pos, device=like.device)
        key = (pos, like.device, tuple(inv.tolist()), scaling)
        cache = self.__dict__.setdefault("_rotary_cache", {})
        if key not in cache:
            if len(cache) > 8:
                cache.clear()
            angle = torch.arange(pos, dtype=torch.float32, device=like.device)[:, None] * inv
            cache[key] = (torch.cat([angle.cos()] * 2, -1) * scaling, torch.cat([angle.sin()] * 2, -1) * scaling)
        return cache[key]

    def _rotate(self, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Rotary embedding (GPT-NeoX ``rotate_half`` layout) of ``x [b, H, pos, d_head]`` by layer
        ``layer``'s frequencies (``rotary.rotary_frequencies``); computed in float32 (float64 for a
        float64 ``x``), returned in ``x``'s dtype. A layer without rotary returns ``x``."""
        if not is_rotary_layer(self.cfg, layer):
            return x
        r = self.cfg.rotary_dim
        cos, sin = self._rotary_tables(layer, x.shape[-2], x)
        rot, rest = widened(x[..., :r]), x[..., r:]
        half = torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], -1)
        return torch.cat([(rot * cos + half * sin).to(x.dtype), rest], -1)

    def _qk_norm(self, layer: int, x: torch.Tensor, which: str, heads: list[int] | None = None) -> torch.Tensor:
        """Query/key norm (``cfg.qk_norm``) of ``x [b, H, pos, d_head]`` with weights ``w_{which}norm``;
        ``heads``: the heads ``x`` holds (default all; a norm over all heads needs all)."""
        some = slice(None) if heads is None else heads
        w, b = getattr(self, f"w_{which}norm")[layer][some], getattr(self, f"b_{which}norm")
        if self.cfg.qk_norm_heads:
            xn = _normalize(x, self.cfg.qk_norm, self.cfg.eps)[0]
        else:  # one norm over every head of a position (OLMo 2)
            flat = x.transpose(1, 2).flatten(2)
            xn = _normalize(flat, self.cfg.qk_norm, self.cfg.eps)[0].reshape(x.transpose(1, 2).shape).transpose(1, 2)
        xn = xn * w[:, None]
        return xn + b[layer][some][:, None] if b is not None else xn

    def layer_read(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a layer's attention or MLP reads from the residual stream ``x [..., d_model]``:
        ``read(x)`` with pre-norms, ``x`` itself (scale ones) without them (``cfg.pre_norm`` False)."""
        return self.read(x) if self.cfg.pre_norm else _normalize(x, None, 0.0, self.dtype)

    def project(self, layer: int, xn: torch.Tensor, via: str, heads: list[int] | None = None) -> torch.Tensor:
        """Queries (``via="Q"``), keys (``"K"``) or values (``"V"``) of layer ``layer``'s heads from
        ``xn [b, pos, d_model]`` as ``layer_read`` returns it (or ``[b, H, pos, d_model]``, each head's own,
        per-head QK-norm only): ``[b, H, pos, d_head]``, after every
        step the forward takes before the scores (Shortformer positions, biases, ``clip_qkv``,
        QK-norm and rotary for Q and K). ``heads`` (head indices) keeps only those heads; a QK-norm
        over all heads of a position (``qk_norm_heads`` False) is taken over all of them first."""
        cfg = self.cfg
        qk = via != "V"
        if qk and cfg.positional == "shortformer":
            xn = xn + self.W_pos[: xn.shape[-2]]
        weight, bias = {"Q": (self.W_Q, self.b_Q), "K": (self.W_K, self.b_K), "V": (self.W_V, self.b_V)}[via]
        joint = qk and cfg.qk_norm is not None and not cfg.qk_norm_heads
        some = slice(None) if heads is None or joint else heads
        weight = weight[layer][some]
        if xn.ndim == 4:  # each head its own input [b, H, pos, d] (a read tap): one product per head
            out = xn @ weight
        elif xn.shape[0] == 1:
            # [1, 1, pos, d] @ [H, d, d_head]: a batched product reading each head's weight in place
            # (one product over a [d, H * d_head] copy of the weights costs that copy on each call)
            out = xn[:, None] @ weight
        else:  # a batch: the stream broadcast to every head would be copied, more than the weights are
            out = (xn @ weight.transpose(0, 1).flatten(1)).unflatten(-1, weight.shape[::2]).transpose(1, 2)
        if bias is not None:
            out = out + bias[layer][some][:, None]
        if cfg.clip_qkv is not None:
            out = out.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        if qk:
            if cfg.qk_norm is not None:
                out = self._qk_norm(layer, out, via.lower(), None if joint else heads)
                if joint and heads is not None:
                    out = out[:, heads]
            out = self._rotate(out, layer)
        return out

    def attention_pattern(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                          heads: list[int] | None = None) -> torch.Tensor:
        """Attention probabilities ``[..., H, dest, src]`` of layer ``layer``'s heads (``heads``: which,
        default all) from ``project``'s queries ``q [..., H, pos, d_head]`` and keys ``k`` (leading
        dims broadcast): scores (in float32 for half-precision models, as Hugging Face's softmax),
        soft-cap, ALiBi, the causal and sliding-window mask, softmax; in the model's dtype."""
        cfg = self.cfg
        q, k = widened(q), widened(k)
        pos = q.shape[-2]
        offset = torch.arange(pos, device=q.device)[None, :] - torch.arange(pos, device=q.device)[:, None]  # j - i
        visible = offset <= 0
        if cfg.window is not None and cfg.window[layer] is not None:
            visible = visible & (offset > -cfg.window[layer])
        # what is added to the scores after any soft-cap: the mask (0 or -inf) and ALiBi's bias [(H,) dest, src]
        bias = torch.zeros(pos, pos, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        if cfg.alibi_slopes is not None:
            slopes = torch.tensor(cfg.alibi_slopes, dtype=q.dtype, device=q.device)
            bias = bias + slopes[slice(None) if heads is None else heads][:, None, None] * offset
        if cfg.attn_softcap is not None:
            scores = q @ k.transpose(-1, -2) / cfg.attn_scale
            scores = torch.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap + bias
        else:
            # one batched GEMM scales the product and adds the bias (its beta term), not two more passes
            # over the forward's largest tensor (attn-only-2l, 16 windows of 128: 15% of the forward)
            lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
            flat = [x.expand(*lead, *x.shape[-2:]).reshape(-1, *x.shape[-2:]) for x in (q, k)]
            scores = torch.baddbmm(bias.expand(*lead, pos, pos).reshape(-1, pos, pos), flat[0], flat[1].transpose(-1, -2),
                                   alpha=1 / cfg.attn_scale).view(*lead, pos, pos)
        return scores.softmax(-1).to(self.dtype)

    def attention_output(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """The heads' summed output ``[b, pos, d_model]`` (without ``b_O``) of layer ``layer``'s
        ``z [b, H, pos, d_head]``."""
        b, H, pos, dh = z.shape
        # one product over all heads (not per head, then summed): what HF's output projection costs
        return z.transpose(1, 2).reshape(b, pos, H * dh) @ self.W_O[layer].reshape(H * dh, -1)

    def attention_write(self, layer: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What layer ``layer``'s attention adds to the residual stream given its heads' summed output
        ``out [..., d_model]`` (``attention_output``): ``out + b_O``, normalised and scaled by the
        post-attention norm with ``cfg.post_norms``; and that norm's division ``[...]`` (None without)."""
        out = out + (self.b_O[layer] if self.b_O is not None else 0)
        if not self.cfg.post_norms:
            return out, None
        return self._post_norm(out, self.w_post_attn[layer])

    def _attention(self, layer: int, x: torch.Tensor, edits: LayerEdits | None = None,
                   clean: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """One attention layer reading ``x [b, pos, d_model]``: (pattern ``[b, H, dest, src]``,
        z ``[b, H, pos, d_head]``, the heads' summed output ``[b, pos, d_model]`` without ``b_O``,
        scale ``[b, pos]``). ``edits``: this layer's interventions (``Interventions.at``); ``clean``:
        (pattern, z, scale) of a clean run on the same ``x``, taken instead of recomputed."""
        tapped = {} if edits is None else {via: edits.taps[via] for via in VIAS if via in edits.taps}
        if clean is None or tapped:
            xn, scale = self.layer_read(x)
            # a read tap: that input of each head reads the stream plus its own delta [b, H, pos, d_model]
            q, k, v = (self.project(layer, self.layer_read(x[:, None] + tapped[via].to(x.dtype))[0] if via in tapped
                                    else xn, via) for via in VIAS)
            pattern = self.attention_pattern(layer, q, k)
            z = pattern @ v
        else:
            (pattern, z, scale), xn = clean, None
        if edits is None:
            return pattern, z, self.attention_output(layer, z), scale
        if edits.inputs:  # a head reading a patched stream by one of its inputs: that head again
            pattern, z = pattern.clone(), z.clone()
            xn = self.layer_read(x)[0] if xn is None else xn
            for head, streams in edits.inputs.items():
                reads = {via: self.layer_read(streams[via])[0] if via in streams else xn for via in VIAS}
                q, k, v = (self.project(layer, reads[via], via, [head]) for via in VIAS)
                p = self.attention_pattern(layer, q, k, [head])
                pattern[:, head], z[:, head] = p[:, 0], (p @ v)[:, 0]
        if edits.patterns:  # a head attending by a given pattern, over its own values
            pattern, z = pattern.clone(), z.clone()
            xn = self.layer_read(x)[0] if xn is None else xn
            for head, given in edits.patterns.items():
                stream = edits.inputs.get(head, {}).get("V")
                v = self.project(layer, xn if stream is None else self.layer_read(stream)[0], "V", [head])
                given = given.to(v.dtype)
                pattern[:, head], z[:, head] = given, (given[:, None] @ v)[:, 0]
        if edits.heads:  # an ablated head writes nothing through W_O: the same as its W_O set to zero
            z = z.index_fill(1, torch.tensor(sorted(edits.heads), device=z.device), 0)
        out = self.attention_output(layer, z)
        for replacement in edits.heads.values():
            if replacement is not None:
                out = out + torch.as_tensor(replacement, dtype=out.dtype, device=out.device)
        return pattern, z, out, scale

    def _mlp(self, layer: int, x: torch.Tensor,
             edits: LayerEdits | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s MLP reading ``x [b, pos, d_model]``: (output ``[b, pos, d_model]`` with ``b_out``,
        scale ``[b, pos]``, post-activation ``[b, pos, d_mlp]``: what ``W_out`` reads, after ``edits``)."""
        if edits is not None and "mlp_in" in edits.taps:  # a read tap: the MLP alone reads the stream plus it
            x = x + edits.taps["mlp_in"].to(x.dtype)
        xn, scale = self.layer_read(x)
        b_in = self.b_in[layer] if self.b_in is not None else 0
        act = ACTIVATIONS[self.cfg.act_fn]
        if not self.cfg.gated_mlp:
            hidden = act(xn @ self.W_in[layer] + b_in)
        else:
            gate = act(xn @ self.W_gate[layer] + (self.b_gate[layer] if self.b_gate is not None else 0))
            if self.cfg.b_in_outside_gate:  # TransformerLens 2.x GatedMLP
                hidden = gate * (xn @ self.W_in[layer]) + b_in
            else:
                hidden = gate * (xn @ self.W_in[layer] + b_in)
        if self.cfg.n_experts:
            hidden = hidden * self._expert_weights(layer, xn).to(hidden.dtype)
        if edits is not None and edits.neurons:
            neurons = sorted(edits.neurons)
            values = [torch.as_tensor(0 if edits.neurons[n] is None else edits.neurons[n], dtype=hidden.dtype,
                                      device=hidden.device).expand(hidden.shape[:-1]) for n in neurons]
            hidden = hidden.index_copy(-1, torch.tensor(neurons, device=hidden.device), torch.stack(values, -1))
        out = hidden @ self.W_out[layer] + (self.b_out[layer] if self.b_out is not None else 0)
        return out, scale, hidden

    def _expert_weights(self, layer: int, xn: torch.Tensor) -> torch.Tensor:
        """Mixture of experts: each neuron's routing weight ``[..., d_mlp]`` for the normalised input
        ``xn [..., d_model]`` (softmax over experts in float32, top ``experts_per_token`` kept and
        renormalised, as Mixtral's router; zero for the experts not chosen)."""
        c = self.cfg
        probs = widened(xn @ self.W_router[layer]).softmax(-1)
        top, chosen = probs.topk(c.experts_per_token, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
        return weights.repeat_interleave(c.d_mlp // c.n_experts, dim=-1)

    def _post_norm(self, out: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A post-norm (``cfg.post_norms``): (``norm(out) * w`` before ``out`` joins the stream, the
        norm's division ``[b, pos]``)."""
        normed, scale = self.read(out)
        return normed * w, scale

    def check_clean_cache(self, cache, tokens: torch.Tensor, where: str) -> None:
        """Refuse (naming ``where``) a ``cache`` that is not this model's clean run on ``tokens``
        (``[batch, pos]`` ids): not an ``ActivationCache``, a run with interventions, another model's
        (or of weights modified since), or a run of other tokens."""
        if not isinstance(cache, ActivationCache):
            raise TypeError(f"{where} must be the ActivationCache of a clean run, got {type(cache).__name__}")
        if cache.interventions:
            raise ValueError(f"{where} must be a clean run (run_with_cache without interventions); "
                             "this cache is of a run with interventions")
        if cache.W_O is not self.W_O or cache.W_O._version != cache._W_O_version:
            raise ValueError(f"{where} is the cache of another model, or of weights modified since; "
                             "pass this model's clean run of these tokens")
        if cache.tokens.shape != tokens.shape or not torch.equal(cache.tokens, tokens):
            raise ValueError(f"{where} is a run of other tokens (shape {list(cache.tokens.shape)}) "
                             f"than these ({list(tokens.shape)}); pass the clean run of these tokens")

    def _resume_layer(self, resume: ActivationCache, tokens: torch.Tensor, interventions: Interventions | None,
                      mlp_post: bool) -> int | None:
        """The layer a forward with ``interventions`` starts at when ``resume`` (a clean run of this
        model on ``tokens``) gives it the layers before: the first intervened one; None (no resuming)
        for a half-precision model, whose cache holds the stream rounded to its dtype, or when
        ``mlp_post`` is asked of a run that did not record it."""
        self.check_clean_cache(resume, tokens, "run_with_cache: resume")
        if self.dtype in HALF or (mlp_post and resume.mlp_post is None and not self.cfg.attn_only):
            return None
        return interventions.first_layer(self.cfg.n_layers) if interventions else self.cfg.n_layers

    def run_with_cache(self, tokens, interventions: Interventions | None = None,
                       resume: ActivationCache | None = None, *, mlp_post: bool = False,
                       logits: bool = True, layers: int | None = None) -> tuple[torch.Tensor | None, ActivationCache]:
        """``tokens`` (text, ``[pos]`` or ``[batch, pos]`` ids) -> (``logits [batch, pos, d_vocab]``,
        ``ActivationCache``; see its docstring for shapes and the sum identity).

        ``mlp_post``: also record every neuron's post-activation (``cache.mlp_post``). ``logits=False``:
        skip the unembedding and return None for the logits (a corpus sweep reads only the cache).
        ``layers`` (with ``logits=False``, without ``resume``): run only the first ``layers`` layers
        (``1..n_layers``), for a caller that reads an early layer's entries (the dataset examples of a
        head in layer ``l``: ``layers=l + 1``); their entries are the whole forward's, bit for bit,
        and the cache holds only them: ``resid [b, layers + 1, ...]`` (the stream before each, then
        after the last), per-layer entries ``[b, layers, ...]``, and ``ln_scale [b, layers, pos]``
        (no final norm is read).

        ``interventions`` (``models.interventions.Interventions``): heads' outputs, neurons'
        activations or heads' inputs changed in this forward; the cache records the changed run.
        ``resume``: the cache of this model's clean run on the same tokens; the forward then starts
        at the first intervened layer, from ``resume``'s residual stream there (the exact input of
        that layer), and reuses that layer's clean attention where the interventions leave it: the
        same result as the whole forward, bit for bit, for a fraction of it. (A half-precision
        model runs the whole forward: its cache holds the stream rounded to its dtype.)"""
        tokens = self._as_tokens(tokens)
        if tokens.ndim == 1:
            tokens = tokens[None]
        b, pos = tokens.shape
        cfg = self.cfg
        complete = layers is None or layers == cfg.n_layers
        if layers is not None:
            if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= cfg.n_layers:
                raise ValueError(f"run_with_cache: layers must be an int in 1..{cfg.n_layers}, got {layers!r}")
            if (logits or resume is not None) and not complete:
                raise ValueError("run_with_cache: layers (a forward that stops early) reads no logits and resumes "
                                 "no run: pass logits=False and no resume")
        if interventions is not None:
            if not isinstance(interventions, Interventions):
                raise TypeError(f"run_with_cache: interventions must be an Interventions, got "
                                f"{type(interventions).__name__}")
            interventions.check(cfg, b, pos)
        start = None if resume is None else self._resume_layer(resume, tokens, interventions, mlp_post)
        if start is not None:
            embed, x = resume.embed, resume.resid[:, start]
        else:
            # a half-precision model's residual stream is summed in float32 (each layer reads it in the
            # model's dtype): more accurate than the source's half-precision sums, never less
            x = self.W_E[tokens].to(torch.float32 if self.dtype in HALF else self.dtype)
            if cfg.positional == "learned":
                x = x + self.W_pos[:pos]
            embed = x

        def before(name: str) -> list[torch.Tensor]:
            """The clean run's entries ``resume.<name>`` of the layers before ``start``."""
            kept = None if start is None else getattr(resume, name)
            return [] if kept is None else list(kept[:, :start].unbind(1))

        resid, patterns, zs, mlp_outs = before("resid"), before("patterns"), before("z"), before("mlp_out")
        post_scales, posts = before("post_scale_attn"), before("mlp_post") if mlp_post else []
        scales = {"attn": before("ln_scale"), "mlp": before("ln_scale_mlp")}
        for layer in range(start or 0, cfg.n_layers if layers is None else layers):
            edits = interventions.at(layer) if interventions else None
            taps = {} if edits is None else edits.taps
            if edits is not None and edits.resid is not None:
                x = edits.resid.to(x.dtype)
            if "pre" in taps:
                x = x + taps["pre"].to(x.dtype)
            resid.append(x)
            clean = None
            if layer == start and (edits is None or (edits.resid is None and "pre" not in taps)):
                # the first intervened layer reads the clean input: its clean attention
                clean = (resume.patterns[:, layer], resume.z[:, layer], resume.ln_scale[:, layer])
            pattern, z, attn_out, scale = self._attention(layer, x, edits, clean)
            patterns.append(pattern)
            zs.append(z)
            scales["attn"].append(scale)
            attn_out, post_scale = self.attention_write(layer, attn_out)
            if post_scale is not None:
                post_scales.append(post_scale)
            detached = edits is not None and edits.detached  # (the values kept, no gradient back through them)
            x = x + (attn_out.detach() if detached else attn_out)
            if "mid" in taps:
                x = x + taps["mid"].to(x.dtype)
            if not cfg.attn_only:
                # parallel blocks (GPT-NeoX): the MLP reads the stream the attention read
                mlp_out, scale, post = self._mlp(layer, resid[-1] if cfg.parallel_attn_mlp else x, edits)
                if mlp_post:
                    posts.append(post)
                if cfg.post_norms:
                    mlp_out = self._post_norm(mlp_out, self.w_post_mlp[layer])[0]
                mlp_out = mlp_out.detach() if detached else mlp_out
                mlp_outs.append(mlp_out)
                scales["mlp"].append(scale)
                x = x + mlp_out
                if "post" in taps:
                    x = x + taps["post"].to(x.dtype)
        resid.append(x)
        final = []  # the final norm's division, read by the unembedding: only after the last layer
        out = None
        if complete:
            xn, final_scale = self.read(x)
            final.append(final_scale)
        if logits:
            out = self.unembed(xn)

        d = cfg.d_model
        x, embed, resid = x.to(self.dtype), embed.to(self.dtype), [r.to(self.dtype) for r in resid]
        ln_scale = torch.stack(scales["attn"] + final, 1)
        ln_scale_mlp = None
        if not cfg.attn_only:
            ln_scale_mlp = torch.stack(scales["mlp"], 1) if scales["mlp"] else x.new_zeros(b, 0, pos)
        cache = ActivationCache(
            tokens=tokens,
            embed=embed,
            resid=torch.stack(resid, 1),
            patterns=torch.stack(patterns, 1) if patterns else x.new_zeros(b, 0, cfg.n_heads, pos, pos),
            z=torch.stack(zs, 1) if zs else x.new_zeros(b, 0, cfg.n_heads, pos, cfg.d_head),
            mlp_out=None if cfg.attn_only else (torch.stack(mlp_outs, 1) if mlp_outs else x.new_zeros(b, 0, pos, d)),
            ln_scale=ln_scale,
            ln_scale_mlp=ln_scale_mlp,
            W_O=self.W_O,
            post_scale_attn=(torch.stack(post_scales, 1) if post_scales else x.new_zeros(b, 0, pos))
            if cfg.post_norms else None,
            mlp_post=(torch.stack(posts, 1) if posts else x.new_zeros(b, 0, pos, cfg.d_mlp))
            if mlp_post and not cfg.attn_only else None,
            interventions=interventions or None,
        )
        return out, cache

    def forward(self, tokens) -> torch.Tensor:
        """``tokens`` (text, ``[pos]`` or ``[batch, pos]``) -> ``logits [batch, pos, d_vocab]``."""
        return self.run_with_cache(tokens)[0]

    __call__ = forward

    def loss(self, tokens) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of ``tokens`` (text, ``[pos]`` or ``[batch, pos]``), a scalar
        ``[]`` (``next_token_loss``)."""
        logits, cache = self.run_with_cache(tokens)
        if cache.tokens.shape[1] < 2:
            raise ValueError("loss needs at least 2 tokens")
        return next_token_loss(logits, cache.tokens).mean()
