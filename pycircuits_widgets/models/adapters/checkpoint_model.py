"""``from_safetensors``: the weight view of a Hugging Face checkpoint folder, read layer by layer.

The weight-only analyses (composition, eigenvalue positivity, OV/QK and full circuits,
skip-trigrams, virtual heads, the head-level views) need a layer's heads, or the embeddings, one
at a time; none needs the model object. ``CheckpointModel`` is a ``CircuitModel`` whose per-layer
weights (``W_Q, W_K, W_V, W_O``, their biases, ``W_in, W_gate, W_out``) are ``LayerStack``s:
``model.W_V[l]`` reads layer ``l``'s tensors from the memory-mapped shards, widens them to
float32, applies the family's layout and multipliers and folds the norms exactly as ``from_hf``
does (``hf.layer_weights``, ``hf.apply_folds``, ``weight_view.fold_norms``). The last layer read
is kept (one layer's attention: ``4 H d_model d_head`` floats, or its MLP when one was asked for),
nothing else. ``W_E``, ``W_U`` and ``W_pos`` are read whole when accessed and kept only while the
caller holds them.

Peak memory is what each analysis holds (float32, ``N = L H`` heads), not the checkpoint:

* ``composition_scores`` (all pairs, Q/K/V): ``2 N d_model d_head`` (two thin factors per head)
  plus one layer; never the MLPs, the embeddings or the ``d_model^2`` matrices;
* ``eigenvalue_positivity``: ``W_E`` and ``W_U`` (``2 d_vocab d_model``, plus a normalised copy of
  ``W_E`` for layer 0 where the paper's per-token scale applies) and one layer;
* ``skip_trigrams``, full OV/QK circuits of one head: the embeddings and that head's layer;
* ``model.OV`` / ``model.QK`` (every head at once): two stacked weights, ``2 N d_model d_head``.

What needs a forward pass (``pcw.run``, attention patterns, path expansion, head scores) refuses a
checkpoint view, naming ``from_hf``. There is no probe: the translation is ``from_hf``'s, which is
verified against each family's own forward; shapes are checked against the config at every read.
"""

from __future__ import annotations

import operator
import threading
import weakref
from pathlib import Path

import torch

from ...factored import FactoredMatrix
from ...progress import progress
from ..checkpoints import CheckpointError
from ..circuit_model import CircuitModel, weight_shapes
from ..config import named
from .checkpoint_config import read_checked_config
from .checkpoint_files import CheckpointFiles, ModuleTree
from .families import FAMILIES
from .hf_tokenizer import as_tokenizer, folder_tokenizer
from .hf_weights import (
    ATTENTION_KEYS,
    LAYER_KEYS,
    apply_folds,
    layer_weights,
    read_config,
    submodule,
    token_embedding,
    unembedding,
)
from .weight_view import BIASES, circuit_notes, fold_norms

VOCAB_BLOCK = 8192  # token ids per block of a vocab-sized contraction (67 MB of float32 W_E at d_model 2048)


class NeedsModel(TypeError):
    """A forward pass was asked of a checkpoint view, which holds weights only."""


class LayerStack:
    """A per-layer weight ``[n_layers, ...]`` of a ``CheckpointModel``, read one layer at a time.

    ``stack[l]`` (or ``stack[l, h, ...]``) reads layer ``l``; ``len``, iteration, ``shape``, ``dtype``
    and ``device`` work as on the tensor. ``stack.stack()`` is the whole tensor (holds every layer).
    Anything else a tensor does is refused: an analysis that reads a checkpoint view reads it by layer."""

    def __init__(self, model: CheckpointModel, name: str, shape: tuple[int, ...]):
        self._model, self.name, self.shape = model, name, torch.Size(shape)

    dtype = property(lambda self: self._model.dtype)
    device = property(lambda self: self._model.device)
    ndim = property(lambda self: len(self.shape))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        layer, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        try:
            if isinstance(layer, bool):
                raise TypeError
            layer = operator.index(layer)  # int, numpy integer, 0-d integer tensor
        except TypeError:
            raise TypeError(f"{self.name} of a checkpoint view is read one layer at a time: index it with one layer "
                            f"(an int), got {key!r}; {self.name}.stack() gives every layer at once") from None
        if not -len(self) <= layer < len(self):
            raise IndexError(f"{self.name}: layer {layer} out of range for {len(self)} layers")
        weight = self._model.layer(layer % len(self), mlp=self.name not in ATTENTION_KEYS)[self.name]
        return weight[rest] if rest else weight

    def __iter__(self):
        return (self[layer] for layer in range(len(self)))

    def stack(self) -> torch.Tensor:
        """Every layer as one tensor ``self.shape``, ``[n_layers, ...]`` (memory: the whole weight in the
        view's dtype)."""
        return torch.stack(list(self))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"{self.name} of a checkpoint view (from_safetensors) is read one layer at a time and has no "
                        f".{name}: index a layer ({self.name}[l]) or take {self.name}.stack() (every layer at once), "
                        "or load the whole model with pcw.from_hf")

    def __repr__(self) -> str:
        return f"LayerStack({self.name}, shape={tuple(self.shape)}, read per layer from {self._model.files.folder})"


