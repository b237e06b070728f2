"""Exact activation patching batched (``analysis/patching.py``): a layer's cells in one resumed forward.

The reference is the unbatched loop written here with ``Interventions`` directly: for each cell, the base
prompts' forward resumed from the base run with that one activation replaced by the other run's, its
logit difference normalised by the task's clean and corrupted metrics. Batched and unbatched are two
float32 computations of the same forward whose roundings differ (the batch's products and a replaced
head's output summed in another order): their logits within ``logit_tol``, a normalised score within
``2 logit_tol / |clean - corrupted|``. On a tiny random GPT-2 (MLPs, learned positions, every bias) and
Gemma 2 (post-norms, a gated MLP, soft-caps), every site.
"""

import pytest
import torch

import pycircuits_widgets as pcw
from family_configs import tiny_model
from pycircuits_widgets.analysis.patching import SITES, Task, activation_patch, logit_diff
from pycircuits_widgets.models.interventions import Interventions
from tolerance import logit_tol

N_PROMPTS, N_TOKENS = 3, 7


def make_task(model, metric="logit_diff") -> Task:
    g = torch.Generator().manual_seed(2)
    V = model.cfg.d_vocab
    clean, corrupted = (torch.randint(1, V, (N_PROMPTS, N_TOKENS), generator=g) for _ in range(2))
    answers = [tuple(map(int, pair)) for pair in torch.randint(1, V, (N_PROMPTS, 2), generator=g)]
    return Task(model, clean, corrupted, answers=answers, metric=metric)


@pytest.fixture(scope="module", params=["gpt2", "gemma2"])
def task(request):
    return make_task(pcw.from_hf(tiny_model(request.param), verify=False))


def tolerance(task) -> float:
    return 2 * logit_tol(task.model, task.clean, task.n_pos) / abs(task.metric_clean - task.metric_corrupted)


def one_cell(model, site, cell, base, source) -> Interventions:
    """The interventions of patching ``cell`` of ``site`` alone: ``base``'s run with that activation from
    ``source``'s (caches of both runs)."""
    layer, *rest = cell
    if site == "head_out":
        return Interventions(heads={cell: source.head_out[:, layer, rest[0]]})
    if site in ("head_out_pos", "attn_out"):
        heads = [rest[0]] if site == "head_out_pos" else range(model.cfg.n_heads)
        value = base.head_out[:, layer].clone()  # [b, H, pos, d_model]
        value[:, :, rest[-1]] = source.head_out[:, layer, :, rest[-1]]
        return Interventions(heads={(layer, h): value[:, h] for h in heads})
    if site == "resid_pre":
        stream = base.resid[:, layer].clone()
        stream[:, rest[0]] = source.resid[:, layer, rest[0]]
        return Interventions(resid={layer: stream})
    if site == "pattern":
        return Interventions(patterns={cell: source.patterns[:, layer, rest[0]]})
    if site == "mlp_out":
        post = base.mlp_post[:, layer].clone()  # [b, pos, d_mlp]
        post[:, rest[0]] = source.mlp_post[:, layer, rest[0]]
        return Interventions(neurons={(layer, n): post[..., n] for n in range(post.shape[-1])})
    if site == "neuron":
        return Interventions(neurons={cell: source.mlp_post[:, layer, :, rest[0]]})
    return Interventions(head_inputs={(layer, rest[0], site[0].upper()): source.resid[:, layer]})


def unbatched(task, site, direction) -> torch.Tensor:
    """Every cell of ``site`` patched alone, a resumed forward each: the normalised scores, the site's shape."""
    model = task.model
    base, source = (task.corrupted, task.clean) if direction == "denoise" else (task.clean, task.corrupted)
    tokens = task.tokens_corrupted if direction == "denoise" else task.tokens_clean
    c = model.cfg
    sizes = {"layer": c.n_layers, "head": c.n_heads, "position": task.n_pos, "neuron": c.d_mlp}
    scores = torch.zeros([sizes[d] for d in SITES[site]], dtype=torch.float64)
    with torch.no_grad():
        for cell in torch.cartesian_prod(*(torch.arange(n) for n in scores.shape)).tolist():
            cell = tuple(cell)
            logits, _ = model.run_with_cache(tokens, interventions=one_cell(model, site, cell, base, source),
                                             resume=base)
            scores[cell] = task.normalise(float(logit_diff(logits, task)))
    return scores


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_every_site_batched_equals_each_cell_patched_alone(task, direction):
    tol = tolerance(task)
    for site in SITES:
        want = unbatched(task, site, direction)
        got = activation_patch(task.model, task, site, direction).scores
        assert got.shape == want.shape and float((got - want).abs().max()) <= tol, (site, got, want)


