"""Hostile checkpoint folders: each attack is refused by both folder loaders (``pcw.from_safetensors``
and ``pcw.from_hf("folder")``) before anything outside the folder is opened or anything the config
sizes is built, with a ``CheckpointError`` naming the file and the key or field; what is harmless
(a stray extra shard, a broken tokenizer) loads the same weights in both, with a warning naming it.

The folders are a real tiny LLaMA (and GPT-2) written by ``save_pretrained``, edited the way an
attacker would: the index, the headers, the config, links. "Outside" is a real safetensors file
beside the folder holding every weight at 7.0, so reading it would show in ``W_E``."""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import struct

import pytest
import safetensors
import torch
import transformers.modeling_utils
from safetensors.torch import load_file, save_file

import pycircuits_widgets as pcw
from family_configs import tiny_model
from pycircuits_widgets.models.adapters import checkpoint_model

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
LOADERS = {"from_safetensors": pcw.from_safetensors, "from_hf": lambda folder: pcw.from_hf(str(folder))}
OUTSIDE_VALUE = 7.0


@pytest.fixture(params=sorted(LOADERS))
def load(request):
    return LOADERS[request.param]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(a tiny LLaMA folder, its W_E, the GPT-2 folder) written once; tests copy them."""
    root = tmp_path_factory.mktemp("saved")
    llama = tiny_model("llama")
    llama.save_pretrained(root / "llama")
    tiny_model("gpt2").save_pretrained(root / "gpt2")
    return root, pcw.from_hf(llama).W_E


@pytest.fixture
def folder(saved, tmp_path):
    """A fresh copy of the LLaMA checkpoint, and beside it ``elsewhere/x.safetensors``: the same
    tensors, every value ``OUTSIDE_VALUE``."""
    folder = tmp_path / "ckpt"
    shutil.copytree(saved[0] / "llama", folder)
    (tmp_path / "elsewhere").mkdir()
    tensors = load_file(folder / SINGLE)
    save_file({k: torch.full_like(v, OUTSIDE_VALUE) for k, v in tensors.items()},
              tmp_path / "elsewhere" / "x.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture
def opened(monkeypatch):
    """Every path opened from now on by Python (``open``, ``io.open``, ``os.open``) or by safetensors
    (``safe_open``, as this package and transformers import it)."""
    paths = []

    def recording(original):
        def record(file, *args, **kwargs):
            paths.append(os.fspath(file) if isinstance(file, (str, bytes, os.PathLike)) else file)
            return original(file, *args, **kwargs)
        return record

    for owner, name in ((builtins, "open"), (io, "open"), (os, "open"), (safetensors, "safe_open"),
                        (transformers.modeling_utils, "safe_open")):
        monkeypatch.setattr(owner, name, recording(getattr(owner, name)))
    return paths


def write_index(folder, weight_map, metadata=True):
    data = {"weight_map": weight_map}
    if metadata:
        data["metadata"] = {"total_size": 0}
    (folder / INDEX).write_text(json.dumps(data))


def keys(folder, shard=SINGLE):
    return list(load_file(folder / shard))


def edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


# --- nothing outside the folder -------------------------------------------------------------------

@pytest.mark.parametrize("where", ["../elsewhere/x.safetensors", "absolute"])
def test_an_index_naming_a_shard_outside_the_folder_is_refused_before_it_is_opened(folder, load, opened, where):
    outside = folder.parent / "elsewhere" / "x.safetensors"
    name = str(outside) if where == "absolute" else where
    write_index(folder, {key: name for key in keys(folder)})
    first = keys(folder)[0]
    with pytest.raises(pcw.CheckpointError, match=rf"{INDEX} \(weight_map\[{first!r}\]\) names {name!r} as a shard: "
                                                  r"expected a file name in .*nothing outside the folder is read"):
        load(folder)
    assert not [p for p in opened if isinstance(p, str) and "elsewhere" in p]


@pytest.mark.parametrize("system_file", ["/etc/passwd", "/proc/self/environ"])
def test_an_index_naming_a_system_file_is_refused_before_it_is_opened(folder, load, opened, system_file):
    write_index(folder, {key: system_file for key in keys(folder)})
    with pytest.raises(pcw.CheckpointError, match=rf"{INDEX} .* names {system_file!r} as a shard"):
        load(folder)
    assert system_file not in opened


def test_a_shard_linked_outside_the_folder_is_refused(folder, load, opened):
    (folder / SINGLE).unlink()
    (folder / SINGLE).symlink_to(folder.parent / "elsewhere" / "x.safetensors")
    with pytest.raises(pcw.CheckpointError, match=rf"{SINGLE} is a link to .*elsewhere.x\.safetensors, outside the "
                                                  "checkpoint folder"):
        load(folder)
    assert not [p for p in opened if isinstance(p, str) and p.endswith(SINGLE)]


def test_a_config_linked_outside_the_folder_is_refused(folder, load):
    (folder.parent / "elsewhere" / "config.json").write_text((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(folder.parent / "elsewhere" / "config.json")
    with pytest.raises(pcw.CheckpointError, match="config.json is a link to .*outside the checkpoint folder"):
        load(folder)


def test_a_hub_cache_snapshot_links_into_its_own_blobs(saved, tmp_path):
    """``snapshot_download`` folders: every file a link to ``../../blobs/<hash>``; read as the folder."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, source in enumerate(sorted((saved[0] / "llama").iterdir())):
        shutil.copy(source, blobs / f"blob{i}")
        (snapshot / source.name).symlink_to(os.path.relpath(blobs / f"blob{i}", snapshot))
    for load in LOADERS.values():
        torch.testing.assert_close(load(snapshot).W_E, saved[1], rtol=0, atol=0)


