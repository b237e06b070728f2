"""A checkpoint folder's ``config.json`` checked against its shards' headers before anything is built.

transformers builds a model from its config layer by layer, head by head, position table by
position table: a config that asks for ``10**7`` layers hangs the load before any weight is
compared. So the sizes that drive that work are checked first, on the JSON itself, in time
independent of their values, against what the headers hold (``CheckpointFiles``): the number of
layers, the embedding's rows (``vocab_size``) and width (``hidden_size``), head counts that are
positive and divide as the family's modules require, a known activation. Then the config is
checked again as transformers read it (its defaults and derived fields included), and only then
is anything built. Every refusal is a ``CheckpointError`` naming ``config.json``, the field (as the
file spells it), its value and what the shards hold.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..checkpoints import CheckpointError, load_json
from .checkpoint_files import CheckpointFiles
from .families import FAMILIES, Family
from .weight_view import act_fn

# each size's spellings across the families, in the order ``hf.read_config`` reads them
SPELLINGS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "width": ("hidden_size", "n_embd", "d_model"),
    "vocab": ("vocab_size",),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "positions": ("max_position_embeddings", "n_positions", "max_seq_len"),
    "activation": ("hidden_act", "activation_function", "hidden_activation"),
}
MAX_POSITIONS = 2 ** 24  # 16.7M: past every released context length; more is a typo or an attack


def header_sizes(files: CheckpointFiles, family: Family) -> dict[str, int]:
    """What the shards' headers say: ``layers`` (distinct layer indices under the family's layer
    list), and where the tensors exist ``vocab`` and ``width`` (the token embedding's rows; the final
    norm's length, else the embedding's columns)."""
    pattern = re.compile(rf"(?:^|\.){re.escape(family.layers)}\.(\d+)\.")
    layers = {int(m[1]) for m in map(pattern.search, files.shapes) if m}
    sizes = {"layers": len(layers)}
    if layers and max(layers) + 1 != len(layers):
        missing = min(set(range(max(layers) + 1)) - layers)
        raise CheckpointError(f"{files.folder}: the shards hold layers up to {max(layers)} but no layer {missing} "
                              f"({family.layers}.{missing}.*)")
    embed = _stored(files, f"{family.embed}.weight")
    if embed is not None and len(files.shapes[embed]) == 2:
        sizes["vocab"], sizes["width"] = files.shapes[embed]
    norm = _stored(files, f"{family.final_norm}.weight") if family.final_norm else None
    if norm is not None and len(files.shapes[norm]) == 1:
        sizes["width"] = files.shapes[norm][0]
    sizes["keys"] = {"vocab": embed, "width": norm or embed}
    return sizes


def _stored(files: CheckpointFiles, suffix: str) -> str | None:
    """The stored key naming ``suffix`` under any prefix (the causal LM's, the base model's, or none)."""
    return next((key for key in files.shapes if key == suffix or key.endswith("." + suffix)), None)


def check_sizes(config: dict, source: str, header: dict, files: CheckpointFiles) -> None:
    """Refuse a size in ``config`` (a dict: the JSON, or the fields of transformers' config) that is not
    a count, contradicts ``header`` (``header_sizes``) or does not divide as the modules need."""
    found = {}
    for size, spellings in SPELLINGS.items():
        spelling = next((s for s in spellings if config.get(s) is not None), None)
        if spelling is not None:
            found[size] = (spelling, config[spelling])

    def refuse(size: str, expected: str):
        spelling, value = found[size]
        raise CheckpointError(f"{source}: {spelling}={value!r}; expected {expected}")

    for size, (spelling, value) in found.items():
        least = 0 if size == "layers" else 1
        if size != "activation" and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            refuse(size, "a positive int" if least else "an int >= 0")
    if "layers" in found and found["layers"][1] != header["layers"]:
        refuse("layers", f"the {header['layers']} layers the shards hold")
    for size in ("vocab", "width"):
        if size in found and size in header and found[size][1] != header[size]:
            key = header["keys"][size]
            refuse(size, f"{header[size]}, the {'rows' if size == 'vocab' else 'width'} of {key} in "
                         f"{files.shard[key].name}")
    heads = found.get("heads", (None, None))[1]
    if "heads" in found and "width" in found and heads > found["width"][1]:
        refuse("heads", f"at most {found['width'][0]}={found['width'][1]} (one dimension per head)")
    if "heads" in found and "width" in found and "head_dim" not in found and found["width"][1] % heads:
        refuse("heads", f"a divisor of {found['width'][0]}={found['width'][1]} (each head gets width / heads "
                        "dimensions when the config gives no head_dim)")
    if "kv_heads" in found and heads is not None and (found["kv_heads"][1] > heads or heads % found["kv_heads"][1]):
        refuse("kv_heads", f"a divisor of {found['heads'][0]}={heads} (query heads share key/value heads evenly)")
    if "positions" in found and found["positions"][1] > MAX_POSITIONS:
        refuse("positions", f"at most {MAX_POSITIONS} positions")
    if "activation" in found:
        try:
            act_fn(found["activation"][1])
        except (ValueError, TypeError) as err:
            refuse("activation", f"a supported activation ({err})")


def read_checked_config(folder: Path, files: CheckpointFiles):
    """``(transformers config, model_type)`` of ``folder``'s ``config.json`` (a family of ``FAMILIES``),
    its sizes checked against ``files`` before transformers reads it and again after."""
    from transformers import AutoConfig

    path = folder / "config.json"
    raw = load_json(path)
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(f"{path}: unsupported config.model_type={model_type!r}; "
                              f"supported model types: {sorted(FAMILIES)}")
    header = header_sizes(files, FAMILIES[model_type])
    check_sizes(raw, str(path), header, files)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # transformers' config classes raise any type on a bad field
        raise CheckpointError(f"{path}: transformers cannot read it ({type(err).__name__}: {err})") from err
    fields = {spelling: getattr(config, spelling, None) for spellings in SPELLINGS.values() for spelling in spellings}
    check_sizes(fields, f"{path} (as transformers reads it)", header, files)
    return config, model_type
