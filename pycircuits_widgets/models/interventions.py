"""Interventions: what ``CircuitModel.run_with_cache(tokens, interventions=...)`` changes in its forward.

The one mechanism every causal check runs through (``analysis.ablation``, ``analysis.path_patching``):
the model's own forward, with these changes at the layers they name (0-based layers, heads, neurons):

* ``heads``: ``{(layer, head): replacement}``. The head's output ``head_out`` (``z @ W_O``, what it
  writes before ``b_O``) is replaced: ``None`` by zero, which is the forward with that head's ``W_O``
  set to zero (its ``z`` is zeroed before the output projection); a tensor broadcastable to
  ``[batch, pos, d_model]`` (a mean output ``[d_model]``) by that tensor. A post-norm
  (``cfg.post_norms``) divides the layer's changed output, as it would with the head's ``W_O`` changed.
* ``neurons``: ``{(layer, neuron): replacement}``. The neuron's activation, what ``W_out`` reads
  (after the nonlinearity, the gate and a mixture's expert weight), is replaced: ``None`` by zero, a
  number or a tensor broadcastable to ``[batch, pos]`` by that.
* ``head_inputs``: ``{(layer, head, via): stream [batch, pos, d_model]}``, ``via`` one of ``"Q"``,
  ``"K"``, ``"V"``. That head's query, key or value reads ``stream`` instead of the layer's input,
  through the layer's own norm recomputed on ``stream`` (TransformerLens's ``use_split_qkv_input``
  with ``hook_q_input`` / ``hook_k_input`` / ``hook_v_input``); the head's other inputs and every
  other head read the layer's input.
* ``patterns``: ``{(layer, head): pattern [batch, pos, pos]}``. The head attends by ``pattern`` (rows:
  destinations, columns: sources) instead of its own; its values are its own (TransformerLens's
  ``hook_pattern``).
* ``resid``: ``{layer: stream [batch, pos, d_model]}``. The residual stream before that layer (what its
  attention reads, TransformerLens's ``hook_resid_pre``) is ``stream``: every part of the layer reads it.
* ``taps``: ``{(layer, where): delta [batch, pos, d_model]}``, ``where`` one of ``TAPS``: ``delta`` is
  *added* to the stream before the layer (``"pre"``), after its attention (``"mid"``) or after its MLP
  (``"post"``). Zeros that require grad leave the forward as it is and give, in one backward, the
  gradient of anything read from it with respect to the stream at every such point (attribution
  patching: ``analysis.attribution``); nothing upstream is cut, unlike a replacement. ``where`` one of
  ``READ_TAPS`` adds ``delta`` to one *reader's* input only, the residual stream going on without it:
  ``"Q"``, ``"K"``, ``"V"`` with ``delta [batch, n_heads, pos, d_model]`` to the stream each head's query
  (key, value) reads, head by head, before the layer's norm (a head also in ``head_inputs`` reads
  those streams instead); ``"mlp_in"`` with ``delta [batch, pos, d_model]`` to the stream the layer's
  MLP reads. Edge attribution patching (``analysis.edges``) takes its gradients there, and measures a
  circuit by adding there what each edge left out changes.
* ``detached``: ``{layer, ...}``. That layer's residual contribution (its attention's and its MLP's
  outputs as added to the stream) enters the stream detached from autograd: the forward's values are
  the same, but no gradient flows back through the layer's attention or MLP, only along the stream past
  them (AtP*'s GradDrop: ``analysis.attribution``).

Everything after the first layer named is recomputed from the changed stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .indices import check_index, check_pair

VIAS = ("Q", "K", "V")
"""The inputs of a head a path can enter by: its query, key or value."""
TAPS = ("pre", "mid", "post")
"""Where in a layer ``Interventions.taps`` adds to the stream: before it, after its attention, after its MLP."""
READ_TAPS = ("Q", "K", "V", "mlp_in")
"""Where in a layer ``Interventions.taps`` adds to one reader's input only: each head's query, key or value
input ``[batch, n_heads, pos, d_model]``, the MLP's input ``[batch, pos, d_model]``."""


class LayerEdits(NamedTuple):
    """One layer's share of an ``Interventions``: ``heads {head: replacement}``, ``neurons {neuron:
    replacement}``, ``inputs {head: {via: stream}}``, ``patterns {head: pattern}``, ``resid`` (the stream
    before it, or None), ``taps {where: delta}``, ``detached`` (whether its contribution is detached)."""

    heads: dict
    neurons: dict
    inputs: dict
    patterns: dict
    resid: torch.Tensor | None
    taps: dict
    detached: bool


