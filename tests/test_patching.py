"""Task and exact activation patching (``analysis/patching.py``) on the shipped attn-only-2l in float64.

The oracle is ``test_interventions.oracle``, a float64 forward written independently of the model's, each
head on its own, with hooks: every cell of every site is the oracle's run of the base prompts with that
hook replacing the activation by the other run's, its logit difference normalised by the oracle's own
clean and corrupted metrics. The model and the oracle are two float64 computations of the same forward:
their logits differ within ``logit_tol``, so a normalised score within ``2 logit_tol / |clean - corrupted|``.
"""

from pathlib import Path

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.patching import SITES, Task, activation_patch, logit_diff
from test_interventions import oracle
from tolerance import logit_tol

N_PROMPTS, HALF = 6, 8
TL_VOCAB = 50


@pytest.fixture(scope="module")
def model():
    return pcw.load_pretrained("attn-only-2l").to(torch.float64)


@pytest.fixture(scope="module")
def induction(model):
    """A random token sequence and its repeat (clean), the repeat replaced by other random tokens
    (corrupted); the answer at the last position: the token the repeat continues with, against the one
    the corrupted sequence would have there."""
    g = torch.Generator().manual_seed(0)
    first = torch.randint(100, 1000, (N_PROMPTS, HALF), generator=g)
    other = torch.randint(100, 1000, (N_PROMPTS, HALF), generator=g)
    clean = torch.cat([first, first[:, :-1]], 1)
    corrupted = torch.cat([first, other[:, :-1]], 1)
    answers = [(int(first[i, -1]), int(other[i, -1])) for i in range(N_PROMPTS)]
    return Task(model, clean, corrupted, answers=answers)


def oracle_metric(model, task, tokens, **hooks) -> float:
    return float(logit_diff(oracle(model, tokens, **hooks)["logits"], task))


def tolerance(model, task) -> float:
    return 2 * logit_tol(model, task.clean, task.n_pos, torch.float64) / abs(task.metric_clean - task.metric_corrupted)


def oracle_streams(model, tokens) -> dict:
    """``{layer: [b, pos, d_model]}``: the oracle's residual stream before each layer (what each head's
    query, key and value read before the norm)."""
    seen = {}

    def record(layer, via, x):
        seen.setdefault(layer, x[:, 0].clone())
        return x

    oracle(model, tokens, inputs=record)
    return seen


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_every_site_equals_the_oracle_with_that_activation_from_the_other_run(model, induction, direction):
    task = induction
    base, source = ((task.tokens_corrupted, task.tokens_clean) if direction == "denoise"
                    else (task.tokens_clean, task.tokens_corrupted))
    assert task.metric_clean == pytest.approx(oracle_metric(model, task, task.tokens_clean), abs=1e-9)
    assert task.metric_corrupted == pytest.approx(oracle_metric(model, task, task.tokens_corrupted), abs=1e-9)
    theirs = oracle(model, source)["head_out"]  # [b, L, H, pos, d_model]
    streams = oracle_streams(model, source)
    tol = tolerance(model, task)

    def head_out(layer, head, position=None):
        def hook(at, out):  # out [b, H, pos, d_model]
            if at == layer:
                out = out.clone()
                for h in ([head] if head is not None else range(out.shape[1])):
                    where = slice(None) if position is None else position
                    out[:, h, where] = theirs[:, layer, h, where]
            return out
        return hook

    def resid_pre(layer, position):
        def hook(at, x):  # x [b, pos, d_model]
            if at == layer:
                x = x.clone()
                x[:, position] = streams[layer][:, position]
            return x
        return hook

    def head_input(layer, head, via):
        def hook(at, v, x):  # x [b, H, pos, d_model]
            if at == layer and v == via:
                x = x.clone()
                x[:, head] = streams[layer]
            return x
        return hook

    their_patterns = oracle(model, source)["patterns"]  # [b, L, H, dest, src]

    def pattern(layer, head):
        def hook(at, p):
            if at == layer:
                p = p.clone()
                p[:, head] = their_patterns[:, layer, head]
            return p
        return hook

    for site in set(SITES) - {"mlp_out", "neuron"}:  # (attention-only: refused below; tested on MLP models)
        got = activation_patch(model, task, site, direction)
        assert got.dims == SITES[site] and got.scores.dtype == torch.float64
        L, H = model.cfg.n_layers, model.cfg.n_heads
        cells = {"head_out": [(l, h) for l in range(L) for h in range(H)],
                 "head_out_pos": [(l, h, p) for l, h, p in ((0, 4, 3), (1, 6, 14), (1, 2, 0), (0, 0, 9))],
                 "attn_out": [(l, p) for l in range(L) for p in (0, 7, 8, 14)],
                 "resid_pre": [(l, p) for l in range(L) for p in (0, 3, 8, 14)]}.get(site,
                [(l, h) for l in range(L) for h in range(H)])
        for cell in cells:
            if site == "head_out":
                hooks = {"head_out": head_out(*cell)}
            elif site == "head_out_pos":
                hooks = {"head_out": head_out(cell[0], cell[1], cell[2])}
            elif site == "attn_out":
                hooks = {"head_out": head_out(cell[0], None, cell[1])}
            elif site == "resid_pre":
                hooks = {"resid": resid_pre(*cell)}
            elif site == "pattern":
                hooks = {"pattern": pattern(*cell)}
            else:
                hooks = {"inputs": head_input(*cell, site[0].upper())}
            want = task.normalise(oracle_metric(model, task, base, **hooks))
            assert abs(float(got.scores[cell]) - want) <= tol, f"{site} {cell} {direction}: {float(got.scores[cell])} vs {want}"


