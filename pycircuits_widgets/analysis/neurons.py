"""MLP neurons: their activations on a text and the paper's token circuits through one neuron.

A neuron ``n`` of layer ``l``'s MLP reads the normalised stream ``x`` through column ``n`` of ``W_in``
(and, for a gated MLP, ``act(x W_gate) * (x W_in)``, of ``W_gate`` too) and writes row ``n`` of
``W_out``. Its token circuits (paper appendix, ``circuits.mlp_in_circuit`` etc.), each one vector over
the vocabulary ``[d_vocab]``:

* ``W_E W_in[:, n]``: how much each token drives the neuron directly (``W_E W_gate[:, n]``: its gate);
* ``W_E W_V^h W_O^h W_in[:, n]``: how much each source token drives it through head ``h`` (a head in
  layer ``<= l``; an MLP reads what the heads of its own layer wrote);
* ``W_out[n] W_U``: the logits it adds per unit of activation (promoted tokens top, suppressed bottom).

Like every circuit through an MLP (``circuits`` module docstring), these read the raw ``W_E``: the
MLP's stream also holds the attention output, so its norm's division depends on the context; the
norm's learned scale is folded into ``W_in``/``W_gate``.
"""

from __future__ import annotations

import torch

from ..factored import linalg_dtype
from ..models.forward import ACTIVATIONS
from .circuits import check_head, check_index, mlp_reader, require_mlp
from .pieces import drained


def mlp_input(model, cache, layer: int) -> torch.Tensor:
    """What layer ``layer``'s MLP reads on the cached text, normalised: ``[b, pos, d_model]``.

    The stream it reads is ``resid[:, l + 1] - mlp_out[:, l]`` (the stream after the layer's
    attention; ``resid[:, l]`` for parallel blocks), centred for layer norm and divided by the
    forward's own ``cache.ln_scale_mlp[:, l]`` (ones for a model without pre-norms)."""
    require_mlp(model, layer)
    x = cache.resid[:, layer] if model.cfg.parallel_attn_mlp else cache.resid[:, layer + 1] - cache.mlp_out[:, layer]
    x = x.to(linalg_dtype(x.dtype))
    if model.cfg.pre_norm and model.cfg.normalization == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    return (x / cache.ln_scale_mlp[:, layer, :, None].to(x.dtype)).to(model.dtype)


def neuron_activations(model, cache, layer: int | None = None) -> torch.Tensor:
    """Every neuron's activation in layer ``layer``'s MLP on the cached text, ``[b, pos, d_mlp]``: what
    ``W_out`` reads, ``act(x W_in + b_in)``, or ``act(x W_gate + b_gate) * (x W_in + b_in)`` for a
    gated MLP (``x``: ``mlp_input``), times the routing weight of a mixture of experts. So
    ``activations @ W_out[l] + b_out[l]`` is ``cache.mlp_out[:, l]`` (before a post-norm).
    ``layer=None``: every layer's, ``[b, n_layers, pos, d_mlp]`` (``neuron_activations_steps`` run through)."""
    if layer is None:
        return drained(neuron_activations_steps(model, cache))
    return _layer_activations(model, cache, layer)


def neuron_activations_steps(model, cache):
    """Every layer's ``neuron_activations`` in pieces (``analysis.pieces``): one layer each, yielding
    ``(done, n_layers)``; returns ``[b, n_layers, pos, d_mlp]``."""
    L = model.cfg.n_layers
    layers = []
    yield 0, L
    for layer in range(L):
        layers.append(_layer_activations(model, cache, layer))
        yield layer + 1, L
    return torch.stack(layers, 1)


@torch.no_grad()
def _layer_activations(model, cache, layer: int) -> torch.Tensor:
    xn = mlp_input(model, cache, layer)
    cfg, act = model.cfg, ACTIVATIONS[model.cfg.act_fn]
    b_in = model.b_in[layer] if model.b_in is not None else 0
    if not cfg.gated_mlp:
        hidden = act(xn @ model.W_in[layer] + b_in)
    else:
        gate = act(xn @ model.W_gate[layer] + (model.b_gate[layer] if model.b_gate is not None else 0))
        up = xn @ model.W_in[layer]
        # TransformerLens 2.x's GatedMLP adds b_in after the gate
        hidden = gate * up + b_in if cfg.b_in_outside_gate else gate * (up + b_in)
    if cfg.n_experts:
        hidden = hidden * model._expert_weights(layer, xn).to(hidden.dtype)
    return hidden


