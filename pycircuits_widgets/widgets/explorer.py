"""CircuitExplorer: the circuit views of one model and one text, linked through one selection."""

from __future__ import annotations

import copy

import ipywidgets
import numpy as np
import traitlets
from tqdm import tqdm

from ..analysis.activations import run
from ..analysis.circuits import model_name as name_of_model
from .attention import AttentionPatterns
from .base import CircuitWidget, check_text, rolls_back
from .bigram_table import BigramTable
from .colored_tokens import ColoredTokens
from .composition_matrix import CompositionMatrix
from .eigenvalue_plot import EigenvaluePlot
from .induction_mechanism import EMBED_TABLES_MAX_VOCAB, InductionMechanism
from .pair_selection import PairSelection
from .path_expansion_view import PathExpansion
from .payload import decode_array
from .positional_qk import PositionalQK
from .selection import HeadSelection, PositionSelection, TokenSelection, check_model
from .skip_trigram_table import SkipTrigramTable
from .virtual_heads_view import VirtualHeads

TITLES = {
    "loss": "per-token loss",
    "attention": "attention patterns",
    "trigrams": "skip-trigrams",
    "composition": "composition scores",
    "eigen": "eigenvalues (copying)",
    "paths": "path expansion",
    "induction": "induction mechanism",
    "positional": "positional attention",
    "virtual": "virtual heads",
    "bigrams": "bigram table",
}
"""Child view name -> what it shows (used in notices)."""

FOLLOWS = {
    "loss": ("position",),
    "attention": ("layer", "head", "position"),
    "trigrams": ("layer", "head", "token"),
    "composition": ("layer", "head", "selected_pair"),
    "eigen": ("layer", "head"),
    "paths": ("layer", "head", "position", "selected_pair"),
    "induction": ("layer", "head", "token", "selected_pair"),
    "positional": ("layer", "head"),
    "virtual": ("layer", "head", "selected_pair"),
    "bigrams": ("token",),
}
"""Child view name -> the selection traits it shows (and may change by a click). The same
table drives the browser-side linking (js/src/lib/selection.js)."""

ON_DEMAND = ("paths", "induction", "positional", "virtual", "bigrams")
"""The paper views the explorer builds inactive (``on_demand``; the bigram table only for models with
heads: for a zero-layer model it is computed at once): nothing of theirs is computed
until their section's "compute" button (or :meth:`CircuitExplorer.compute`) starts them, so
building the explorer costs no more than before and their minutes of work at large shapes never
delay the other views' clicks unasked. :meth:`CircuitExplorer.save_html` starts them for a small
model (:data:`SMALL_HEADS` heads, :data:`EMBED_TABLES_MAX_VOCAB` tokens)."""
SMALL_HEADS = 64
LARGE_VOCAB_TRIGRAM_OFFSETS = 8
"""Rotary models over ``SkipTrigramTable.partial_above`` tokens read their skip-trigrams over at most
this many offsets by default (each offset is one more exact whole-vocabulary search: about a minute
per head at 49k tokens on a loaded 2-core machine); the view's offset control widens it."""


def _child(cls):
    return traitlets.Instance(cls, allow_none=True).tag(sync=True, **ipywidgets.widget_serialization)