def test_the_known_circuit_carries_the_induction_task(model, induction):
    # the project's known circuit (README, "Shipped models"): the previous-token head L0.H4 and the layer-1
    # induction heads L1.H2/3/5/6/7. Denoising one head's output restores a share of the clean metric: the
    # four largest shares are that circuit's, three of them induction heads'. Noising an induction head
    # (the clean run with its corrupted output) keeps less than the whole clean metric
    denoise = activation_patch(model, induction, "head_out", "denoise").scores
    noise = activation_patch(model, induction, "head_out", "noise").scores
    induction_heads = {(1, 2), (1, 3), (1, 5), (1, 6), (1, 7)}
    order = sorted(((float(denoise[l, h]), (l, h)) for l in range(2) for h in range(8)), reverse=True)
    top = {head for _, head in order[:4]}
    assert top <= induction_heads | {(0, 4)} and len(top & induction_heads) >= 3, order[:6]
    assert all(float(noise[l, h]) < 1 for l, h in induction_heads)


def test_bad_tasks_are_refused_naming_what_and_where(model):
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(100, 1000, (2, 6), generator=g) for _ in range(2))
    with pytest.raises(ValueError, match=r"pair 1 differs in token length: the clean prompt is 6 tokens .*, the "
                                         r"corrupted one 5 tokens"):
        Task(model, list(a), [b[0], b[1, :5]], answers=[(1, 2), (3, 4)])
    with pytest.raises(ValueError, match="2 clean prompts but 1 corrupted"):
        Task(model, list(a), [b[0]], answers=[(1, 2)])
    with pytest.raises(ValueError, match="one token length; prompt 0 is 6 tokens, prompt 1 5"):
        Task(model, [a[0], a[1, :5]], [b[0], b[1, :5]], answers=[(1, 2), (3, 4)])
    with pytest.raises(ValueError, match="must be one or more prompts"):
        Task(model, [], [], answers=[])
    with pytest.raises(ValueError, match=r"answers\[0\]\[1\] ' return x' is 2 tokens .*an answer must be one token"):
        Task(model, a[:1], b[:1], answers=[(5, " return x")])
    with pytest.raises(ValueError, match=r"answers\[0\]\[0\] must be a token id in 0\.\.1023"):
        Task(model, a[:1], b[:1], answers=[(5000, 1)])
    with pytest.raises(ValueError, match="needs answers"):
        Task(model, a, b)
    with pytest.raises(ValueError, match=r"the metric must give a scalar, got a tensor of shape \[2\]"):
        Task(model, a, b, metric=lambda logits, task: logits[:, -1, 0])
    with pytest.raises(ValueError, match="the metric is nan on the clean run; it must be finite"):
        Task(model, a, b, metric=lambda logits, task: float("nan"))
    with pytest.raises(ValueError, match="no behaviour to patch"):
        Task(model, a, a, answers=[(1, 2), (3, 4)])
    with pytest.raises(TypeError, match="Task: model must be a CircuitModel"):
        Task("gpt2", a, b, answers=[(1, 2), (3, 4)])
    task = Task(model, a, b, answers=[(1, 2), (3, 4)])
    with pytest.raises(ValueError, match="site must be one of"):
        activation_patch(model, task, "resid_post")
    with pytest.raises(ValueError, match="direction must be one of"):
        activation_patch(model, task, "head_out", "forward")
    with pytest.raises(TypeError, match="task must be the pcw.Task of this model"):
        activation_patch(pcw.load_pretrained("attn-only-2l"), task, "head_out")


