"""Training CLI: a few steps of a tiny model; resuming reproduces an uninterrupted run."""

import pytest
import torch

from pycircuits_widgets.models import CheckpointError, load_attn_only
from pycircuits_widgets.models.checkpoints import load_tensors
from pycircuits_widgets.train import batch_at, lr_at, main, parse_args, train
from tolerance import gamma_tilde

TINY = ["--layers", "1", "--heads", "2", "--d-model", "16", "--d-head", "8", "--n-ctx", "16", "--batch", "4",
        "--steps", "6", "--warmup", "2", "--checkpoint-every", "2", "--corpus", "pydoc", "--threads", "1"]


def run(out, *extra):
    return train(parse_args([*TINY, "--out", str(out), *extra]))


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    full = run(tmp_path / "full")
    run(tmp_path / "split", "--stop-at", "3")
    partial = load_tensors(tmp_path / "split" / "model.safetensors")
    resumed = run(tmp_path / "split", "--resume")
    a = load_tensors(tmp_path / "full" / "model.safetensors")
    b = load_tensors(tmp_path / "split" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(partial["W_E"], b["W_E"])  # the resumed run did train
    assert full["step"] == resumed["step"] == 6
    # the same float32 evaluation of the bit-identical weights checked above: equal, but for a reordering of
    # its sums (a log-sum-exp over the 1024-token vocabulary, a mean over the validation tokens; terms up to
    # about twice the loss), on each side
    assert full["val_loss"] == pytest.approx(resumed["val_loss"], rel=4 * gamma_tilde(2048))
    a_opt = load_tensors(tmp_path / "full" / "optimizer.safetensors")
    b_opt = load_tensors(tmp_path / "split" / "optimizer.safetensors")
    assert all(torch.equal(a_opt[k], b_opt[k]) for k in a_opt)


def test_trained_checkpoint_loads_and_records_its_corpus(tmp_path, capsys):
    main([*TINY, "--out", str(tmp_path)])
    assert "val_loss" in capsys.readouterr().out
    model, meta, _ = load_attn_only(tmp_path / "model.safetensors", tmp_path / "model.json")
    assert model.cfg.n_layers == 1 and model.cfg.d_model == 16
    assert len(meta["corpus_sha256"]) == 64 and meta["corpus"] == "pydoc"
    assert meta["train_loss"] < 7.5  # below log(1024) = 6.93 + slack: a few steps move it down


def test_resume_refuses_a_different_architecture(tmp_path):
    run(tmp_path, "--stop-at", "2")
    args = parse_args([*TINY, "--out", str(tmp_path), "--resume"])
    args.d_model = 32
    with pytest.raises(CheckpointError, match="d_model=16"):
        train(args)


def test_batches_are_a_pure_function_of_seed_and_step():
    data = torch.arange(1000)
    torch.testing.assert_close(batch_at(data, 5, 0, 3, 8), batch_at(data, 5, 0, 3, 8))
    assert not torch.equal(batch_at(data, 5, 0, 3, 8), batch_at(data, 6, 0, 3, 8))
    windows = batch_at(data, 5, 0, 3, 8)
    assert windows.shape == (3, 9) and torch.equal(windows[:, 1:] - windows[:, :-1], torch.ones(3, 8, dtype=torch.long))


def test_learning_rate_warms_up_then_decays():
    lrs = [lr_at(s, 1e-3, 10, 100) for s in range(100)]  # Python floats (float64): approx's 1e-6 is a wide margin
    assert lrs[0] < lrs[9] == pytest.approx(1e-3)
    assert lrs[99] < lrs[50] < lrs[10] and lrs[99] >= 1e-4 - 1e-12
