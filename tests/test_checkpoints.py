"""Safe loading: safetensors only; corrupt or mismatched checkpoints name the file and the mismatch."""

import shutil

import pytest
import torch

from pycircuits_widgets.models import CHECKPOINT_DIR, CheckpointError, load_attn_only
from pycircuits_widgets.models.checkpoints import load_tensors, save_json, save_tensors

NAME = "attn-only-1l"


@pytest.fixture
def checkpoint(tmp_path):
    """A writable copy of a shipped checkpoint: (weights, config, tokenizer) paths."""
    paths = []
    for suffix in (".safetensors", ".json"):
        dest = tmp_path / f"{NAME}{suffix}"
        shutil.copy(CHECKPOINT_DIR / f"{NAME}{suffix}", dest)
        paths.append(dest)
    return (*paths, CHECKPOINT_DIR / "tokenizer.json")


def test_shipped_checkpoint_loads(checkpoint):
    model, _meta, tok = load_attn_only(*checkpoint)
    assert model.cfg.name == NAME and tok.vocab_size == model.cfg.d_vocab
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_corrupt_weights_name_the_file(checkpoint):
    weights = checkpoint[0]
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"corrupt checkpoint .*{weights.name}"):
        load_attn_only(*checkpoint)
    weights.write_bytes(b"\x80\x04not a safetensors file, maybe a pickle")
    with pytest.raises(CheckpointError, match=weights.name):
        load_attn_only(*checkpoint)


def test_shape_mismatch_names_the_tensor_and_shapes(checkpoint):
    weights, _config, _ = checkpoint
    tensors = load_tensors(weights)
    tensors["W_U"] = tensors["W_U"][:, :-1]
    save_tensors(weights, tensors)
    with pytest.raises(CheckpointError, match=r"'W_U' has shape \(\d+, \d+\), the config expects"):
        load_attn_only(*checkpoint)


def test_missing_tensor_is_named(checkpoint):
    weights = checkpoint[0]
    tensors = load_tensors(weights)
    del tensors["W_Q"]
    save_tensors(weights, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensors \['W_Q'\]"):
        load_attn_only(*checkpoint)


def test_config_mismatch_is_named(checkpoint):
    import json

    weights, config, _tokenizer = checkpoint
    meta = json.loads(config.read_text())
    meta["config"]["d_model"] += 1
    save_json(config, meta)
    with pytest.raises(CheckpointError, match=rf"{weights.name}: tensor 'W_E'"):
        load_attn_only(*checkpoint)
    config.write_text("{oops")
    with pytest.raises(CheckpointError, match=rf"corrupt checkpoint config .*{config.name}"):
        load_attn_only(*checkpoint)


def test_tokenizer_mismatch_is_named(checkpoint, tmp_path):
    from pycircuits_widgets.models import Tokenizer

    other = tmp_path / "other.json"
    Tokenizer.train(["abc abd abe " * 50], vocab_size=300).save(other)
    with pytest.raises(CheckpointError, match="other.json .* does not match"):
        load_attn_only(checkpoint[0], checkpoint[1], other)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="not found: .*nope.safetensors"):
        load_tensors(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("change, message", [
    (lambda t: t["W_Q"].view(-1).__setitem__(7, float("nan")), r"tensor 'W_Q' has 1 non-finite values \(NaN or inf\)"),
    (lambda t: t.__setitem__("W_E", t["W_E"].to(torch.int8)), r"tensor 'W_E' has dtype I8; expected a floating-point"),
    (lambda t: t.__setitem__("W_U", t["W_U"] > 0), r"tensor 'W_U' has dtype BOOL; expected a floating-point"),
    (lambda t: t.__setitem__("W_O", t["W_O"].to(torch.complex64)), r"tensor 'W_O' has dtype C64; expected"),
])
def test_non_finite_or_non_float_tensors_are_named(checkpoint, change, message):
    weights = checkpoint[0]
    tensors = load_tensors(weights)
    change(tensors)
    save_tensors(weights, tensors)
    with pytest.raises(CheckpointError, match=rf"checkpoint .*{weights.name}: {message}"):
        load_attn_only(*checkpoint)


def test_a_crafted_config_fails_on_the_header_before_allocating(checkpoint):
    """d_vocab=262144, d_model=1024 beside the small shipped tensors: building that model would
    write over 2 GiB of random weights. The child process's peak memory stays far below it."""
    import json
    import subprocess
    import sys

    weights, config, _ = checkpoint
    meta = json.loads(config.read_text())
    meta["config"].update(d_vocab=262144, d_model=1024)
    save_json(config, meta)
    # the child's own peak: VmHWM of its address space, new at exec (its ru_maxrss would start at the
    # forking pytest process's resident size, over 1 GiB late in a full run)
    code = ("from pycircuits_widgets.models import load_attn_only, CheckpointError\n"
            f"try:\n    load_attn_only({str(weights)!r}, {str(config)!r})\n"
            "except CheckpointError as err:\n    print(err)\n"
            "print(next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    message, peak_kib = out.strip().rsplit("\n", 1)
    assert "tensor 'W_E' has shape (1024, 128), the config expects (262144, 1024)" in message
    assert int(peak_kib) < 1 << 20  # KiB: under 1 GiB (torch alone is ~0.3 GiB)


def test_a_positional_table_larger_than_the_weights_is_refused(checkpoint):
    import json

    _weights, config, _ = checkpoint
    meta = json.loads(config.read_text())
    meta["config"]["n_ctx"] = 10 ** 7
    save_json(config, meta)
    with pytest.raises(CheckpointError, match=r"n_ctx \* d_model = 10000000 \* 128 asks for a positional table"):
        load_attn_only(*checkpoint)


def test_deeply_nested_json_config_is_a_clear_error(checkpoint):
    config = checkpoint[1]
    config.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=rf"corrupt checkpoint config .*{config.name}: JSON nested too deeply"):
        load_attn_only(*checkpoint)