# --- which shards are read --------------------------------------------------------------------------

def test_a_stray_shard_is_ignored_with_a_warning_by_both_loaders(folder, load, saved):
    shutil.copy(folder.parent / "elsewhere" / "x.safetensors", folder / "zz-extra.safetensors")
    with pytest.warns(UserWarning, match=r"ignoring zz-extra\.safetensors: without model\.safetensors\.index\.json"):
        model = load(folder)
    torch.testing.assert_close(model.W_E, saved[1], rtol=0, atol=0)  # model.safetensors' weights, in both
    assert not bool((model.W_E == OUTSIDE_VALUE).any())


def test_a_tensor_stored_in_two_shards_is_refused_naming_both(folder, load):
    tensors = load_file(folder / SINGLE)
    save_file({"model.embed_tokens.weight": tensors["model.embed_tokens.weight"] + 1},
              folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (folder / SINGLE).rename(folder / "model-00001-of-00002.safetensors")
    write_index(folder, {**{key: "model-00001-of-00002.safetensors" for key in tensors},
                         "model.embed_tokens.weight": "model-00002-of-00002.safetensors"})
    with pytest.raises(pcw.CheckpointError, match=r"tensor 'model\.embed_tokens\.weight' is stored twice, in "
                                                  r"model-00001-of-00002\.safetensors and in model-00002-of-00002"):
        load(folder)
    (folder / INDEX).unlink()  # without the index: the same two shards, the same refusal
    with pytest.raises(pcw.CheckpointError, match=r"'model\.embed_tokens\.weight' is stored twice"):
        load(folder)


def test_an_index_that_misplaces_a_tensor_is_refused(folder, load):
    tensors = load_file(folder / SINGLE)
    names = sorted(tensors)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({k: v for k, v in tensors.items() if k != names[0]}, folder / first, metadata={"format": "pt"})
    save_file({names[0]: tensors[names[0]]}, folder / second, metadata={"format": "pt"})
    (folder / SINGLE).unlink()
    write_index(folder, {**{key: first for key in names[2:]}, names[0]: second, names[1]: second})
    with pytest.raises(pcw.CheckpointError, match=rf"{INDEX}: weight_map puts {names[1]!r} in {second!r}, but "
                                                  rf"{first} holds it"):
        load(folder)
    write_index(folder, {**{key: first for key in names[1:]}, names[0]: first})
    with pytest.raises(pcw.CheckpointError, match=rf"{INDEX}: weight_map puts {names[0]!r} in {first}, whose header "
                                                  "has no such tensor"):
        load(folder)


def test_a_shard_set_without_its_index(saved, tmp_path):
    """``from_safetensors`` reads a complete set of standard names; transformers needs the index, so
    ``from_hf`` refuses naming it; a set missing a shard is refused naming the shard."""
    folder = tmp_path / "sharded"
    tiny_model("llama").save_pretrained(folder, max_shard_size="60KB")
    (folder / INDEX).unlink()
    torch.testing.assert_close(pcw.from_safetensors(folder).W_E, saved[1], rtol=0, atol=0)
    with pytest.raises(pcw.CheckpointError, match=rf"from_hf: .* shards and no {INDEX}, which transformers needs"):
        pcw.from_hf(str(folder))
    last = max(folder.glob("model-*.safetensors"))
    last.unlink()
    with pytest.raises(FileNotFoundError, match=rf"lacks {last.name}"):
        pcw.from_safetensors(folder)


# --- the config against the headers, before anything is built ------------------------------------

@pytest.fixture
def no_skeleton(monkeypatch):
    """Fails the test if the family's model is built (on the meta device) before the refusal."""
    def built(config):
        raise AssertionError("the skeleton was built before the config was checked")
    monkeypatch.setattr(checkpoint_model, "_skeleton", built)


@pytest.mark.parametrize("field, value, expected", [
    ("num_hidden_layers", 10 ** 7, r"num_hidden_layers=10000000; expected the 2 layers the shards hold"),
    ("num_hidden_layers", -1, r"num_hidden_layers=-1; expected an int >= 0"),
    ("vocab_size", 2 ** 40, (r"vocab_size=1099511627776; expected 128, the rows of model\.embed_tokens\.weight in "
                            r"model\.safetensors")),
    ("hidden_size", 96, r"hidden_size=96; expected 64, the width of model\.norm\.weight in model\.safetensors"),
    ("num_attention_heads", 0, r"num_attention_heads=0; expected a positive int"),
    ("num_attention_heads", -4, r"num_attention_heads=-4; expected a positive int"),
    ("num_attention_heads", 4.0, r"num_attention_heads=4\.0; expected a positive int"),
    ("num_attention_heads", 5, r"num_key_value_heads=2; expected a divisor of num_attention_heads=5"),
    ("num_attention_heads", 10 ** 9, r"num_attention_heads=1000000000; expected at most hidden_size=64"),
    ("max_position_embeddings", 2 ** 40, r"max_position_embeddings=1099511627776; expected at most 16777216"),
    ("hidden_act", "evil_act", r"hidden_act='evil_act'; expected a supported activation"),
])
def test_a_config_contradicting_the_headers_is_refused_before_anything_is_built(folder, load, no_skeleton, field,
                                                                                value, expected):
    edit_config(folder, **{field: value})
    with pytest.raises(pcw.CheckpointError, match=r"ckpt.config\.json: " + expected):
        load(folder)


def test_width_not_divisible_by_the_heads_is_refused_naming_both(saved, tmp_path, load, no_skeleton):
    folder = tmp_path / "gpt2"
    shutil.copytree(saved[0] / "gpt2", folder)
    edit_config(folder, n_head=5)  # GPT-2 has no head_dim: each head gets n_embd / n_head dimensions
    with pytest.raises(pcw.CheckpointError, match=r"config\.json: n_head=5; expected a divisor of n_embd=64"):
        load(folder)


def test_a_stored_shape_the_config_does_not_give_is_refused_naming_the_shard_and_key(folder, load):
    tensors = load_file(folder / SINGLE)
    tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"][:32].clone()
    save_file(tensors, folder / SINGLE, metadata={"format": "pt"})
    with pytest.raises(pcw.CheckpointError, match=rf"{SINGLE}: model\.layers\.1\.self_attn\.q_proj\.weight has shape "
                                                  r"\(32, 64\) in the header; .*config\.json gives \(64, 64\)"):
        load(folder)


def test_a_missing_weight_is_refused_not_initialised_at_random(folder, load):
    tensors = load_file(folder / SINGLE)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / SINGLE, metadata={"format": "pt"})
    with pytest.raises(pcw.CheckpointError, match=r"the shards hold no model\.layers\.1\.mlp\.down_proj\.weight"):
        load(folder)