class CircuitExplorer(HeadSelection, PositionSelection, TokenSelection, PairSelection, CircuitWidget):
    """One model reading one text, seen through every circuit view at once, all following
    one selection: a head ``(layer, head)``, a text ``position``, a vocabulary ``token`` and a
    head pair ``selected_pair`` (earlier head -> later head).

    Views (each a full widget, also usable on its own): per-token loss of ``pcw.run(model,
    text)`` (``ColoredTokens``), ``AttentionPatterns``, ``SkipTrigramTable``,
    ``CompositionMatrix``, ``EigenvaluePlot``, and the paper's two-layer story:
    ``PathExpansion``, ``InductionMechanism`` (of the selected pair), ``PositionalQK``,
    ``VirtualHeads`` and the direct path's ``BigramTable``. A click in any of them (a head
    thumbnail, a composition cell, a path term, a virtual head, a token) moves every view to
    it: in the browser at once (so a saved page with no kernel stays coherent) and in the
    kernel, which recomputes what depends on the selection (skip-trigrams of the head, its
    eigenvalues, a token's query...). ``position`` and ``token`` stay consistent: a position
    selects its token; a token selects its last position in the text (-1 if absent); no
    token, no position. A pair selects its later head; selecting a head in layer >= 1 selects
    the pair of its strongest K-composition writer (from the composition view's K scores,
    once they are computed) and that head.

    The model reads each text once (``pcw.run``); the loss, attention, path and positional
    views share that pass. The paper views in ``ON_DEMAND`` are built inactive and computed
    on first use (their section's "compute" button, or :meth:`compute`), on their own runner.

    A view the model cannot support honestly is not built: ``notices[name]`` says why
    (no composition, induction or virtual heads in a one-layer model; only the bigram table in
    a zero-layer model). Rotary models: the QK circuits (skip-trigrams, QK eigenvalues,
    Q/K-composition, the induction mechanism) are read over the query - key offsets of the text
    (0 to its length - 1; skip-trigrams of a vocabulary over ``SkipTrigramTable.partial_above``
    tokens: the first ``LARGE_VOCAB_TRIGRAM_OFFSETS``), each view stating how and offering an
    offset control.

    Args:
        model: a weight view (``pcw.load_pretrained("attn-only-2l")``, ``pcw.from_hf(...)``).
        text: the text the model reads (editable in the attention view), or token ids (a list,
            tensor or numpy array, ``[pos]`` or ``[1, pos]``), which a model without a tokenizer
            needs: the views then show each id as its token (``<id N>`` without a tokenizer) and
            the editable text is the ids separated by spaces. A tokenizer whose vocabulary does
            not fit the model's is refused (``check_tokenizer``).
        layer, head, position, token, selected_pair: the initial selection.
    """

    _view = traitlets.Unicode("CircuitExplorer").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "position", "token", "selected_pair", "text"})

    # -- views (child widgets; None where the model does not support the view) --
    loss = _child(ColoredTokens)
    """ColoredTokens | None: loss of predicting each token from those before it (text positions 1..n-1)."""
    attention = _child(AttentionPatterns)
    """AttentionPatterns | None: every head's pattern on ``text``."""
    trigrams = _child(SkipTrigramTable)
    """SkipTrigramTable | None: the selected head's skip-trigrams and the selected token's query."""
    composition = _child(CompositionMatrix)
    """CompositionMatrix | None: Q/K/V composition of head pairs (models with >= 2 layers)."""
    eigen = _child(EigenvaluePlot)
    """EigenvaluePlot | None: OV/QK eigenvalue positivity of every head, the selected head's spectrum."""
    paths = _child(PathExpansion)
    """PathExpansion | None: the logits on ``text`` as direct path + heads + virtual heads (attention-only models)."""
    induction = _child(InductionMechanism)
    """InductionMechanism | None: K-composition and copying of the selected pair (>= 2 layers, no rotary)."""
    positional = _child(PositionalQK)
    """PositionalQK | None: the selected head's positional score and attention by relative offset."""
    virtual = _child(VirtualHeads)
    """VirtualHeads | None: the strongest V-composition pairs (>= 2 layers)."""
    bigrams = _child(BigramTable)
    """BigramTable | None: the direct path ``W_E W_U``'s top next tokens for the selected token (every model)."""
    notices = traitlets.Dict().tag(sync=True)
    """{view name: str} (read-only): why a view is not shown for this model."""

    # -- data --
    text = traitlets.Unicode("").tag(sync=True)
    """str: the text the model reads; setting it re-runs the model once for every text view
    (a text the model cannot read is refused: Python raises, the view shows the error)."""
    model_name = traitlets.Unicode("").tag(sync=True)
    """str (read-only): the model's name, for the header."""
    mean_loss = traitlets.Float(None, allow_none=True).tag(sync=True)
    """float | None (read-only): mean next-token loss on ``text`` (None for one token)."""
    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    """list[str] (read-only): display string of each text position."""
    token_ids = traitlets.List(traitlets.Int()).tag(sync=True)
    """list[int] (read-only): vocabulary id of each text position (the browser links position and token with it)."""

    # -- selection (layer, head, position, token from the mixins) --
    token_str = traitlets.Unicode("").tag(sync=True)
    """str (read-only): display string of ``token``, "" for none."""

    def __init__(self, model, text, **kwargs):
        try:
            check_model(model, "CircuitExplorer")
            no_heads = ""
        except ValueError as exc:  # a zero-layer model: only the loss view applies
            no_heads = str(exc)
        check_tokenizer(model)
        if isinstance(text, str):
            if not text:
                raise TypeError("CircuitExplorer(model, text): text must be a non-empty str or token ids, got ''")
            if getattr(model, "tokenizer", None) is None:
                raise ValueError("CircuitExplorer: this model has no tokenizer, and reading text needs a tokenizer "
                                 "(pcw.from_hf(hf_model, tokenizer)); or pass token ids (a list, tensor or numpy array)")
        else:
            model, text = reading_ids(model, text)
        self.model = model
        self._strings = model.token_strings
        self._ran = None  # (text, RunResult): the one forward pass of the current text
        selection = {k: kwargs.pop(k) for k in ("layer", "head", "position", "token", "selected_pair")
                     if k in kwargs}
        super().__init__(text=text, model_name=name_of_model(model), **kwargs)
        # a console bar, shown only when building takes over a second (large models)
        with tqdm(total=len(TITLES), desc="CircuitExplorer", unit="view", delay=1.0, leave=False) as progress:
            progress.set_postfix_str("running the model", refresh=False)
            self._show_run()
            progress.update()
            self._build_views(no_heads, progress)
        self._link()
        for name, value in selection.items():
            setattr(self, name, value)

    # -- building ---------------------------------------------------------------------------
    def _build_views(self, no_heads: str, progress) -> None:
        # rotary QK circuits are read over the query - key offsets this text has (each view says so)
        rotary = {"offsets": range(0, len(self.token_ids))} if self.model.cfg.positional == "rotary" else {}
        trigram_window = rotary
        if rotary and self.model.cfg.d_vocab > SkipTrigramTable.partial_above:
            trigram_window = {"offsets": range(0, min(len(self.token_ids), LARGE_VOCAB_TRIGRAM_OFFSETS))}
        builders = {
            "attention": lambda: AttentionPatterns(self.model, self.text, forward=self._forward,
                                                   layer=self.layer, head=self.head),
            "trigrams": lambda: SkipTrigramTable(self.model, layer=self.layer, head=self.head, **trigram_window),
            "composition": lambda: CompositionMatrix(self.model, layer=self.layer, head=self.head, **rotary),
            "eigen": lambda: EigenvaluePlot(self.model, layer=self.layer, head=self.head, **rotary),
            "paths": lambda: PathExpansion(self.model, self.text, forward=self._forward, one_token=True, active=False,
                                           layer=self.layer, head=self.head),
            "induction": lambda: InductionMechanism(self.model, selected_pair=[], active=False,
                                                    layer=self.layer, head=self.head, **rotary),
            "positional": lambda: PositionalQK(self.model, self.text, forward=self._forward, one_token=True, active=False,
                                               layer=self.layer, head=self.head),
            "virtual": lambda: VirtualHeads(self.model, active=False, layer=self.layer, head=self.head),
            # milliseconds, but every row is saved with the page: computed at once only where it is
            # the model's one view (zero layers), else on first use like the others
            "bigrams": lambda: BigramTable(self.model, active=no_heads != ""),
        }
        notices = {}
        for name, build in builders.items():
            progress.set_postfix_str(TITLES[name], refresh=False)
            progress.update()
            if no_heads and name != "bigrams":  # the direct path exists without any head
                notices[name] = f"No {TITLES[name]}: {no_heads}."
                continue
            try:
                setattr(self, name, build())
            except ValueError as exc:  # the analysis refuses this model: say why, show no numbers
                notices[name] = f"No {TITLES[name]} for this model: {exc}"
        self.notices = notices

    def _forward(self, model, text: str):
        """``pcw.run(model, text)``, once per text (the views built here share it)."""
        ran = self._ran  # read once: the paper views' runners call this from their threads
        if ran is None or ran[0] != text:
            ran = self._ran = (text, run(model, text))
        return ran[1]

    def _show_run(self) -> None:
        """Tokens and the loss view of the current text (positions of an old text are cleared)."""
        out = self._forward(self.model, self.text)
        ids = out.tokens[0].tolist()
        losses = out.token_loss[0]
        with self.hold_sync():
            self.position = -1
            self.token_ids, self.tokens = ids, list(out.str_tokens[0])
            if self.loss is None:
                self.loss = ColoredTokens(self.tokens[1:], losses, label="loss (nats)", colormap="sequential",
                                          first_position=1)
            else:
                self.loss.set_values(self.tokens[1:], losses)
            self.mean_loss = float(out.loss) if len(ids) > 1 else None

    def views(self) -> dict[str, CircuitWidget]:
        """The views this model supports, by name (``loss``, ``attention``, ...)."""
        return {name: getattr(self, name) for name in TITLES if getattr(self, name) is not None}

    def compute(self, *names: str) -> None:
        """Start the on-demand paper views named (default: all of ``ON_DEMAND`` this model has);
        ``wait()`` blocks until they are done."""
        unknown = sorted(set(names) - set(ON_DEMAND))
        if unknown:
            raise ValueError(f"compute() takes names from {', '.join(ON_DEMAND)}; got {', '.join(unknown)}")
        for name in names or ON_DEMAND:
            view = getattr(self, name)
            if view is not None:
                view.active = True

    def save_html(self, path, *, title: str | None = None, offline: bool = True):
        """As ``CircuitWidget.save_html``; with ``offline``, a small model's paper views (at most
        ``SMALL_HEADS`` heads and ``EMBED_TABLES_MAX_VOCAB`` tokens: seconds of work) are computed
        first, so the page shows them. A larger model's page shows the ones computed so far and,
        for the others, that they need a kernel."""
        cfg = self.model.cfg
        if offline and cfg.n_layers * cfg.n_heads <= SMALL_HEADS and cfg.d_vocab <= EMBED_TABLES_MAX_VOCAB:
            self.compute()
        return super().save_html(path, title=title, offline=offline)

    def wait(self, timeout: float | None = 30.0) -> bool:
        """Wait until every view's kernel-side recomputes are done and applied (True if all are
        idle). A result applied in one view can move the selection and start work in another,
        so this repeats until a full pass finds every view idle."""
        while True:
            busy_before = [v for v in self.views().values() if v.busy]
            if not all(view.wait(timeout) for view in self.views().values()):
                return False
            if not busy_before and not any(v.busy for v in self.views().values()):
                return True

    # -- linking: children -> explorer -> children. Values converge, so no feedback loop: a
    # child set to the explorer's value reports an unchanged value and traitlets stays quiet.
    def _link(self) -> None:
        for name, view in self.views().items():
            view.observe(self._from_view, list(FOLLOWS[name]))
            view.observe(self._busy_from_views, ["busy"])
        if self.attention is not None:
            self.attention.observe(self._text_from_view, ["text"])
        self.observe(self._to_views, ["layer", "head", "position", "token", "selected_pair"])

    @rolls_back
    def _from_view(self, change):
        view, name = change["owner"], change["name"]
        if name in ("layer", "head", "selected_pair"):
            with self.hold_trait_notifications():  # never (new layer, old head), nor (new head, old pair)
                self.layer, self.head = view.layer, view.head
                pair = list(getattr(view, "selected_pair", []))
                if pair and pair[2:] == [view.layer, view.head]:  # the view's pair came with its head
                    self.selected_pair = pair
        else:
            setattr(self, name, change["new"])

    def _busy_from_views(self, change):
        self.busy = any(v.busy for v in self.views().values())

    @rolls_back
    def _text_from_view(self, change):
        self.text = change["new"]

    @rolls_back
    def _to_views(self, change):
        name = change["name"]
        if name == "position" and self.position >= 0:
            self.token = self.token_ids[self.position]
        elif name in ("layer", "head") and self.layer >= 1 and self.selected_pair[2:] != [self.layer, self.head]:
            writer = self.strongest_writer(self.layer, self.head)
            if writer is not None:  # a reading head brings the pair that explains what it reads
                self.selected_pair = [*writer, self.layer, self.head]
        elif name == "token":
            t = self.token
            self.token_str = self._strings[t] if t >= 0 else ""
            if t < 0:
                self.position = -1
            elif self.position < 0 or self.token_ids[self.position] != t:
                # show where the token occurs in the text (last occurrence), if it does
                self.position = max((i for i, x in enumerate(self.token_ids) if x == t), default=-1)
        for view_name, view in self.views().items():
            keys = [k for k in FOLLOWS[view_name] if getattr(view, k) != getattr(self, k)]
            if keys:
                with view.hold_trait_notifications():  # both set before its observers run
                    for k in keys:
                        setattr(view, k, getattr(self, k))

    def strongest_writer(self, layer: int, head: int) -> tuple[int, int] | None:
        """The earlier head ``(l1, h1)`` with the largest K-composition score into ``(layer, head)``,
        read from the composition view's K table (None before it is computed, or without one).
        The browser applies the same rule to the same table (js/src/lib/selection.js)."""
        payload = (self.composition.scores.get("K", {}).get("correct") if self.composition is not None else None)
        if not payload or layer < 1:
            return None
        scores = decode_array(payload)[:layer, :, layer, head].reshape(-1)  # [layer * n_heads]
        if not np.isfinite(scores).any():
            return None  # no defined score: no writer to name
        best = int(np.nanargmax(scores))
        return divmod(best, self.n_heads)

    def _n_positions(self) -> int:
        return len(self.token_ids)

    # -- text -----------------------------------------------------------------------------
    @traitlets.validate("text")
    def _valid_text(self, proposal):
        """The model reads the text here, so a text it cannot read is refused before it is set."""
        text = check_text(proposal["value"])
        try:
            self._forward(self.model, text)
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(f"text: {exc}") from exc
        return text

    @traitlets.observe("text")
    @rolls_back
    def _on_text(self, change):
        if self.loss is None:  # still in __init__
            return
        self._show_run()
        for name in ("attention", "paths", "positional"):
            view = getattr(self, name)
            if view is not None and view.text != self.text:
                view.text = self.text


