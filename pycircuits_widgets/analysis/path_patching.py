"""Path patching: remove one head's output from one later head's query, key or value input only, and
measured composition, that effect for every pair of heads.

``path_patch(model, tokens, writer=(l1, h1), reader=(l2, h2), via="Q" | "K" | "V")``: the reader's
``via`` input reads the residual stream with the writer's output removed (``kind="zero"``) or replaced
by its mean (``kind="mean"``), through the reader's own norm recomputed on that stream
(TransformerLens's ``use_split_qkv_input`` with ``hook_q_input`` / ``hook_k_input`` / ``hook_v_input``);
everything else reads the clean stream. The writer's share of the stream is ``head_out[l1, h1]``;
with post-norms (``cfg.post_norms``) it is what removing the head changes in its layer's normalised
output, ``post_norm(attn_out) - post_norm(attn_out - head_out + mean)`` (the norm's division
changes with it).

* ``attention_change``: for Q and K, the mean over every sequence and destination position of the
  total-variation distance ``0.5 * sum_src |clean - patched|`` between the reader's attention rows; for
  V (the pattern is unchanged), the relative change of the reader's output,
  ``||head_out_patched - head_out_clean|| / ||head_out_clean||`` (Frobenius norms over sequences,
  positions and ``d_model``).
* ``loss_change``: the mean per-token loss change when the reader's changed output is carried to the
  logits (every later layer recomputed).

``measured_composition(model, tokens, via)``: ``attention_change`` of every writer -> later reader pair,
``[L, H, L, H]`` (NaN where the reader's layer is not after the writer's), beside the weight-based
``composition_scores``. Not one forward per pair: removing a writer changes only the inputs of later
layers, so each (writer layer, reader layer) pair costs one batched product of the reader layer's
``W_Q``, ``W_K`` or ``W_V`` with the patched streams of all the writer layer's heads at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.forward import next_token_loss, widened
from ..models.interventions import VIAS, Interventions
from .ablation import check_kind, check_model, clean_run, head_mean_table
from .activations import RunResult
from .circuits import check_head
from .pieces import counted

BLOCK_BYTES = 64 << 20
"""Largest batched tensor ``measured_composition`` forms at once (patterns of a block of writers)."""


@dataclass(frozen=True)
class PathPatchResult:
    """Output of ``path_patch`` (module docstring): ``writer``, ``reader``, ``via``, ``kind``;
    ``attention_change`` and ``loss_change`` (floats); ``clean_loss`` and ``loss`` ``[batch, pos - 1]``;
    ``pattern [batch, dest, src]``, the reader's attention in the patched run; ``cache`` of that run."""

    writer: tuple[int, int]
    reader: tuple[int, int]
    via: str
    kind: str
    attention_change: float
    loss_change: float
    clean_loss: torch.Tensor
    loss: torch.Tensor
    pattern: torch.Tensor = field(repr=False)
    cache: object = field(repr=False)


def check_via(via, where: str) -> str:
    """``via`` as ``"Q"``, ``"K"`` or ``"V"`` (either case), or a ValueError."""
    if not isinstance(via, str) or via.upper() not in VIAS:
        raise ValueError(f"{where}: via must be one of {VIAS} (the reader's query, key or value), got {via!r}")
    return via.upper()


def writer_removal(model, cache, layer: int, heads: list[int], means: torch.Tensor | None) -> torch.Tensor:
    """What removing each of ``heads`` of layer ``layer`` (alone) takes from the clean residual stream,
    ``[len(heads), batch, pos, d_model]``: ``head_out - mean`` (``means [n_layers, n_heads, d_model]``,
    or zero), and with post-norms the change of the layer's normalised output (module docstring)."""
    W_O = model.W_O[layer, heads]  # [n, d_head, d_model]
    head_out = (cache.z[:, layer, heads] @ W_O).transpose(0, 1)  # [n, b, pos, d]
    replacement = 0 if means is None else means[layer, heads][:, None, None]
    if not model.cfg.post_norms:
        return head_out - replacement
    out = model.attention_output(layer, cache.z[:, layer])
    return model.attention_write(layer, out)[0] - model.attention_write(layer, out - head_out + replacement)[0]