class CheckpointModel(CircuitModel):
    """The ``CircuitModel`` weight view of a checkpoint folder, read per layer (module docstring)."""

    def __init__(self, files: CheckpointFiles, tree: ModuleTree, family_name: str, config, tokenizer=None):
        self.files, self._tree, self._family = files, tree, FAMILIES[family_name]
        layers = submodule(submodule(tree, self._family.body), self._family.layers)
        d_mlp = self._mlp_width(layers)
        try:
            self.cfg, self._folds = read_config(config, self._family, d_mlp)
        except ValueError as err:
            raise CheckpointError(f"from_safetensors: {files.folder / 'config.json'}: {err}") from err
        self.tokenizer = tokenizer
        self._token_strings = None
        self._layers = layers
        self._lock = threading.Lock()
        self._cached: tuple[int, bool, dict] | None = None  # (layer, with MLP, folded weights)
        self._recent: dict[str, weakref.ref] = {}
        if len(layers) != self.cfg.n_layers:
            raise CheckpointError(f"from_safetensors: {files.folder} config.json says {self.cfg.n_layers} layers, the "
                             f"shards hold {len(layers)}")
        present = self.layer(0, mlp=True) if self.cfg.n_layers else {}
        shapes = weight_shapes(self.cfg)
        for name in ATTENTION_KEYS[:8] + ("W_in", "b_in", "W_gate", "b_gate", "W_out", "b_out"):
            value = LayerStack(self, name, shapes[name]) if present.get(name) is not None else None
            setattr(self, name, value)
        for name in ("w_qnorm", "b_qnorm", "w_knorm", "b_knorm", "w_post_attn", "w_post_mlp"):
            setattr(self, name, None)  # read by the forward only, which a checkpoint view refuses
        self.metadata = {"source": f"safetensors:{family_name}", "folder": str(files.folder),
                         "folded": {k: float(v) for k, v in self._folds.items()},
                         "notes": ["weights read per layer from the checkpoint (from_safetensors); no forward",
                                   *circuit_notes(self.cfg, self._biased(present))]}

    def _biased(self, layer0: dict) -> bool:
        """Whether the view has a bias: layer 0's, the unembedding's or the final norm's (which folds into
        ``b_U``), from the shards' names (``b_U`` itself is not read for this)."""
        family, files = self._family, self.files
        return (any(layer0.get(b) is not None for b in BIASES[:-1]) or f"{self._tree.output}.bias" in files
                or f"{family.body}.{family.final_norm}.bias" in files)

    def _mlp_width(self, layers) -> int:
        """``hf.mlp_width`` from the header: layer 0's last MLP projection, not read."""
        family = self._family
        key = ".".join(filter(None, (layers.prefix, "0", family.mlp, family.mlp_names[-1], "weight")))
        if key not in self.files:
            raise CheckpointError(f"from_safetensors: {self.files.folder} has no {key} (expected the layout "
                             f"save_pretrained writes for a {family.body}-based causal LM)")
        shape = self.files.shape(key)
        return shape[0] if self._tree.conv1d else shape[1]

    # --- where the weights are ----------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.files.dtype

    @property
    def device(self) -> torch.device:
        return self.files.device

    def layer(self, layer: int, mlp: bool = False) -> dict:
        """Layer ``layer``'s folded weights (``[H, d_model, d_head]`` etc., no leading ``L``): attention
        only, or attention and MLP (``mlp``). Kept until another layer (or part) is read."""
        with self._lock:
            cached = self._cached
            if cached is not None and cached[0] == layer and (cached[1] or not mlp):
                return cached[2]
            self._cached = None  # the old layer is freed before the new one is read
            raw = layer_weights(self._layers[layer], self._family, self.cfg, attention_only=not mlp)
            raw = apply_folds({k: None if v is None else v[None] for k, v in raw.items()}, self._family, self.cfg,
                              self._folds)
            folded = {k: v[0] for k, v in fold_norms(raw, self.cfg).items()}
            self._check(folded, f"layer {layer}")
            self._cached = (layer, mlp, folded)
            return folded

    def _check(self, weights: dict, where: str) -> None:
        """Shapes against the config (values were checked finite as they were read: ``CheckpointFiles.read``)."""
        shapes = weight_shapes(self.cfg)
        for name, value in weights.items():
            expected = shapes[name][1:] if name in LAYER_KEYS else shapes[name]
            if tuple(value.shape) != tuple(expected):
                raise CheckpointError(f"from_safetensors: {self.files.folder} {where}: {name} has shape "
                                 f"{tuple(value.shape)}, the config gives {tuple(expected)}")

    def _whole(self, name: str, rows: slice | None = None) -> torch.Tensor | None:
        """``W_E``, ``W_pos``, ``W_U`` or ``b_U`` read and folded (``rows``: that block of the vocabulary,
        ``W_E[rows]``, ``W_U[:, rows]``, ``b_U[rows]``); a whole one is shared while someone holds it."""
        family = self._family
        with self._lock:
            recent = self._recent.get(name) if rows is None else None
            value = recent() if recent is not None else None
            if value is not None:
                return value
            if name in ("W_E", "W_pos"):
                embed = f"{family.body}.{family.embed}.weight"
                tree = self._with_rows({embed: rows} if rows is not None else {})
                raw = {k: v for k, v in token_embedding(tree, family, self.cfg).items() if k == name}
            else:
                out = self._tree.output
                tree = self._with_rows({f"{out}.weight": rows, f"{out}.bias": rows} if rows is not None else {})
                raw = unembedding(tree, family)
            value = fold_norms(apply_folds(raw, family, self.cfg, self._folds), self.cfg).get(name)
            if value is not None and rows is None:
                self._check({name: value}, "")
                self._recent[name] = weakref.ref(value)
            return value

    def _with_rows(self, rows: dict[str, slice]) -> ModuleTree:
        tree = self._tree
        return ModuleTree(tree.files, conv1d=tree.conv1d, output=tree.output, rows=rows) if rows else tree

    W_E = property(lambda self: self._whole("W_E"))
    W_U = property(lambda self: self._whole("W_U"))
    W_pos = property(lambda self: self._whole("W_pos"))
    b_U = property(lambda self: self._whole("b_U"))

    def vocab_blocks(self) -> list[slice]:
        """Blocks of ``VOCAB_BLOCK`` token ids: vocab-sized contractions read the embeddings a block at a time."""
        V = self.cfg.d_vocab
        return [slice(start, min(start + VOCAB_BLOCK, V)) for start in range(0, V, VOCAB_BLOCK)]

    def token_rows(self, name: str, rows: slice) -> torch.Tensor:
        """``W_E[rows] [n, d_model]`` or ``W_U[:, rows] [d_model, n]``, read from the shards (only those rows)."""
        return self._whole(name, rows)

    @property
    def OV(self) -> FactoredMatrix:
        """``W_V @ W_O`` of every head (reads and holds both stacks: ``2 L H d_model d_head`` floats)."""
        return FactoredMatrix(self.W_V.stack(), self.W_O.stack())

    @property
    def QK(self) -> FactoredMatrix:
        """``W_Q @ W_K^T`` of every head (reads and holds both stacks)."""
        return FactoredMatrix(self.W_Q.stack(), self.W_K.stack().mT)

    def to(self, *args, **kwargs) -> CheckpointModel:
        """The same checkpoint read onto another device or float dtype (arguments as ``Tensor.to``)."""
        like = torch.empty(0, dtype=self.dtype, device=self.device).to(*args, **kwargs)
        return from_safetensors(self.files.folder, self.tokenizer, device=like.device, dtype=like.dtype)

    # --- no forward -----------------------------------------------------------------------------
    def run_with_cache(self, tokens, **options):
        raise NeedsModel(f"a forward pass (pcw.run, attention patterns, path expansion, head scores) needs the model: "
                         f"{self.files.folder} was opened with from_safetensors, which reads weights only. Load it "
                         f"with pcw.from_hf({str(self.files.folder)!r}) (holds the whole model)")

    def forward(self, tokens):
        return self.run_with_cache(tokens)

    __call__ = forward

    def loss(self, tokens):
        return self.run_with_cache(tokens)

    def __repr__(self) -> str:
        return "Checkpoint" + super().__repr__() + f" <- {self.files.folder}"