def test_the_readme_task_example_runs_as_written():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("### Task circuits: counterfactual patching\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(block, "README.md (task circuits example)", "exec"), namespace)
    scores = namespace["heads"].scores
    assert scores.shape == (2, 8) and bool(torch.isfinite(scores).all())
    assert namespace["task"].metric_clean > namespace["task"].metric_corrupted
    attribution = readme.split("**Attribution patching**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(attribution, "README.md (attribution patching example)", "exec"), namespace)
    assert namespace["estimate"].scores.shape == (2, 8)


def test_equal_to_transformer_lens_patching_on_its_bridge():
    # TransformerLens's own patching functions (transformer_lens.patching) on a TransformerBridge of a
    # random GPT-2 (MLPs, every bias), ours on pcw.from_transformer_lens of it. A q/k/v input patched with
    # the clean stream gives exactly the clean run's q/k/v (the norm and W_Q are the same), so our
    # q/k/v_input sites are TL's q/k/v sites. Both float32 forwards: within 2 logit_tol, normalised
    import transformer_lens.patching as tl_patching
    import transformers
    from transformer_lens import TransformerBridge

    config = transformers.GPT2Config(vocab_size=TL_VOCAB, n_positions=32, n_embd=32, n_layer=3, n_head=4)
    torch.manual_seed(0)
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=transformers.GPT2LMHeadModel(config).eval(),
                                                 tokenizer=word_tokenizer())
    model = pcw.from_transformer_lens(bridge)
    g = torch.Generator().manual_seed(0)
    clean, corrupted = (torch.randint(1, TL_VOCAB, (3, 9), generator=g) for _ in range(2))
    answers = torch.randint(1, TL_VOCAB, (3, 2), generator=g)
    task = Task(model, clean, corrupted, answers=[tuple(map(int, a)) for a in answers])
    with torch.no_grad():
        _, clean_cache = bridge.run_with_cache(clean)

    def metric(logits):  # TL's patching metric: the task's logit difference, normalised
        at, rows = logits[:, -1].detach().double(), torch.arange(3)
        return task.normalise(float((at[rows, answers[:, 0]] - at[rows, answers[:, 1]]).mean()))

    tol = 2 * logit_tol(model, task.clean, task.n_pos) / abs(task.metric_clean - task.metric_corrupted)
    for site, theirs in (("resid_pre", tl_patching.get_act_patch_resid_pre),
                         ("head_out", tl_patching.get_act_patch_attn_head_out_all_pos),
                         ("q_input", tl_patching.get_act_patch_attn_head_q_all_pos),
                         ("k_input", tl_patching.get_act_patch_attn_head_k_all_pos),
                         ("v_input", tl_patching.get_act_patch_attn_head_v_all_pos),
                         ("attn_out", tl_patching.get_act_patch_attn_out),
                         ("mlp_out", tl_patching.get_act_patch_mlp_out),
                         ("pattern", tl_patching.get_act_patch_attn_head_pattern_all_pos),
                         ("head_out_pos", tl_patching.get_act_patch_attn_head_out_by_pos)):
        want = theirs(bridge, corrupted, clean_cache, metric).double()
        if site == "head_out_pos":
            want = want.permute(0, 2, 1)  # TL's [layer, pos, head]
        got = activation_patch(model, task, site).scores
        assert got.shape == want.shape and float((got - want).abs().max()) <= tol, (site, got, want)
    # the last layer's MLP output by hand: the corrupted final stream plus the clean output's difference at
    # one position, through the final norm and the unembedding (no intervention, no resumed forward)
    got = activation_patch(model, task, "mlp_out").scores[-1]
    for p in range(task.n_pos):
        stream = task.corrupted.resid[:, -1].clone()
        stream[:, p] += task.clean.mlp_out[:, -1, p] - task.corrupted.mlp_out[:, -1, p]
        want = task.normalise(float(logit_diff(model.unembed(model.read(stream)[0]), task)))
        assert abs(float(got[p]) - want) <= tol, (p, float(got[p]), want)


@pytest.mark.parametrize("site", ["mlp_out", "neuron"])
def test_mlp_sites_are_refused_on_an_attention_only_model(model, induction, site):
    with pytest.raises(ValueError, match=f"site '{site}' needs MLPs; 'attn-only-2l' is attention-only"):
        activation_patch(model, induction, site)


def word_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>"] + [f"w{i}" for i in range(TL_VOCAB - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