def total_variation(patterns: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """``0.5 * sum_src |patterns - clean|``, averaged over the batch and destination positions:
    ``patterns [..., b, H, dest, src]`` against ``clean [b, H, dest, src]`` -> ``[..., H]``."""
    tv = 0.5 * (widened(patterns) - widened(clean)).abs().sum(-1)  # [..., b, H, dest]
    return tv.mean(-1).mean(-2)


def _relative_output_change(model, layer: int, head: int, z: torch.Tensor, clean_z: torch.Tensor) -> float:
    """``||(z - clean_z) W_O|| / ||clean_z W_O||`` of one head, ``z [b, pos, d_head]``."""
    W_O = widened(model.W_O[layer, head])
    change = (widened(z) - widened(clean_z)) @ W_O
    return float(change.norm() / (widened(clean_z) @ W_O).norm())


@torch.no_grad()
def path_patch(model, tokens, writer, reader, via: str, kind: str = "zero", means=None,
               clean: RunResult | None = None) -> PathPatchResult:
    """Patch the path ``writer = (l1, h1)`` -> ``reader = (l2, h2)`` (``l1 < l2``) through the reader's
    ``via`` (``"Q"``, ``"K"`` or ``"V"``) input on ``tokens`` (text, ``[pos]`` or ``[batch, pos]`` ids, at
    least 2 tokens): module docstring. ``kind="mean"`` replaces the writer's output by its mean from
    ``means`` (as ``ablate``: a ``Sweep``, ``{"heads": [L, H, d_model]}`` or that tensor). ``clean``:
    ``pcw.run(model, tokens)`` when the caller has it. Returns a ``PathPatchResult``."""
    check_model(model, "path_patch")
    l1, h1 = check_head(model, writer, "path_patch: writer")
    l2, h2 = check_head(model, reader, "path_patch: reader")
    if l1 >= l2:
        raise ValueError(f"path_patch: the writer must be in an earlier layer than the reader; got writer layer {l1}, "
                         f"reader layer {l2}")
    via = check_via(via, "path_patch")
    check_kind(kind, means, "path_patch")
    head_means = head_mean_table(model, means, "path_patch") if kind == "mean" else None
    clean = clean_run(model, tokens, clean, "path_patch")
    stream = clean.cache.resid[:, l2] - writer_removal(model, clean.cache, l1, [h1], head_means)[0]
    logits, cache = model.run_with_cache(tokens, interventions=Interventions(head_inputs={(l2, h2, via): stream}),
                                         resume=clean.cache)
    loss = next_token_loss(logits, cache.tokens)
    if via == "V":
        change = _relative_output_change(model, l2, h2, cache.z[:, l2, h2], clean.cache.z[:, l2, h2])
    else:
        change = float(total_variation(cache.patterns[:, l2, h2:h2 + 1], clean.cache.patterns[:, l2, h2:h2 + 1])[0])
    return PathPatchResult(writer=(l1, h1), reader=(l2, h2), via=via, kind=kind, attention_change=change,
                           loss_change=float((loss - clean.token_loss).mean()), clean_loss=clean.token_loss,
                           loss=loss, pattern=cache.patterns[:, l2, h2], cache=cache)


@torch.no_grad()
def measured_composition(model, tokens, via: str, kind: str = "zero", means=None,
                         clean: RunResult | None = None) -> torch.Tensor:
    """``[n_layers, n_heads, n_layers, n_heads]``: ``[l1, h1, l2, h2]`` is ``path_patch(model, tokens,
    (l1, h1), (l2, h2), via, kind, means).attention_change`` for ``l1 < l2``, NaN elsewhere (module
    docstring), on ``tokens`` (text, ``[pos]`` or ``[batch, pos]`` ids). Each (writer layer, reader
    layer) pair is one batched computation of the reader layer's ``via`` input for all the writer
    layer's heads (in blocks of at most ``BLOCK_BYTES``), counted on a progress bar past a second."""
    return counted(measured_composition_steps(model, tokens, via, kind, means, clean), "measured_composition",
                   "layer pair")


@torch.no_grad()
def measured_composition_steps(model, tokens, via: str, kind: str = "zero", means=None,
                               clean: RunResult | None = None):
    """``measured_composition`` in pieces (``analysis.pieces``), for a caller that shows progress or
    gives way between them (the explorer's composition view): one (writer layer, reader layer) pair
    each, yielding ``(done, total)`` (``total = n_layers (n_layers - 1) / 2``), first ``(0, total)`` once
    the input is checked; returns the matrix."""
    check_model(model, "measured_composition")
    via = check_via(via, "measured_composition")
    check_kind(kind, means, "measured_composition")
    head_means = head_mean_table(model, means, "measured_composition") if kind == "mean" else None
    c = model.cfg
    L, H = c.n_layers, c.n_heads
    cache = clean_run(model, tokens, clean, "measured_composition", min_tokens=1).cache
    b, pos = cache.tokens.shape
    dtype = widened(torch.empty(0, dtype=model.dtype)).dtype
    out = torch.full((L, H, L, H), float("nan"), dtype=dtype, device=model.device)
    total = L * (L - 1) // 2
    yield 0, total
    # what each reader layer's unpatched inputs give: clean queries (via K), keys (via Q), the head's
    # clean z and its W_O's Gram (via V: ||dz W_O||^2 = dz (W_O W_O^T) dz^T, in float64)
    clean_inputs = {}
    for l2 in range(1, L):
        xn = model.layer_read(cache.resid[:, l2])[0]
        clean_inputs[l2] = model.project(l2, xn, "K" if via == "Q" else "Q") if via != "V" else \
            (cache.z[:, l2].double(), model.W_O[l2].double() @ model.W_O[l2].double().mT)
    row_bytes = 16 * b * pos * (H * max(pos, c.d_head) + c.d_model)  # a writer's stream and patterns, 4 copies
    block = max(1, BLOCK_BYTES // row_bytes)
    done = 0
    for l1 in range(L - 1):
        removal = writer_removal(model, cache, l1, list(range(H)), head_means)  # [H, b, pos, d]
        for l2 in range(l1 + 1, L):
            for start in range(0, H, block):
                heads = slice(start, min(start + block, H))
                out[l1, heads, l2] = _reader_change(model, cache, l2, via, removal[heads], clean_inputs[l2])
            done += 1
            yield done, total
    return out


def _reader_change(model, cache, layer: int, via: str, removal: torch.Tensor, clean_input) -> torch.Tensor:
    """``attention_change`` ``[n_writers, H]`` of every head of ``layer`` when each writer's ``removal
    [n_writers, b, pos, d_model]`` is taken from its ``via`` input."""
    n, b, pos, d = removal.shape
    patched = (cache.resid[:, layer][None] - removal).reshape(n * b, pos, d)
    x = model.project(layer, model.layer_read(patched)[0], via)  # [n * b, H, pos, d_head]
    x = x.reshape(n, b, *x.shape[1:])
    if via == "V":  # the pattern is the clean one; only the values change
        clean_z, gram = clean_input  # [b, H, pos, d_head], [H, d_head, d_head]
        dz = (cache.patterns[:, layer] @ x).double() - clean_z  # [n, b, H, pos, d_head]
        change = (torch.einsum("nbhpe,hef->nbhpf", dz, gram) * dz).sum((1, 3, 4))
        norm = (torch.einsum("bhpe,hef->bhpf", clean_z, gram) * clean_z).sum((0, 2, 3))
        return (change / norm).sqrt()
    q, k = (x, clean_input) if via == "Q" else (clean_input, x)
    return total_variation(model.attention_pattern(layer, q, k), cache.patterns[:, layer])