def test_chunks_smaller_than_a_layer_give_the_same_scores(task):
    # a layer of head_out_pos has H * pos cells: 1 a forward, and 5 (the last chunk of a layer a shorter one)
    tol = tolerance(task)
    for site in ("head_out_pos", "resid_pre", "neuron"):
        whole = activation_patch(task.model, task, site).scores
        for per_forward in (1, 5):
            got = activation_patch(task.model, task, site, cells_per_forward=per_forward).scores
            assert float((got - whole).abs().max()) <= tol, (site, per_forward)


def test_a_layer_is_one_forward_and_a_chunk_bound_splits_it(task, monkeypatch):
    model = task.model
    calls = []
    run = model.run_with_cache

    def counted(tokens, *args, **kwargs):
        calls.append(len(tokens))
        return run(tokens, *args, **kwargs)

    monkeypatch.setattr(model, "run_with_cache", counted)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    activation_patch(model, task, "head_out")
    assert calls == [H * N_PROMPTS] * L
    calls.clear()
    activation_patch(model, task, "head_out", cells_per_forward=3)
    assert calls == ([3 * N_PROMPTS] * (H // 3) + [H % 3 * N_PROMPTS] * (H % 3 > 0)) * L


def test_a_metric_reading_the_whole_logits_is_read_per_block(task):
    # a callable metric (not the answers-only fast path): the forward's logits split into each cell's block
    whole = make_task(task.model, metric=lambda logits, t: logit_diff(logits, t))
    assert not whole.reads_answers_only
    tol = tolerance(task)
    for site in ("head_out", "resid_pre"):
        got = activation_patch(task.model, whole, site).scores
        assert float((got - unbatched(whole, site, "denoise")).abs().max()) <= tol, site


def test_a_non_finite_metric_of_one_block_is_refused_naming_its_cell(task):
    # the metric is NaN on the fourth run after the task's own two: the third cell of layer 0's one forward
    seen = []

    def metric(logits, t):
        seen.append(1)
        return float("nan") if len(seen) == 2 + 4 else float(logit_diff(logits, t))

    broken = make_task(task.model, metric=metric)
    with pytest.raises(ValueError, match=r"the metric is nan on head_out \(0, 3\); it must be finite"):
        activation_patch(task.model, broken, "head_out")


def test_cells_per_forward_is_refused_unless_a_positive_int(task):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"cells_per_forward must be None or an int >= 1 .*got " + repr(bad)):
            activation_patch(task.model, task, "head_out", cells_per_forward=bad)


def test_a_repeated_cache_is_the_run_of_the_repeated_batch_and_refuses_what_it_cannot_be(task):
    # the shapes of the repeated batch's forward stopped after the first layer; each block a copy of the run
    model = task.model
    repeated = task.clean.repeated(3, 1)
    _, stopped = model.run_with_cache(task.tokens_clean.repeat(3, 1), logits=False, layers=1)
    for name in ("tokens", "embed", "resid", "patterns", "z", "mlp_out", "ln_scale", "ln_scale_mlp"):
        got, want = getattr(repeated, name), getattr(task.clean, name)
        assert got.shape == getattr(stopped, name).shape, name
        for block in got.unflatten(0, (3, -1)):
            assert torch.equal(block, want if name in ("tokens", "embed") else want[:, :block.shape[1]]), name
    assert repeated.mlp_post is None and repeated.interventions is None
    with pytest.raises(ValueError, match=r"n must be an int >= 1 \(the copies of the batch\), got 0"):
        task.clean.repeated(0, 1)
    with pytest.raises(ValueError, match=r"layers must be an int in 1\.\.2, got 3"):
        task.clean.repeated(2, 3)
    _, patched = model.run_with_cache(task.tokens_clean, Interventions(resid={0: task.clean.resid[:, 0]}))
    with pytest.raises(ValueError, match="the cache of a run with interventions is no run to resume"):
        patched.repeated(2, 1)
