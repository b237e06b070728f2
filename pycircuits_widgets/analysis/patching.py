"""Task circuits, first part: a counterfactual task and exact activation patching.

A **task** (``Task``) is the field's counterfactual set-up: clean prompts that show a behaviour,
corrupted prompts that differ in the one thing the behaviour needs (pairwise of the same token length),
an answer pair per prompt (the correct token and the wrong one, read at ``position``, the last by
default) and a metric of the logits: ``"logit_diff"``, the mean over prompts of
``logits[correct] - logits[wrong]``, or a callable ``(logits [batch, pos, d_vocab], task) -> scalar``.
Both runs are made once, with their caches.

**Exact activation patching** (``activation_patch``): for each cell of a site, the forward of the base
run (the corrupted one to *denoise*, the clean one to *noise*) with that cell's activation taken from
the other run, through the model's own interventions (``models.interventions``), resumed from the base
run at the cell's layer. The cells of a layer run as one batched resumed forward: the base prompts
repeated once per cell, block ``i`` of the batch patching cell ``i`` (every value a block does not patch
is the base run's own), the metric read per block; a layer whose cells' copies would take more than
``PATCH_BATCH_BYTES`` runs in chunks of cells, a batched forward each. The result is normalised so that 0
is the corrupted run's metric and 1 the clean run's (``Task.normalise``). Sites, and the result's shape:

==================  ============  ==============================================================
``"resid_pre"``     ``[L, P]``    the residual stream before layer ``l`` at position ``p``
``"head_out"``      ``[L, H]``    head ``(l, h)``'s output ``z @ W_O`` at every position
``"head_out_pos"``  ``[L, H, P]`` the same at one position
``"q_input"``       ``[L, H]``    the stream head ``(l, h)``'s query reads (the residual stream
``"k_input"``                     before layer ``l``, through the layer's own norm: TransformerLens's
``"v_input"``                     split inputs), its key's, its value's, at every position
``"attn_out"``      ``[L, P]``    every head of layer ``l`` at position ``p`` (the attention block's output)
``"pattern"``       ``[L, H]``    head ``(l, h)``'s attention pattern (over its own values)
``"mlp_out"``       ``[L, P]``    layer ``l``'s MLP output at position ``p`` (models with MLPs: every
                                  neuron's post-activation there, which the output is a function of)
``"neuron"``        ``[L, N]``    neuron ``n``'s activation at every position (``top=k``: only the ``k``
                                  of each layer the attribution estimate ranks first, the rest NaN)
==================  ============  ==============================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.interventions import Interventions
from .ablation import check_model
from .pieces import counted

METRICS = ("logit_diff",)
SITES = {"resid_pre": ("layer", "position"), "head_out": ("layer", "head"), "head_out_pos": ("layer", "head", "position"),
         "q_input": ("layer", "head"), "k_input": ("layer", "head"), "v_input": ("layer", "head"),
         "attn_out": ("layer", "position"), "pattern": ("layer", "head"), "mlp_out": ("layer", "position"),
         "neuron": ("layer", "neuron")}
"""Each site's cells, by the names of the result's dimensions (module docstring)."""
DIRECTIONS = ("denoise", "noise")
EVERY_NEURON_MAX = 4096
"""The most neurons ``activation_patch(site="neuron")`` patches without ``top`` (a forward's copy of the
prompts each: GPT-2 small's 36,864 would take hours); past it, ``top`` is asked for."""
PATCH_BATCH_BYTES = 2**30
"""The most memory the activations of one batched patched forward take, as ``block_bytes`` estimates them
(``activation_patch`` patches as many cells in one forward as fit): 1 GiB, what a notebook on a laptop
spares. A forward of many copies of the prompts runs the layers' products on more rows at once (the
point of batching) but holds each copy's cache; at GPT-2-small's shape with 4 prompts of 20 tokens a copy
is about 26 MB and a layer's 12 heads run in one forward, while one 1,024-token prompt (about 1.6 GB a
copy) runs one cell a forward, as unbatched patching does."""


def _prompts(model, prompts, which: str) -> tuple[list[torch.Tensor], list[str]]:
    """Each prompt of ``prompts`` (a text, a list of texts, or ids ``[pos]`` / ``[batch, pos]`` / a list of
    id lists) as ``[pos]`` ids, with its display for messages."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, torch.Tensor) and prompts.ndim == 2:
        prompts = list(prompts)
    elif isinstance(prompts, torch.Tensor) or (isinstance(prompts, (list, tuple)) and prompts
                                               and all(isinstance(p, int) for p in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"Task: {which} must be one or more prompts (texts or token ids), got "
                         f"{type(prompts).__name__ if not isinstance(prompts, (list, tuple)) else 'none'}")
    ids = [model._as_tokens(p) for p in prompts]
    for i, p in enumerate(ids):
        if p.ndim != 1:
            raise ValueError(f"Task: {which} prompt {i} must be one sequence of token ids, got shape {list(p.shape)}")
    return ids, [repr(model.to_str_tokens(p)) for p in ids]


def _answer_id(model, answer, where: str) -> int:
    """One answer token: an id in the vocabulary, or a text that is exactly one token."""
    if isinstance(answer, str):
        ids = model.to_tokens(answer).tolist()
        if len(ids) != 1:
            raise ValueError(f"Task: {where} {answer!r} is {len(ids)} tokens {model.to_str_tokens(answer)}; an answer "
                             "must be one token (the logit read is one token's)")
        return ids[0]
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < model.cfg.d_vocab:
        raise ValueError(f"Task: {where} must be a token id in 0..{model.cfg.d_vocab - 1} or a one-token text, "
                         f"got {answer!r}")
    return answer


class Task:
    """A counterfactual task (module docstring). ``clean``, ``corrupted``: prompts, texts or token ids,
    pairwise of the same token length and all of one length (one batch); ``answers``: one ``(correct,
    wrong)`` pair per prompt (ids or one-token texts), read at ``position`` (default the last); ``metric``:
    ``"logit_diff"`` or a callable ``(logits [batch, pos, d_vocab], task) -> scalar``.

    ``tokens_clean``, ``tokens_corrupted`` ``[batch, pos]``; ``answer_ids [batch, 2]`` (correct, wrong);
    ``clean``, ``corrupted``: their runs' ``ActivationCache``; ``metric_clean``, ``metric_corrupted``:
    the metric of each run (floats)."""

    def __init__(self, model, clean, corrupted, answers=None, metric="logit_diff", position: int = -1):
        check_model(model, "Task")
        ids_clean, shown_clean = _prompts(model, clean, "clean")
        ids_corrupted, shown_corrupted = _prompts(model, corrupted, "corrupted")
        if len(ids_clean) != len(ids_corrupted):
            raise ValueError(f"Task: {len(ids_clean)} clean prompts but {len(ids_corrupted)} corrupted ones; they "
                             "come in pairs")
        for i, (a, b) in enumerate(zip(ids_clean, ids_corrupted)):
            if len(a) != len(b):
                raise ValueError(f"Task: pair {i} differs in token length: the clean prompt is {len(a)} tokens "
                                 f"{shown_clean[i]}, the corrupted one {len(b)} tokens {shown_corrupted[i]}")
        lengths = sorted({len(a) for a in ids_clean})
        if len(lengths) > 1:
            first = next(i for i, a in enumerate(ids_clean) if len(a) != len(ids_clean[0]))
            raise ValueError(f"Task: prompts are run as one batch and must be of one token length; prompt 0 is "
                             f"{len(ids_clean[0])} tokens, prompt {first} {len(ids_clean[first])} "
                             f"{shown_clean[first]}")
        n_pos = lengths[0]
        if isinstance(position, bool) or not isinstance(position, int) or not -n_pos <= position < n_pos:
            raise ValueError(f"Task: position must be an int in {-n_pos}..{n_pos - 1} (the prompts are {n_pos} "
                             f"tokens), got {position!r}")
        if callable(metric):
            metric_fn = metric
        elif metric in METRICS:
            if answers is None:
                raise ValueError("Task: metric='logit_diff' needs answers: a (correct, wrong) pair per prompt")
            metric_fn = logit_diff
        else:
            raise ValueError(f"Task: metric must be one of {METRICS} or a callable (logits, task) -> scalar, "
                             f"got {metric!r}")
        pairs = []
        if answers is not None:
            if not isinstance(answers, (list, tuple)) or len(answers) != len(ids_clean):
                raise ValueError(f"Task: answers must be a list of one (correct, wrong) pair per prompt "
                                 f"({len(ids_clean)}), got {answers!r}"[:300])
            for i, pair in enumerate(answers):
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise ValueError(f"Task: answers[{i}] must be a (correct, wrong) pair, got {pair!r}")
                pairs.append([_answer_id(model, a, f"answers[{i}][{j}]") for j, a in enumerate(pair)])
        self.model, self.position, self.metric_fn = model, position, metric_fn
        self.tokens_clean, self.tokens_corrupted = torch.stack(ids_clean), torch.stack(ids_corrupted)
        self.answer_ids = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
        mlp = not model.cfg.attn_only  # (the neurons' post-activations: the mlp_out site patches them)
        with torch.no_grad():
            logits_clean, self.clean = model.run_with_cache(self.tokens_clean, mlp_post=mlp)
            logits_corrupted, self.corrupted = model.run_with_cache(self.tokens_corrupted, mlp_post=mlp)
        self.metric_clean = self.metric(logits_clean, "the clean run")
        self.metric_corrupted = self.metric(logits_corrupted, "the corrupted run")
        if abs(self.metric_clean - self.metric_corrupted) <= 1e-6 * max(1.0, abs(self.metric_clean)):
            raise ValueError(f"Task: the metric is {self.metric_clean:.6g} on both the clean and the corrupted run: "
                             "there is no behaviour to patch (the corruption changes nothing the metric reads)")

    def metric(self, logits: torch.Tensor, where: str = "a patched run") -> float:
        """The task's metric of ``logits [batch, pos, d_vocab]`` (a float; refused unless a finite scalar)."""
        return self._number(self.metric_fn(logits, self), where)

    @staticmethod
    def _number(value, where: str) -> float:
        """A metric's value as a float, refused unless a finite scalar (naming ``where``)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"Task: the metric must give a scalar, got a tensor of shape {list(value.shape)} on "
                                 f"{where}")
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"Task: the metric must give a number, got {type(value).__name__} on {where}")
        if not math.isfinite(value):
            raise ValueError(f"Task: the metric is {value} on {where}; it must be finite")
        return float(value)

    def run_metric(self, tokens: torch.Tensor, interventions: Interventions, resume, where: str) -> float:
        """The metric of the forward of ``tokens`` with ``interventions``, resumed from ``resume`` (a float;
        refused unless a finite scalar, naming ``where``)."""
        return self.run_metrics(tokens, interventions, resume, [where])[0]

    def run_metrics(self, tokens: torch.Tensor, interventions: Interventions, resume, wheres: list[str]) -> list[float]:
        """The metric of each block of the forward of ``tokens`` (the task's batch of ``b`` prompts repeated
        ``len(wheres)`` times, ``[len(wheres) * b, pos]``, block-major) with ``interventions``, resumed from
        ``resume``: a float per block, each refused unless a finite scalar, naming its ``wheres[i]``."""
        values = self.metric_blocks(tokens, interventions, resume, len(wheres))
        return [self._number(value, where) for value, where in zip(values, wheres)]

    def metric_tensor(self, tokens: torch.Tensor, interventions: Interventions | None, resume=None):
        """The metric of the forward of ``tokens`` with ``interventions`` (resumed from ``resume``, a clean
        cache, or None), as the metric computes it: a tensor differentiable through the forward where the
        metric is (``metric_blocks`` of one block)."""
        return self.metric_blocks(tokens, interventions, resume, 1)[0]

    @property
    def reads_answers_only(self) -> bool:
        """Whether ``metric_blocks`` unembeds only the answers' columns at ``position`` (the logit difference
        of a float32 or float64 model), not the whole logits ``[batch, pos, d_vocab]``."""
        return self.metric_fn is logit_diff and self.model.dtype in (torch.float32, torch.float64)

    def metric_blocks(self, tokens: torch.Tensor, interventions: Interventions | None, resume=None,
                      blocks: int = 1) -> list:
        """The metric of each of ``blocks`` blocks of the forward of ``tokens`` (``[blocks * b, pos]``: the task's
        batch of ``b`` prompts repeated, block-major, each block its own run) with ``interventions`` (resumed
        from ``resume``, a clean cache of ``tokens``, or None): a list of what the metric gives, each
        differentiable through the forward where the metric is. The logit difference reads two logits per
        prompt (``reads_answers_only``): that forward then stops at the final stream and unembeds only the
        answers' columns at ``position``, not ``[blocks * b, pos, d_vocab]`` (a half-precision model, whose
        cache holds the stream rounded, and any other metric read the whole logits)."""
        b = len(self.tokens_clean)
        if self.reads_answers_only:
            _, cache = self.model.run_with_cache(tokens, interventions=interventions, resume=resume, logits=False)
            xn = self.model.read(cache.resid[:, -1, self.position])[0]  # [blocks * b, d_model]
            every = self.model.unembed(xn, self.answer_ids.flatten().to(xn.device))  # [blocks * b, 2 * b]
            rows = torch.arange(len(xn), device=xn.device)
            own = every.view(len(xn), b, 2)[rows, rows % b]  # [blocks * b, 2]: each row's own prompt's answers
            return list(_mean_difference(own.view(blocks, b, 2)).unbind())
        logits, _ = self.model.run_with_cache(tokens, interventions=interventions, resume=resume)
        return [self.metric_fn(logits[i * b:(i + 1) * b], self) for i in range(blocks)]

    def normalise(self, value: float) -> float:
        """``value`` on the scale where the corrupted run's metric is 0 and the clean run's 1."""
        return (value - self.metric_corrupted) / (self.metric_clean - self.metric_corrupted)

    @property
    def n_pos(self) -> int:
        return self.tokens_clean.shape[1]

    def __repr__(self) -> str:
        return (f"Task({len(self.tokens_clean)} prompt pairs of {self.n_pos} tokens, metric clean "
                f"{self.metric_clean:.4g}, corrupted {self.metric_corrupted:.4g})")


def logit_diff(logits: torch.Tensor, task: Task) -> torch.Tensor:
    """``"logit_diff"``: the mean over prompts of ``logits[i, position, correct_i] - logits[i, position,
    wrong_i]``, in float64."""
    at = logits[:, task.position]  # [batch, d_vocab]
    rows = torch.arange(at.shape[0], device=at.device)
    return _mean_difference(at[rows[:, None], task.answer_ids.to(at.device)])


def _mean_difference(answers: torch.Tensor) -> torch.Tensor:
    """The mean over prompts of ``correct - wrong``, of their logits ``answers [..., batch, 2]``, in float64:
    ``[...]``."""
    answers = answers.double()
    return (answers[..., 0] - answers[..., 1]).mean(-1)


@dataclass(frozen=True)
class PatchResult:
    """``scores`` (float64, the site's shape, normalised: 0 the corrupted run, 1 the clean one) of patching
    ``site`` in ``direction``; ``dims`` names its dimensions (``SITES``)."""

    site: str
    direction: str
    scores: torch.Tensor
    dims: tuple[str, ...]


def head_outs(model, cache, layer: int) -> torch.Tensor:
    """``[b, H, pos, d_model]``: what each head of ``layer`` writes (``z @ W_O``, without ``b_O``)."""
    return torch.einsum("bhpe,hed->bhpd", cache.z[:, layer], model.W_O[layer])


def block_bytes(model, task: Task) -> int:
    """The bytes one copy of the task's prompts (a block: ``b`` prompts of ``pos`` tokens) takes in a batched
    patched forward, at most: per token, its cache and the base run's copy it resumes from (each
    ``(2 L + 1) d_model + L H (pos + d_head)`` numbers: the stream before each layer and the final one, each
    MLP's output, the patterns and the heads' ``z``), the values patched in (at most ``H (d_model + pos)``,
    every head's output, input or pattern, or ``d_mlp``, every neuron's), the MLP's hidden activations
    (three ``d_mlp``: before and after the nonlinearity, and a gate's) and, for a metric that reads the whole
    logits (``Task.reads_answers_only`` False), ``d_vocab``; in the model's dtype, float32 at least (a
    half-precision model's stream is float32)."""
    c, pos = model.cfg, task.n_pos
    d_mlp = 0 if c.attn_only else c.d_mlp
    cache = (2 * c.n_layers + 1) * c.d_model + c.n_layers * c.n_heads * (pos + c.d_head)
    per_token = 2 * cache + max(c.n_heads * (c.d_model + pos), d_mlp) + 3 * d_mlp
    per_token += 0 if task.reads_answers_only else c.d_vocab
    return len(task.tokens_clean) * pos * per_token * max(model.W_E.element_size(), 4)


def activation_patch(model, task: Task, site: str, direction: str = "denoise", top: int | None = None,
                     cells_per_forward: int | None = None) -> PatchResult:
    """Exact activation patching of ``site`` (module docstring) for ``task``: one batched resumed forward
    per layer (or per chunk of ``cells_per_forward`` of its cells). ``direction="denoise"``: the corrupted
    run with one activation from the clean run; ``"noise"``: the clean run with one from the corrupted run.
    ``top`` (site ``"neuron"`` only): patch only the ``top`` neurons of each layer with the largest
    attribution estimate (``attribution_patch``), the other cells NaN; None: every neuron.
    ``cells_per_forward``: the most cells one forward patches (each a copy of the task's prompts); None:
    as many as ``PATCH_BATCH_BYTES`` holds. Returns a ``PatchResult`` (normalised scores), its layers
    counted on a progress bar past a second."""
    return counted(activation_patch_steps(model, task, site, direction, top, cells_per_forward=cells_per_forward),
                   "activation_patch", "layer")


def activation_patch_steps(model, task: Task, site: str, direction: str = "denoise", top: int | None = None,
                           into: dict | None = None, cells_per_forward: int | None = None):
    """``activation_patch`` in pieces (``analysis.pieces``): one layer's cells each, yielding ``(done,
    n_layers)`` after it; returns the ``PatchResult``. The arguments are checked before the first yield.
    ``into`` (a dict, optional) gets ``"scores"``, the result's tensor, filled in as the layers end (NaN
    before), for a caller that shows the cells while the rest come."""
    check_patching(model, task, site, SITES, direction, "activation_patch")
    if cells_per_forward is not None and (isinstance(cells_per_forward, bool) or not isinstance(cells_per_forward, int)
                                          or cells_per_forward < 1):
        raise ValueError(f"activation_patch: cells_per_forward must be None or an int >= 1 (the most cells one "
                         f"forward patches), got {cells_per_forward!r}")
    if top is not None and (site != "neuron" or isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ValueError(f"activation_patch: top is an int >= 1 for site 'neuron' (the neurons of each layer to "
                         f"patch), got top={top!r} for site {site!r}")
    if site == "neuron" and top is None and model.cfg.n_layers * model.cfg.d_mlp > EVERY_NEURON_MAX:
        raise ValueError(f"activation_patch: site 'neuron' of every one of {model.cfg.n_layers * model.cfg.d_mlp} "
                         f"neurons is a forward each (more than {EVERY_NEURON_MAX}): pass top=k to patch the k of each "
                         "layer attribution patching ranks first")
    base, source = (task.corrupted, task.clean) if direction == "denoise" else (task.clean, task.corrupted)
    tokens = task.tokens_corrupted if direction == "denoise" else task.tokens_clean
    c = model.cfg
    sizes = {"layer": c.n_layers, "head": c.n_heads, "position": task.n_pos, "neuron": c.d_mlp}
    dims = SITES[site]
    scores = torch.full([sizes[d] for d in dims], float("nan"), dtype=torch.float64)
    neurons = None
    if site == "neuron":
        neurons = torch.arange(c.d_mlp).expand(c.n_layers, -1)
        if top is not None:
            from .attribution import attribution_patch  # (attribution builds on this module)

            unpatched = 0.0 if direction == "denoise" else 1.0
            effect = (attribution_patch(model, task, "neuron", direction).scores - unpatched).abs()
            neurons = effect.argsort(1, descending=True)[:, :top]
    if into is not None:
        into["scores"] = scores
    per_forward = cells_per_forward or max(1, PATCH_BATCH_BYTES // block_bytes(model, task))
    yield 0, c.n_layers
    for layer in range(c.n_layers):
        cells = _cells(model, site, layer, task.n_pos, None if neurons is None else neurons[layer].tolist())
        with torch.no_grad():
            for first in range(0, len(cells), per_forward):
                chunk = cells[first:first + per_forward]
                n = len(chunk)
                # one forward for the chunk: the base prompts once per cell, from the base run at this layer
                metrics = task.run_metrics(tokens.repeat(n, 1), _patched(model, site, layer, chunk, base, source),
                                           base if n == 1 else base.repeated(n, layer + 1),
                                           [f"{site} {cell}" for cell in chunk])
                for cell, metric in zip(chunk, metrics):
                    scores[cell] = task.normalise(metric)
        yield layer + 1, c.n_layers
    return PatchResult(site, direction, scores, dims)


def checked_task(task, model, where: str):
    """``task`` (None, or a ``Task`` of ``model``: the same weights, a view of them made to read token ids
    included), or the error naming ``where``."""
    if task is None:
        return None
    if not isinstance(task, Task):
        raise TypeError(f"{where}: task must be a pcw.Task(model, clean, corrupted, answers), got "
                        f"{type(task).__name__}")
    if task.model.W_E is not model.W_E:
        raise ValueError(f"{where}: the task is of another model ({task.model.cfg.name!r}); make it with this one: "
                         "pcw.Task(model, clean, corrupted, answers)")
    return task


def check_patching(model, task: Task, site: str, sites: dict, direction: str, where: str) -> None:
    """Refuse, naming ``where`` and what was wrong, a patching call's model, task, site (one of ``sites``)
    or direction, and a site of the MLPs on an attention-only model."""
    check_model(model, where)
    if not isinstance(task, Task) or task.model is not model:
        raise TypeError(f"{where}: task must be the pcw.Task of this model (pcw.Task(model, clean, corrupted, "
                        f"answers)), got {type(task).__name__ if not isinstance(task, Task) else 'another model'}")
    if site not in sites:
        raise ValueError(f"{where}: site must be one of {tuple(sites)}, got {site!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"{where}: direction must be one of {DIRECTIONS}, got {direction!r}")
    if site in ("mlp_out", "neuron") and model.cfg.attn_only:
        raise ValueError(f"{where}: site {site!r} needs MLPs; {model.cfg.name!r} is attention-only")


def _cells(model, site: str, layer: int, n_pos: int, neurons: list[int] | None = None) -> list[tuple[int, ...]]:
    """The index in the result of each cell of ``site`` in ``layer`` (``neurons``: the layer's neurons to patch,
    site ``"neuron"``)."""
    c = model.cfg
    second = {"position": range(n_pos), "head": range(c.n_heads), "neuron": neurons}[SITES[site][1]]
    if site == "head_out_pos":
        return [(layer, h, p) for h in range(c.n_heads) for p in range(n_pos)]
    return [(layer, i) for i in second]


def _site_values(model, site: str, layer: int, run) -> torch.Tensor:
    """``[b, keys, ...]``: what ``site`` patches in ``layer`` of ``run`` (a cache), by the key of the
    intervention that replaces it (a head, a neuron, or the site's one tensor, key 0)."""
    if site in ("head_out", "head_out_pos", "attn_out"):
        return head_outs(model, run, layer)  # [b, H, pos, d_model]
    if site == "pattern":
        return run.patterns[:, layer]  # [b, H, dest, src]
    if site == "neuron":
        return run.mlp_post[:, layer].movedim(-1, 1)  # [b, d_mlp, pos]
    if site == "mlp_out":
        return run.mlp_post[:, layer, None]  # [b, 1, pos, d_mlp]: every neuron's, its output a function of them
    stream = run.resid[:, layer, None]  # [b, 1, pos, d_model]: resid_pre's, and what q, k, v inputs read
    return stream if site == "resid_pre" else stream.expand(-1, model.cfg.n_heads, -1, -1)


def _patched(model, site: str, layer: int, cells: list[tuple[int, ...]], base, source) -> Interventions:
    """The interventions of one forward of the base prompts repeated ``len(cells)`` times (``[len(cells) * b,
    pos]``, block-major) in which block ``i`` patches ``cells[i]`` (of ``site`` in ``layer``) and nothing
    else: each value replaced is ``source``'s in the blocks of the cells that patch it, ``base``'s own (what
    the forward computes there anyway) in the others. ``base``, ``source``: the patched run's cache and the
    run its activations come from."""
    n, H = len(cells), model.cfg.n_heads
    ours, theirs = _site_values(model, site, layer, base), _site_values(model, site, layer, source)
    values: dict[int, torch.Tensor] = {}  # key -> [n, b, ...]
    for i, cell in enumerate(cells):
        keys = range(H) if site == "attn_out" else [0] if site in ("resid_pre", "mlp_out") else [cell[1]]
        at = cell[-1] if site in ("head_out_pos", "resid_pre", "attn_out", "mlp_out") else slice(None)  # position
        for key in keys:
            if key not in values:
                values[key] = ours[:, key].repeat(n, *[1] * (ours.ndim - 2)).unflatten(0, (n, -1))
            values[key][i, :, at] = theirs[:, key, at]
    values = {key: value.flatten(0, 1) for key, value in values.items()}
    if site in ("head_out", "head_out_pos", "attn_out"):
        return Interventions(heads={(layer, h): value for h, value in values.items()})
    if site == "pattern":
        return Interventions(patterns={(layer, h): value for h, value in values.items()})
    if site == "neuron":
        return Interventions(neurons={(layer, k): value for k, value in values.items()})
    if site == "mlp_out":
        return Interventions(neurons={(layer, k): values[0][..., k] for k in range(values[0].shape[-1])})
    if site == "resid_pre":
        return Interventions(resid={layer: values[0]})
    return Interventions(head_inputs={(layer, h, site[0].upper()): value for h, value in values.items()})