def _skeleton(config):
    """The family's own causal LM class built on the meta device: module names only, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _model_names(skeleton, files: CheckpointFiles) -> tuple[dict[str, str], dict[str, str]]:
    """(stored key -> the parameter transformers loads it into, stored key -> the conversion it needs).
    Names: transformers' checkpoint renamings (legacy names such as GPT-NeoX's ``embed_out``) and a
    missing or extra base-model prefix, applied as ``from_pretrained`` applies them (transformers 5.x).
    A key that needs more than a rename (fused or split experts, ...) is a conversion: the weight view,
    which reads stored tensors as they are, refuses it; transformers applies it."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # transformers 4.x renames nothing but the base-model prefix
        get_model_conversion_mapping = None
    transforms = get_model_conversion_mapping(skeleton) if get_model_conversion_mapping else []
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = skeleton.state_dict()
    names, conversions = {}, {}
    for key in files.shard:
        if get_model_conversion_mapping is None:
            name, converted = key, None
            prefix = skeleton.base_model_prefix
            if f"{prefix}.{key}" in meta:
                name = f"{prefix}.{key}"
        else:
            name, converted = rename_source_key(key, renamings, converters, skeleton.base_model_prefix, meta)
        if converted is not None:
            conversions[key] = converted
        names[key] = name
    return names, conversions


