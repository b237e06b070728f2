"""Hugging Face causal LMs -> the ``CircuitModel`` weight view (``from_hf``).

Every family is one ``families.Family`` entry, read by ``hf_weights`` (config fields, weights by the
entry's names and layouts, then its features). Norms are folded (``weight_view.fold_norms``);
multipliers, norm offsets, embedding scales and BLOOM's embedding norm fold into the weights
(``hf_weights.apply_folds``); biases stay in the forward and in ``b_*``. The translation is verified
at load (``verify.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...progress import progress
from ..circuit_model import CircuitModel
from ..config import named
from .checkpoint_model import check_folder
from .families import FAMILIES
from .hf_tokenizer import as_tokenizer, folder_tokenizer
from .hf_weights import mlp_width, read_config, read_weights
from .verify import check_module_heads, check_rotary_modules, probe_hf
from .weight_view import build


def _main_device(device_map: dict) -> torch.device:
    """The first accelerator in an accelerate ``device_map`` (its values: indices, device names, "cpu",
    "disk"), else the CPU: where a device-mapped model's weight view is gathered."""
    for place in device_map.values():
        if place not in ("cpu", "disk"):
            return torch.device(f"cuda:{place}" if isinstance(place, int) else place)
    return torch.device("cpu")


def from_hf(model, tokenizer=None, *, verify: bool = True, dtype: torch.dtype | None = None,
            name: str | None = None) -> CircuitModel:
    """A Hugging Face causal LM of any family in ``families.FAMILIES`` -> ``CircuitModel`` with norms
    folded, K/V expanded per query head (``cfg.n_kv_heads`` records grouped-query attention) and the
    source's biases in ``b_*``. ``tokenizer``: a ``transformers`` tokenizer (or None: token ids only).

    **Verified at load** (``verify=True``, the default): config fields that contradict the modules'
    head counts or weight shapes are refused first; then a 16-token probe runs through the
    translated model and through ``model``'s own forward, and a disagreement in the logits (or, with
    eager attention, the attention patterns) refuses the model, naming the family, the error and the
    likely feature. ``verify=False`` skips the probe (for a model too large to run twice); the
    config/shape check always runs. ``model.metadata["verified"]`` records the probe's errors.

    ``model`` may be a hub name or a local folder (``save_pretrained``): it is loaded with
    ``AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager")`` and its
    tokenizer with ``AutoTokenizer`` (a hub name downloads; never in tests). A folder is first checked
    as ``from_safetensors`` checks it (``checkpoint_model.check_folder``: nothing outside the folder, the
    headers against the config) before transformers opens it; its tokenizer is loaded when it has one
    (one that cannot be loaded warns and is left out). Memory: the source model
    and the weight view are both held while translating (about twice the checkpoint in ``dtype``);
    for weight-only analyses of a large checkpoint, ``from_safetensors`` reads it layer by layer.

    A model placed by accelerate (``from_pretrained(..., device_map=...)``, CPU or disk offload included)
    is read from wherever its weights are (offloaded ones from their hooks' weight maps) and its weight
    view gathered on the map's first accelerator, else the CPU; the probe runs the source's own
    dispatched forward. ``pcw.run`` then runs the weight view (in memory), not the source's dispatch.
    Past a second, a progress bar names the step running (reading, translating, verifying).

    ``name``: how captions, stores and saved pages name the model (default: the last part of the
    checkpoint's ``name_or_path``, a folder's own name, never its path; else its ``model_type``)."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        folder = Path(model)
        with progress(f"from_hf {model}", unit="step") as bar:
            if folder.is_dir():  # the folder's checks before transformers opens a file of it
                bar.note("checking the shards' headers against the config")
                check_folder(folder, loader="from_hf")
            bar.note("loading with transformers")
            source = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager")
            bar.note("loading the tokenizer")
            if tokenizer is None:
                tokenizer = folder_tokenizer(folder) if folder.is_dir() else AutoTokenizer.from_pretrained(model)
        return from_hf(source.eval(), tokenizer, verify=verify, name=name)
    if dtype is not None:
        raise TypeError("from_hf: dtype applies when loading by name or folder; cast a loaded model itself "
                        f"(model.to({dtype}))")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"from_hf: unsupported model {type(model).__name__} (config.model_type={model_type!r}); "
                         f"supported model types: {sorted(FAMILIES)}")
    family = FAMILIES[model_type]
    missing = family.refuse(model.config)
    if missing:
        raise ValueError(f"from_hf: {model_type} with {missing} is not supported: the weight view's forward has "
                         "no such feature")
    with torch.no_grad(), progress(f"from_hf {model_type}", total=3 if verify else 2, unit="step") as bar:
        bar.note("reading the weights")
        cfg, folds = read_config(model.config, family, mlp_width(model, family))
        check_module_heads(model, family, cfg)
        check_rotary_modules(model, cfg)
        raw = read_weights(model, family, cfg, folds)
        if getattr(model, "hf_device_map", None):  # placed by accelerate: gather the weights on one device
            raw = {k: None if v is None else v.to(_main_device(model.hf_device_map)) for k, v in raw.items()}
        bar.update()
        bar.note("building the weight view")
        circuit = build(cfg, raw, as_tokenizer(tokenizer), f"hf:{model_type}")
        bar.update()
        circuit.metadata["folded"] = {k: float(v) for k, v in folds.items()}
        if verify:
            bar.note("verifying against the model's own forward")
            circuit.metadata["verified"] = probe_hf(model, circuit, model_type)
            bar.update()
    return named(circuit, name)