# --- lying headers and malformed files --------------------------------------------------------------

def rewrite_header(path, edit):
    """``path`` with its JSON header edited in place (the data bytes unchanged)."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])


KEY = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("lie, expected", [
    (lambda h: h[KEY].update(shape=[64, 32]), r"shape \[64, 32\] of F32 needs 8192 bytes, its data_offsets"),
    (lambda h: h[KEY].update(dtype="F64"), r"shape \[64, 64\] of F64 needs 32768 bytes"),
    (lambda h: h[KEY].update(dtype="Q4"), r"dtype 'Q4' is not a safetensors dtype"),
    (lambda h: h[KEY].update(data_offsets=[h[KEY]["data_offsets"][0] - 4, h[KEY]["data_offsets"][1] - 4]),
     r"data_offsets start at byte \d+, the tensor before it ends at \d+ \(overlapping or missing data\)"),
    (lambda h: h[KEY].update(data_offsets=[2 ** 62, 2 ** 62 + 16384]), r"data_offsets .* do not lie within"),
    (lambda h: h[KEY].update(shape=[2 ** 40, -1]), r"shape \[1099511627776, -1\] is not a list of sizes"),
])
def test_a_lying_header_is_refused_naming_the_shard_and_tensor(folder, load, lie, expected):
    rewrite_header(folder / SINGLE, lie)
    with pytest.raises(pcw.CheckpointError, match=rf"corrupt checkpoint .*ckpt.{SINGLE}: tensor {KEY!r}: the "
                                                  rf"header's {expected}"):
        load(folder)


def test_a_truncated_shard_is_refused_naming_it(folder, load):
    data = (folder / SINGLE).read_bytes()
    (folder / SINGLE).write_bytes(data[:len(data) // 2])  # cut inside a tensor's data: that tensor is named
    with pytest.raises(pcw.CheckpointError, match=rf"corrupt checkpoint .*{SINGLE}: tensor '[\w.]+': the header's "
                                                  r"data_offsets \[\d+, \d+\] do not lie within the file's"):
        load(folder)
    (folder / SINGLE).write_bytes(data[:100])  # cut inside the header
    with pytest.raises(pcw.CheckpointError, match=rf"corrupt checkpoint .*{SINGLE}: not a readable safetensors file "
                                                  r"\(the header length \d+ does not fit the file's 100 bytes\)"):
        load(folder)


@pytest.mark.parametrize("index, expected", [
    ({"metadata": {}, "weight_map": ["a"]}, r"weight_map is list, expected a JSON object"),
    ({"metadata": {}, "weight_map": {"model.norm.weight": 3}}, (r"weight_map\['model\.norm\.weight'\] is 3, expected "
                                                               r"a shard file name")),
    ({"weight_map": {"model.norm.weight": SINGLE}}, r"metadata is NoneType, expected a JSON object"),
])
def test_a_malformed_index_is_refused_naming_the_entry(folder, load, index, expected):
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(pcw.CheckpointError, match=rf"{INDEX}: {expected}"):
        load(folder)


def test_an_index_that_is_not_json_is_refused_naming_it(folder, load):
    (folder / INDEX).write_text("{'weight_map': ")
    with pytest.raises(pcw.CheckpointError, match=rf"corrupt checkpoint config .*{INDEX}"):
        load(folder)


def test_a_malformed_tokenizer_warns_and_the_weights_load(folder, load, saved):
    (folder / "tokenizer.json").write_text(json.dumps({"model": {}}))
    with pytest.warns(UserWarning, match=r"tokenizer\.json: the tokenizer cannot be loaded \(KeyError: "
                                         r"'added_tokens'\); the model is read without one"):
        model = load(folder)
    assert model.tokenizer is None
    torch.testing.assert_close(model.W_E, saved[1], rtol=0, atol=0)


def test_checkpoint_error_is_exported_and_a_value_error():
    assert pcw.CheckpointError is pcw.models.CheckpointError and issubclass(pcw.CheckpointError, ValueError)
