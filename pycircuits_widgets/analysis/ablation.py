"""Ablation: remove attention heads or MLP neurons from a forward pass and measure the loss change.

``ablate(model, tokens, heads=[(l, h), ...], neurons=[(l, n), ...], kind="zero" | "mean")``:

* a head's output ``head_out = z @ W_O`` is replaced by zero (``kind="zero"``: the forward with the
  head's ``W_O`` set to zero) or by its mean output over a corpus (``kind="mean"``, from
  ``means``, a ``Sweep``'s ``head_means()``);
* an MLP neuron's activation (what ``W_out`` reads) by zero or by its mean (``neuron_means()``).

Every later layer is recomputed on the changed stream (post-norms divide the changed output), in the
model's own forward (``run_with_cache(interventions=...)``). It resumes from the clean run's residual
stream at the first ablated layer, so the layers before it are not run again.

The helpers here (``check_model``, ``clean_run``, ``check_kind``, ``head_mean_table``)
are shared with ``path_patching``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.circuit_model import CircuitModel, weight_shapes
from ..models.forward import next_token_loss
from ..models.indices import check_pair
from ..models.interventions import Interventions
from .activations import RunResult, run
from .finite import require_finite
from .pieces import counted

KINDS = ("zero", "mean")


@dataclass(frozen=True)
class AblationResult:
    """Output of ``ablate``: ``heads`` and ``neurons`` ablated (``(layer, index)`` tuples), ``kind``;
    ``clean_loss`` and ``loss`` ``[batch, pos - 1]``, the per-token next-token loss (nats) of the
    clean and the ablated run; ``logits [batch, pos, d_vocab]`` and ``cache`` of the ablated run."""

    heads: tuple
    neurons: tuple
    kind: str
    clean_loss: torch.Tensor
    loss: torch.Tensor
    logits: torch.Tensor = field(repr=False)
    cache: object = field(repr=False)

    @property
    def loss_change(self) -> float:
        """Mean per-token loss change, ablated minus clean (nats)."""
        return float((self.loss - self.clean_loss).mean())


def check_kind(kind, means, where: str) -> None:
    """Refuse an unknown ``kind``, ``kind="mean"`` without means, and means given to ``kind="zero"``."""
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {KINDS}, got {kind!r}")
    if kind == "zero" and means is not None:
        raise ValueError(f"{where}: means are read by kind='mean' only (kind='zero' given with means)")
    if kind == "mean" and means is None:
        raise ValueError(f"{where}(kind='mean') needs each head's mean output over a corpus: pass "
                         "means=pcw.sweep(model, corpus, store) (a Sweep), or means={'heads': [n_layers, n_heads, "
                         "d_model], 'neurons': [n_layers, d_mlp]} tensors")


def check_model(model, where: str) -> None:
    """Refuse (``TypeError`` naming ``where``) anything but a ``CircuitModel``."""
    if not isinstance(model, CircuitModel):
        raise TypeError(f"{where}: model must be a CircuitModel (pcw.load_pretrained, pcw.from_hf, ...), got "
                        f"{type(model).__name__}")


def _pairs(values, sizes, names, where: str) -> tuple:
    """A list of pairs, checked, duplicates dropped (first order kept)."""
    if values is None:
        return ()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{where}: expected a list of ({names[0]}, {names[1]}) pairs, got {type(values).__name__}")
    values = list(values)
    if values and not isinstance(values[0], (tuple, list, torch.Tensor, np.ndarray)):
        raise ValueError(f"{where}: expected a list of ({names[0]}, {names[1]}) pairs, e.g. [(0, 4)], got {values!r}")
    return tuple(dict.fromkeys(check_pair(v, sizes, names, f"{where}: {v!r}:") for v in values))


def _mean_table(means, name: str, method: str, shape: tuple[int, ...], model, where: str) -> torch.Tensor:
    """``means``' table ``name`` (``"heads"`` / ``"neurons"``): a dict entry, the ``method`` of a
    ``Sweep``-like object, or (heads) a tensor; checked ``shape``, finite, in the model's dtype."""
    if isinstance(means, dict):
        unknown = sorted(set(means) - {"heads", "neurons"})
        if unknown:
            raise ValueError(f"{where}: means has unknown keys {unknown}; expected 'heads' and/or 'neurons'")
        table = means.get(name)
    elif hasattr(means, method):
        if hasattr(means, "check_model"):  # a Sweep: of this model only, as the explorer requires
            means.check_model(model, where)
        table = getattr(means, method)()
    elif isinstance(means, (torch.Tensor, np.ndarray)) and name == "heads":
        table = means
    else:
        raise TypeError(f"{where}: means must be a Sweep (with {method}()), a dict {{'heads': ..., 'neurons': ...}} "
                        f"or a heads tensor {list(shape)}; got {type(means).__name__}")
    if table is None:
        raise ValueError(f"{where}: means has no {name} means ({method}() gave None); the {name} ablated with "
                         "kind='mean' need them")
    table = torch.as_tensor(table)
    if tuple(table.shape) != shape:
        raise ValueError(f"{where}: the {name} means have shape {tuple(table.shape)}, expected {list(shape)}")
    if not bool(torch.isfinite(table).all()):
        raise ValueError(f"{where}: the {name} means have non-finite values")
    return table.to(device=model.device, dtype=model.dtype)


def head_mean_table(model, means, where: str) -> torch.Tensor:
    """Each head's mean output ``[n_layers, n_heads, d_model]`` from ``means`` (see ``ablate``)."""
    c = model.cfg
    return _mean_table(means, "heads", "head_means", (c.n_layers, c.n_heads, c.d_model), model, where)