@dataclass(frozen=True)
class Interventions:
    """Changes to a forward pass (module docstring). Empty: the clean forward."""

    heads: dict = field(default_factory=dict)
    neurons: dict = field(default_factory=dict)
    head_inputs: dict = field(default_factory=dict)
    patterns: dict = field(default_factory=dict)
    resid: dict = field(default_factory=dict)
    taps: dict = field(default_factory=dict)
    detached: frozenset = field(default_factory=frozenset)

    def __bool__(self) -> bool:
        return bool(self.heads or self.neurons or self.head_inputs or self.patterns or self.resid or self.taps
                    or self.detached)

    def first_layer(self, n_layers: int) -> int:
        """The first layer an intervention changes (``n_layers`` when none does): the layers before it
        run as in the clean forward."""
        layers = [key[0] for part in (self.heads, self.neurons, self.head_inputs, self.patterns, self.taps)
                  for key in part]
        return min([*layers, *self.resid, *self.detached], default=n_layers)

    def at(self, layer: int) -> LayerEdits | None:
        """``layer``'s edits, or None where it has none."""
        heads = {h: r for (l, h), r in self.heads.items() if l == layer}
        neurons = {n: r for (l, n), r in self.neurons.items() if l == layer}
        inputs: dict = {}
        for (l, h, via), stream in self.head_inputs.items():
            if l == layer:
                inputs.setdefault(h, {})[via] = stream
        patterns = {h: p for (l, h), p in self.patterns.items() if l == layer}
        resid = self.resid.get(layer)
        taps = {where: delta for (l, where), delta in self.taps.items() if l == layer}
        detached = layer in self.detached
        if heads or neurons or inputs or patterns or resid is not None or taps or detached:
            return LayerEdits(heads, neurons, inputs, patterns, resid, taps, detached)
        return None

    def check(self, cfg, batch: int, pos: int) -> None:
        """Refuse what the model ``cfg`` has no place for, naming it and the valid range: a layer,
        head or neuron out of range, an unknown ``via``, a replacement or stream of the wrong shape."""
        L, H = cfg.n_layers, cfg.n_heads
        for (layer, head), value in self.heads.items():
            check_pair((layer, head), (L, H), ("layer", "head"), f"Interventions.heads: {(layer, head)!r}:")
            _check_tensor(f"heads[{layer, head}]", value, (batch, pos, cfg.d_model))
        for (layer, neuron), value in self.neurons.items():
            if cfg.attn_only:
                raise ValueError(f"Interventions.neurons: {cfg.name!r} is attention-only (no MLP neurons)")
            check_pair((layer, neuron), (L, cfg.d_mlp), ("layer", "neuron"), f"Interventions.neurons: {(layer, neuron)!r}:")
            _check_tensor(f"neurons[{layer, neuron}]", value, (batch, pos))
        for key, stream in self.head_inputs.items():
            if len(key) != 3 or key[2] not in VIAS:
                raise ValueError(f"Interventions.head_inputs: key {key!r} must be (layer, head, via) with via one "
                                 f"of {VIAS}")
            check_pair(key[:2], (L, H), ("layer", "head"), f"Interventions.head_inputs: {key!r}:")
            _check_stream(f"head_inputs[{key!r}]", stream, (batch, pos, cfg.d_model))
        for key, pattern in self.patterns.items():
            check_pair(key, (L, H), ("layer", "head"), f"Interventions.patterns: {key!r}:")
            if not isinstance(pattern, torch.Tensor) or tuple(pattern.shape) != (batch, pos, pos):
                got = tuple(pattern.shape) if isinstance(pattern, torch.Tensor) else type(pattern).__name__
                raise ValueError(f"Interventions.patterns[{key!r}]: a pattern is a tensor [batch, dest, src] = "
                                 f"{[batch, pos, pos]}, got {got}")
        if not isinstance(self.detached, (set, frozenset)):
            raise TypeError(f"Interventions.detached: a set of layers, got {type(self.detached).__name__}")
        for layer in self.detached:
            check_index(layer, "Interventions.detached: a layer", L)
        for layer, stream in self.resid.items():
            check_index(layer, "Interventions.resid: a key (a layer)", L)
            _check_stream(f"resid[{layer}]", stream, (batch, pos, cfg.d_model))
        for key, delta in self.taps.items():
            if not (isinstance(key, tuple) and len(key) == 2 and key[1] in TAPS + READ_TAPS):
                raise ValueError(f"Interventions.taps: key {key!r} must be (layer, where) with where one of "
                                 f"{TAPS + READ_TAPS}")
            check_index(key[0], f"Interventions.taps: {key!r}: layer", L)
            if key[1] in ("post", "mlp_in") and cfg.attn_only:
                raise ValueError(f"Interventions.taps: {key!r}: {cfg.name!r} is attention-only (no MLP to tap "
                                 f"{'after' if key[1] == 'post' else 'the input of'})")
            if key[1] in VIAS:
                if cfg.qk_norm is not None and not cfg.qk_norm_heads:
                    raise ValueError(f"Interventions.taps: {key!r}: {cfg.name!r} normalises the queries and keys of "
                                     "all heads of a position together, so one head's input is not its own")
                if not isinstance(delta, torch.Tensor) or tuple(delta.shape) != (batch, H, pos, cfg.d_model):
                    got = tuple(delta.shape) if isinstance(delta, torch.Tensor) else type(delta).__name__
                    raise ValueError(f"Interventions.taps[{key!r}]: a head input's delta is a tensor [batch, n_heads, "
                                     f"pos, d_model] = {[batch, H, pos, cfg.d_model]}, got {got}")
                continue
            _check_stream(f"taps[{key!r}]", delta, (batch, pos, cfg.d_model))


def _check_stream(where: str, stream, shape: tuple[int, int, int]) -> None:
    if not isinstance(stream, torch.Tensor) or tuple(stream.shape) != shape:
        got = tuple(stream.shape) if isinstance(stream, torch.Tensor) else type(stream).__name__
        raise ValueError(f"Interventions.{where}: the stream must be a tensor [batch, pos, d_model] = {list(shape)}, "
                         f"got {got}")


def _check_tensor(where: str, value, shape: tuple[int, ...]) -> None:
    """``value``: None, a number, or a tensor broadcastable to ``shape``."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"Interventions.{where}: a replacement is None, a number or a tensor, got "
                        f"{type(value).__name__}")
    try:
        ok = torch.broadcast_shapes(value.shape, shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"Interventions.{where}: a replacement of shape {tuple(value.shape)} does not broadcast "
                         f"to {list(shape)}")
