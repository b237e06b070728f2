"""CircuitExplorer: the circuit views of one model and one text, linked through one selection."""

from __future__ import annotations

import ipywidgets
import traitlets
from tqdm import tqdm

from ..analysis.activations import run
from ..analysis.skip_trigrams import token_strings
from .attention import AttentionPatterns
from .base import CircuitWidget, check_range
from .colored_tokens import ColoredTokens
from .composition_matrix import CompositionMatrix
from .eigenvalue_plot import EigenvaluePlot
from .selection import HeadSelection, TokenSelection, check_model
from .skip_trigram_table import SkipTrigramTable

TITLES = {
    "loss": "per-token loss",
    "attention": "attention patterns",
    "trigrams": "skip-trigrams",
    "composition": "composition scores",
    "eigen": "eigenvalues (copying)",
}
"""Child view name -> what it shows (used in notices)."""

HEAD_VIEWS = ("attention", "trigrams", "composition", "eigen")
"""Children that follow the selected head (``layer``/``head``)."""


def _child(cls):
    return traitlets.Instance(cls, allow_none=True).tag(sync=True, **ipywidgets.widget_serialization)


class CircuitExplorer(HeadSelection, TokenSelection, CircuitWidget):
    """One model reading one text, seen through every circuit view at once, all following
    one selection: a head ``(layer, head)``, a text ``position`` and a vocabulary ``token``.

    Views (each a full widget, also usable on its own): per-token loss of ``pcw.run(model,
    text)`` (``ColoredTokens``), ``AttentionPatterns``, ``SkipTrigramTable``,
    ``CompositionMatrix``, ``EigenvaluePlot``. A click in any of them (a head thumbnail, a
    composition cell, a point of the eigenvalue plot, a token) updates the explorer's
    selection and, in the kernel, every other view; each view recomputes its own content
    (skip-trigrams of the head, its eigenvalues, a token's query...) in the kernel.

    A view the model cannot support honestly is not built: ``notices[name]`` says why
    (no composition in a one-layer model, no token x token QK circuit under rotary
    positions, no heads at all in a zero-layer model).

    Args:
        model: a weight view (``pcw.load_pretrained("attn-only-2l")``, ``pcw.from_hf(...)``).
        text: the text the model reads (editable in the attention view).
        layer, head, position, token: the initial selection.
    """

    _view = traitlets.Unicode("CircuitExplorer").tag(sync=True)

    # -- views (child widgets; None where the model does not support the view) --
    loss = _child(ColoredTokens)
    """ColoredTokens | None: loss of predicting each token from those before it (tokens 1..n-1)."""
    attention = _child(AttentionPatterns)
    """AttentionPatterns | None: every head's pattern on ``text``."""
    trigrams = _child(SkipTrigramTable)
    """SkipTrigramTable | None: the selected head's skip-trigrams and the selected token's query."""
    composition = _child(CompositionMatrix)
    """CompositionMatrix | None: Q/K/V composition of head pairs (models with >= 2 layers)."""
    eigen = _child(EigenvaluePlot)
    """EigenvaluePlot | None: OV/QK eigenvalue positivity of every head, the selected head's spectrum."""
    notices = traitlets.Dict().tag(sync=True)
    """{view name: str}: why a view is not shown for this model."""

    # -- data --
    text = traitlets.Unicode("").tag(sync=True)
    """str: the text the model reads; setting it re-runs the model for every text view."""
    model_name = traitlets.Unicode("").tag(sync=True)
    """str (read-only): the model's name, for the header."""
    mean_loss = traitlets.Float(None, allow_none=True).tag(sync=True)
    """float | None (read-only): mean next-token loss on ``text`` (None for one token)."""

    # -- selection (layer, head, token from the mixins) --
    position = traitlets.Int(-1).tag(sync=True)
    """int, default -1: selected position in ``text`` (its token becomes ``token``), -1 for none."""
    token_str = traitlets.Unicode("").tag(sync=True)
    """str (read-only): display string of ``token``, "" for none."""

    def __init__(self, model, text: str, **kwargs):
        if not isinstance(text, str) or not text:
            raise TypeError(f"CircuitExplorer(model, text): text must be a non-empty str, got {text!r}")
        self.model = model
        try:
            check_model(model, "CircuitExplorer")
            no_heads = ""
        except ValueError as exc:  # a zero-layer model: only the loss view applies
            no_heads = str(exc)
        if getattr(model, "tokenizer", None) is None:
            raise ValueError("CircuitExplorer reads text and shows tokens: the model needs a tokenizer "
                             "(e.g. pcw.from_hf(hf_model, tokenizer))")
        self._strings = token_strings(model)
        self._ids: list[int] = []
        selection = {k: kwargs.pop(k) for k in ("layer", "head", "position", "token") if k in kwargs}
        super().__init__(text=text, model_name=short_name(getattr(model.cfg, "name", "")), **kwargs)
        # a console bar, shown only when building takes over a second (large models)
        with tqdm(total=1 + 4, desc="CircuitExplorer", unit="view", delay=1.0, leave=False) as progress:
            progress.set_postfix_str("running the model", refresh=False)
            self._rerun(text)
            progress.update()
            self._build_views(no_heads, progress)
        self._link()
        with self.hold_trait_notifications():
            for name, value in selection.items():
                setattr(self, name, value)

    # -- building ---------------------------------------------------------------------------
    def _build_views(self, no_heads: str, progress) -> None:
        builders = {
            "attention": lambda: AttentionPatterns(self.model, self.text, layer=self.layer, head=self.head),
            "trigrams": lambda: SkipTrigramTable(self.model, layer=self.layer, head=self.head),
            "composition": lambda: CompositionMatrix(self.model, layer=self.layer, head=self.head),
            "eigen": lambda: EigenvaluePlot(self.model, layer=self.layer, head=self.head),
        }
        notices = {}
        for name, build in builders.items():
            progress.set_postfix_str(TITLES[name], refresh=False)
            progress.update()
            if no_heads:
                notices[name] = f"No {TITLES[name]}: {no_heads}."
                continue
            try:
                setattr(self, name, build())
            except ValueError as exc:  # the analysis refuses this model: say why, show no numbers
                notices[name] = f"No {TITLES[name]} for this model: {exc}"
        self.notices = notices

    def _rerun(self, text: str) -> None:
        """Run the model on ``text``: token ids for the token selection, and the loss view
        (whose new values clear the position selection)."""
        out = run(self.model, text)
        self._ids = out.tokens[0].tolist()
        tokens, losses = out.str_tokens[0][1:], out.token_loss[0]
        if self.loss is None:
            self.loss = ColoredTokens(tokens, losses, label="loss (nats)", colormap="sequential")
        else:
            self.loss.set_values(tokens, losses)
        self.mean_loss = float(out.loss) if len(self._ids) > 1 else None

    def views(self) -> dict[str, CircuitWidget]:
        """The views this model supports, by name (``loss``, ``attention``, ...)."""
        return {name: getattr(self, name) for name in TITLES if getattr(self, name) is not None}

    def wait(self, timeout: float | None = 30.0) -> bool:
        """Wait until every view's kernel-side recompute is done (True if all are idle)."""
        return all(view.wait(timeout) for view in self.views().values() if hasattr(view, "wait"))

    # -- linking: children -> explorer -> children. Values converge, so no feedback loop: a
    # child set to the explorer's value reports an unchanged value and traitlets stays quiet.
    def _link(self) -> None:
        heads = [v for n, v in self.views().items() if n in HEAD_VIEWS]
        for view in heads:
            view.observe(self._head_from_view, ["layer", "head"])
        for view in (self.trigrams, self.composition, self.eigen):
            if view is not None:
                view.observe(self._busy_from_views, ["busy"])
        if self.trigrams is not None:
            self.trigrams.observe(self._token_from_view, ["token"])
        if self.attention is not None:
            self.attention.observe(self._position_from_attention, ["pinned_token"])
            self.attention.observe(self._text_from_view, ["text"])
        self.loss.observe(self._position_from_loss, ["selected_token"])
        self.observe(self._head_to_views, ["layer", "head"])
        self.observe(self._position_to_views, ["position"])
        self.observe(self._token_to_views, ["token"])
        self.observe(self._text_to_views, ["text"])

    def _head_from_view(self, change):
        view = change["owner"]
        with self.hold_trait_notifications():
            self.layer, self.head = view.layer, view.head

    def _head_to_views(self, change):
        for name in HEAD_VIEWS:
            view = getattr(self, name)
            if view is not None and (view.layer, view.head) != (self.layer, self.head):
                with view.hold_trait_notifications():  # both set before its observers run: never (new layer, old head)
                    view.layer, view.head = self.layer, self.head

    def _busy_from_views(self, change):
        self.busy = any(v.busy for v in (self.trigrams, self.composition, self.eigen) if v is not None)

    def _token_from_view(self, change):
        self.token = change["new"]

    def _position_from_attention(self, change):
        self.position = change["new"]

    def _position_from_loss(self, change):
        # the loss view shows tokens 1..n-1: its index i is text position i + 1
        self.position = change["new"] + 1 if change["new"] >= 0 else -1

    def _text_from_view(self, change):
        self.text = change["new"]

    def _position_to_views(self, change):
        p = self.position
        if self.attention is not None and self.attention.pinned_token != p:
            self.attention.pinned_token = p
        if self.loss.selected_token != max(p - 1, -1):
            self.loss.selected_token = max(p - 1, -1)
        if p >= 0:
            self.token = self._ids[p]

    def _token_to_views(self, change):
        t = self.token
        self.token_str = self._strings[t] if t >= 0 else ""
        if self.trigrams is not None and self.trigrams.token != t:
            self.trigrams.token = t
        if t >= 0 and (self.position < 0 or self._ids[self.position] != t):
            # show where the token occurs in the text (last occurrence), if it does
            self.position = max((i for i, x in enumerate(self._ids) if x == t), default=-1)

    def _text_to_views(self, change):
        self._rerun(self.text)
        if self.attention is not None and self.attention.text != self.text:
            self.attention.text = self.text

    @traitlets.validate("position")
    def _valid_position(self, proposal):
        return check_range("position", proposal["value"], 0, len(self._ids) - 1, none=True)


def short_name(name: str) -> str:
    """A model's name for a header: the last part of a path or hub id
    (``/home/me/models/SmolLM-135M/`` -> ``SmolLM-135M``)."""
    name = str(name).rstrip("/\\")
    return name.replace("\\", "/").rsplit("/", 1)[-1] or name