@torch.no_grad()
def neuron_terms(model, layer: int, neuron: int, head: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The token circuits of neuron ``neuron`` of layer ``layer``'s MLP, each ``[d_vocab]`` (in
    ``linalg_dtype`` of the weights): ``"in"`` (``W_E W_in[:, n]``: column ``n`` of ``mlp_in_circuit``),
    ``"gate"`` (``W_E W_gate[:, n]``, gated MLPs), ``"head_in"``/``"head_gate"`` (``W_E W_V W_O W_in[:, n]``
    through ``head`` = ``(layer', h)``, ``layer' <= layer``, if given: of ``head_mlp_circuit``) and
    ``"out"`` (``W_out[n] W_U``: row ``n`` of ``mlp_out_circuit``). Each is a chain of matrix-vector
    products from the neuron's side (never a ``[d_vocab, d_head]`` factor: milliseconds at GPT-2 size)."""
    require_mlp(model, layer)
    neuron = check_index(neuron, "neuron", model.cfg.d_mlp)
    work = linalg_dtype(model.W_E.dtype)
    W_E = model.W_E.to(work)
    readers = {name: mlp_reader(model, layer, name == "gate")[:, neuron].to(work)
               for name in (("in", "gate") if model.cfg.gated_mlp else ("in",))}
    terms = {name: W_E @ r for name, r in readers.items()}
    if head is not None:
        l, h = check_head(model, head)
        if l > layer:
            raise ValueError(f"MLP layer {layer} reads before head {tuple(head)} writes; "
                             f"need a head in layer <= {layer}")
        W_V, W_O = model.W_V[l, h].to(work), model.W_O[l, h].to(work)
        terms.update({f"head_{name}": W_E @ (W_V @ (W_O @ r)) for name, r in readers.items()})
    terms["out"] = model.W_out[layer][neuron].to(work) @ model.W_U.to(work)
    return terms


def top_tokens(term: torch.Tensor, k: int, largest: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [k], token ids [k])``: the exact top (or bottom) ``k`` entries of ``term [d_vocab]``."""
    top = torch.topk(term, min(k, term.shape[-1]), largest=largest)
    return top.values, top.indices


def neuron_out_norms(model, layer: int | None = None) -> torch.Tensor:
    """``||W_out[n] W_U||`` for every neuron of layer ``layer``, ``[d_mlp]`` (``None``: of every layer,
    ``[n_layers, d_mlp]``, ``neuron_out_norms_steps`` run through): how strongly a unit of its activation
    moves the logits, from the Gram matrix ``W_U W_U^T`` (never the dense ``[d_mlp, d_vocab]`` product)."""
    if layer is None:
        return drained(neuron_out_norms_steps(model))
    require_mlp(model, layer)
    return _layer_out_norms(model, layer, _unembedding_gram(model))


def neuron_out_norms_steps(model):
    """Every layer's ``neuron_out_norms`` in pieces (``analysis.pieces``): the Gram ``W_U W_U^T`` first
    (``("gram", 1, 1)``: ``d_vocab`` times a layer's work at LLaMA-135M shapes), then one layer each
    (``("layers", done, n_layers)``); returns ``[n_layers, d_mlp]``."""
    require_mlp(model, 0)
    L = model.cfg.n_layers
    yield "gram", 0, 1
    gram = _unembedding_gram(model)
    yield "gram", 1, 1
    norms = []
    for layer in range(L):
        norms.append(_layer_out_norms(model, layer, gram))
        yield "layers", layer + 1, L
    return torch.stack(norms)


@torch.no_grad()
def _unembedding_gram(model) -> torch.Tensor:
    """``W_U W_U^T [d_model, d_model]`` in the weights' ``linalg_dtype``."""
    W_U = model.W_U.to(linalg_dtype(model.W_U.dtype))
    return W_U @ W_U.T


@torch.no_grad()
def _layer_out_norms(model, layer: int, gram: torch.Tensor) -> torch.Tensor:
    W_out = model.W_out[layer].to(gram.dtype)
    return ((W_out @ gram) * W_out).sum(-1).clamp_min(0).sqrt()


def ranked_neurons(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(neurons [k], scores [k])``: the ``k`` neurons of largest ``|scores [d_mlp]|``, largest first
    (the score keeps its sign)."""
    order = torch.topk(scores.abs(), min(k, scores.shape[-1])).indices
    return order, scores[order]