def clean_run(model, tokens, clean: RunResult | None, where: str, min_tokens: int = 2) -> RunResult:
    """``clean`` (the caller's ``pcw.run(model, tokens)``, refused unless it is this model's clean run of
    these tokens) or a new clean run; refuses fewer than ``min_tokens`` tokens per sequence."""
    if clean is None:
        clean = run(model, tokens)
    elif not isinstance(clean, RunResult):
        raise TypeError(f"{where}: clean must be the RunResult of pcw.run(model, tokens), got {type(clean).__name__}")
    else:  # checked here, not only by a resumed forward: measured composition reads it without one
        ids = model._as_tokens(tokens)
        model.check_clean_cache(clean.cache, ids[None] if ids.ndim == 1 else ids, f"{where}: clean")
    if clean.tokens.shape[1] < min_tokens:
        raise ValueError(f"{where}: needs at least {min_tokens} tokens per sequence (the next token's loss), got "
                         f"{clean.tokens.shape[1]}")
    # NaN/inf weights would make every measured change NaN: refused here, naming the weight
    weights = [name for name in weight_shapes(model.cfg) if getattr(model, name) is not None]
    require_finite(clean.logits, f"{where}: the clean run's logits", model, weights)
    return clean


@torch.no_grad()
def ablate(model, tokens, heads=(), neurons=(), kind: str = "zero", means=None,
           clean: RunResult | None = None) -> AblationResult:
    """Ablate ``heads`` (``[(layer, head), ...]``) and ``neurons`` (``[(layer, neuron), ...]``) on
    ``tokens`` (text, ``[pos]`` or ``[batch, pos]`` ids, at least 2 tokens): the per-token loss with
    and without them (module docstring).

    ``kind="zero"``: outputs (activations) set to zero, the same as each head's ``W_O`` (each neuron's
    ``W_out`` row) set to zero. ``kind="mean"``: set to their mean over a corpus, from ``means``: a
    ``Sweep`` (``pcw.sweep(model, corpus, store)``; any object with ``head_means() -> [n_layers, n_heads, d_model]`` and
    ``neuron_means() -> [n_layers, d_mlp]``), a dict with those tensors as ``"heads"`` / ``"neurons"``,
    or the heads' tensor alone. ``clean``: ``pcw.run(model, tokens)`` when the caller has it (not run again).
    Returns an ``AblationResult`` (``.clean_loss``, ``.loss`` ``[batch, pos - 1]``, ``.logits``, ``.cache``,
    ``.loss_change``)."""
    check_model(model, "ablate")
    c = model.cfg
    heads = _pairs(heads, (c.n_layers, c.n_heads), ("layer", "head"), "ablate: heads")
    if neurons and c.attn_only:
        raise ValueError(f"ablate: neurons given, but {c.name!r} is attention-only (no MLP neurons)")
    neurons = _pairs(neurons, (c.n_layers, c.d_mlp or 0), ("layer", "neuron"), "ablate: neurons")
    if not heads and not neurons:
        raise ValueError("ablate: nothing to ablate; pass heads=[(layer, head), ...] and/or neurons=[(layer, neuron), "
                         "...]")
    check_kind(kind, means, "ablate")
    head_means = head_mean_table(model, means, "ablate") if kind == "mean" and heads else None
    neuron_means = None
    if kind == "mean" and neurons:
        neuron_means = _mean_table(means, "neurons", "neuron_means", (c.n_layers, c.d_mlp), model, "ablate")
    clean = clean_run(model, tokens, clean, "ablate")
    edits = Interventions(heads={(l, h): None if head_means is None else head_means[l, h] for l, h in heads},
                          neurons={(l, n): None if neuron_means is None else neuron_means[l, n] for l, n in neurons})
    logits, cache = model.run_with_cache(tokens, interventions=edits, resume=clean.cache)
    return AblationResult(heads=heads, neurons=neurons, kind=kind, clean_loss=clean.token_loss,
                          loss=next_token_loss(logits, cache.tokens), logits=logits, cache=cache)


def head_loss_changes(model, tokens, kind: str = "zero", means=None, clean: RunResult | None = None) -> torch.Tensor:
    """``[n_layers, n_heads]`` float32: ``[l, h]`` is ``ablate(model, tokens, heads=[(l, h)], kind, means,
    clean).loss_change``, each head ablated alone (the mean per-token loss change, nats). One resumed
    forward per head (from the clean run at the head's layer), counted on a progress bar past a second."""
    return counted(head_loss_changes_steps(model, tokens, kind, means, clean), "head_loss_changes", "head")


def head_loss_changes_steps(model, tokens, kind: str = "zero", means=None, clean: RunResult | None = None):
    """``head_loss_changes`` in pieces (``analysis.pieces``): one head's ablation each, yielding ``(done,
    n_layers * n_heads)`` after it; returns the table. The arguments are checked, and the clean run made,
    before the first yield."""
    check_model(model, "head_loss_changes")
    check_kind(kind, means, "head_loss_changes")
    clean = clean_run(model, tokens, clean, "head_loss_changes")
    L, H = model.cfg.n_layers, model.cfg.n_heads
    table = torch.full((L, H), float("nan"))
    yield 0, L * H
    for i in range(L * H):
        table[divmod(i, H)] = ablate(model, clean.tokens, heads=[divmod(i, H)], kind=kind, means=means,
                                     clean=clean).loss_change
        yield i + 1, L * H
    return table