class IdsText:
    """Token ids written as text, ``"464 3290 318"``: the tokenizer of an explorer given ids, so its
    text views read (and a reader edits) ids; each id displays as ``tokenizer``'s token, or
    ``<id N>`` without one."""

    def __init__(self, tokenizer=None):
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        pieces = text.split()
        bad = [p for p in pieces if not p.isdigit()]
        if bad or not pieces:
            raise ValueError(f"this explorer reads token ids separated by spaces (e.g. '464 3290 318'); "
                             f"{bad[0]!r} is not an id" if bad else "no token ids given")
        return [int(p) for p in pieces]

    def display_token(self, token_id: int) -> str:
        return f"<id {token_id}>" if self._tokenizer is None else self._tokenizer.display_token(token_id)


def reading_ids(model, ids):
    """``(model, text)`` for an explorer given token ids: a shallow copy of ``model`` (same weight
    tensors) whose tokenizer is ``IdsText``, and the ids as its text. Refuses ids that are not one
    sequence of valid ids (``[pos]`` or ``[1, pos]``)."""
    tokens = model._as_tokens(ids)
    if tokens.ndim == 2:
        if tokens.shape[0] != 1:
            raise ValueError(f"CircuitExplorer reads one sequence: token ids of shape {tuple(tokens.shape)} given; "
                             "pass [pos] or [1, pos]")
        tokens = tokens[0]
    strings = model.token_strings
    view = copy.copy(model)
    view.tokenizer = IdsText(model.tokenizer)
    view._token_strings = strings
    return view, " ".join(str(i) for i in tokens.tolist())


PADDED_MULTIPLE = 64
"""Models pad their embedding to a multiple of this (Pythia, Qwen, Phi): such a vocabulary may be
larger than the tokenizer's."""


def tokenizer_size(tokenizer) -> int | None:
    """How many ids ``tokenizer`` knows (None when it does not say)."""
    if tokenizer is None:
        return None
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        return len(hf)
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) else None


def check_tokenizer(model) -> None:
    """Refuse a tokenizer whose vocabulary does not fit ``model``'s, naming both sizes: more ids than
    the model has rows, or fewer without the model's vocabulary being padded (a multiple of
    ``PADDED_MULTIPLE``), which means another model's tokenizer."""
    size, d_vocab = tokenizer_size(getattr(model, "tokenizer", None)), model.cfg.d_vocab
    if size is None or size == d_vocab or (size < d_vocab and d_vocab % PADDED_MULTIPLE == 0):
        return
    raise ValueError(f"the tokenizer has {size} tokens but the model's vocabulary has {d_vocab} (d_vocab): "
                     "it is not this model's tokenizer" + (
                         "; its ids past the model's would not exist" if size > d_vocab else
                         f" (a larger model vocabulary is accepted only when padded to a multiple of {PADDED_MULTIPLE})"))