def _check_against_skeleton(skeleton, files: CheckpointFiles, names: dict[str, str], conversions: dict) -> None:
    """Every stored tensor has the shape the config's model gives its parameter, and (where nothing is
    converted) every parameter is stored: what transformers would find loading the weights, found on
    the headers, naming the shard and the key. A missing weight would be initialised at random."""
    expected = {name: tuple(value.shape) for name, value in skeleton.state_dict().items()}
    config = files.folder / "config.json"
    for key, name in names.items():
        if key not in conversions and name in expected and files.shapes[key] != expected[name]:
            raise CheckpointError(f"{files.shard[key]}: {key} has shape {files.shapes[key]} in the header; "
                                  f"{config} gives {expected[name]}")
    stored = set(names.values())
    missing = [name for name, _ in skeleton.named_parameters() if name not in stored]
    if missing and not conversions:
        raise CheckpointError(f"{files.folder}: the shards hold no {missing[0]} ({len(missing)} of the parameters "
                              f"{config} asks for are missing; a missing weight would be initialised at random)")


def _output_module(skeleton, files: CheckpointFiles, family) -> str:
    """The module path of the unembedding: the skeleton's output embedding, or the token embedding where
    the checkpoint ties them."""
    output = skeleton.get_output_embeddings()
    name = next(n for n, module in skeleton.named_modules() if module is output)
    if f"{name}.weight" in files:
        return name
    if output.weight is not skeleton.get_input_embeddings().weight:
        raise CheckpointError(f"from_safetensors: {files.folder} has no {name}.weight and its config does not tie the "
                         "embeddings: the unembedding is missing")
    return f"{family.body}.{family.embed}"


def check_folder(path: str | Path, dtype: torch.dtype = torch.float32, device=None, *,
                 loader: str = "from_safetensors"):
    """``(transformers config, model_type, CheckpointFiles, meta skeleton)`` of the checkpoint folder
    ``path``, everything checked that can be before a weight is read or a model allocated: no file
    reached outside the folder (``checkpoint_files``), the headers, the config's sizes against them
    (``checkpoint_config``), the family's supported features, every stored shape against the model
    transformers builds from the config. ``from_hf(folder)`` runs it before transformers loads the
    folder (``loader="from_hf"``: conversions transformers applies are allowed)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{loader}: {folder} has no config.json (expected a Hugging Face checkpoint "
                                "folder written by save_pretrained)")
    files = CheckpointFiles(folder, dtype, device)
    if loader == "from_hf" and len(files.paths) > 1 and not files.indexed:
        raise CheckpointError(f"from_hf: {folder} holds {len(files.paths)} shards and no "
                              "model.safetensors.index.json, which transformers needs to load them; "
                              "pcw.from_safetensors reads them without it (weights only)")
    config, model_type = read_checked_config(folder, files)
    missing = FAMILIES[model_type].refuse(config)
    if missing:
        raise ValueError(f"{loader}: {model_type} with {missing} is not supported: the weight view's forward "
                         "has no such feature")
    try:
        skeleton = _skeleton(config)
    except Exception as err:  # transformers' modules raise any type on a config they cannot build
        raise CheckpointError(f"{folder / 'config.json'}: transformers cannot build a {model_type} from it "
                              f"({type(err).__name__}: {err})") from err
    names, conversions = _model_names(skeleton, files)
    if conversions and loader == "from_safetensors":
        key, converted = next(iter(conversions.items()))
        raise CheckpointError(f"from_safetensors: {folder}: {key} is stored in a layout transformers converts when "
                              f"it loads ({converted!r}); load the model and use pcw.from_hf")
    _check_against_skeleton(skeleton, files, names, conversions)
    files.rename(names)
    return config, model_type, files, skeleton


def from_safetensors(path: str | Path, tokenizer=None, *, device=None, dtype: torch.dtype = torch.float32,
                     name: str | None = None) -> CheckpointModel:
    """The weight view of the Hugging Face checkpoint folder ``path`` (``config.json`` and one or many
    ``*.safetensors`` shards, any family in ``families.FAMILIES``), read per layer as analyses need it
    (module docstring: what each analysis holds). Weights are widened to ``dtype`` (float32, or
    float64) on ``device`` (default CPU) as they are read; analyses compute there.

    ``tokenizer``: a ``transformers`` tokenizer; None loads the folder's own when it has one
    (``hf_tokenizer.folder_tokenizer``: one that cannot be loaded is a warning, not an error), else
    token ids only. Before anything is read or built (``check_folder``): a file reaching outside the
    folder, a lying header or index, a tensor stored twice, a config whose sizes contradict the headers
    are refused as ``CheckpointError`` naming the file and the key or field; so are the features
    ``from_hf`` refuses and non-finite weights (each checked when read). Which shards are read:
    ``checkpoint_files.shard_paths``. Needs ``transformers`` for ``config.json``. ``name``: how captions,
    stores and pages name the model (default: the folder's own name, never its path)."""
    folder = Path(path)
    with progress(f"from_safetensors {folder.name}", total=3, unit="step") as bar:
        bar.note("checking the shards' headers against the config")
        config, model_type, files, skeleton = check_folder(folder, dtype, device)
        family = FAMILIES[model_type]
        if not files.has_prefix(family.body):
            raise CheckpointError(f"from_safetensors: {folder} has no tensors under {family.body!r} (expected the "
                                  f"causal LM's keys, e.g. {family.body}.{family.layers}.0..., as save_pretrained "
                                  "writes them)")
        tree = ModuleTree(files, conv1d=family.qkv_layout == "conv1d", output=_output_module(skeleton, files, family))
        bar.update()
        if tokenizer is None:
            bar.note("loading the tokenizer")
            tokenizer = folder_tokenizer(folder)
        bar.update()
        bar.note("opening the weight view")
        model = CheckpointModel(files, tree, model_type, config, as_tokenizer(tokenizer))
        bar.update()
    return named(model, name)
