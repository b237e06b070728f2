"""CircuitExplorer: the circuit views of one model and one text, linked through one selection."""

from __future__ import annotations

import ipywidgets
import traitlets
from tqdm import tqdm

from ..analysis.activations import run
from .attention import AttentionPatterns
from .base import CircuitWidget, check_text, rolls_back
from .colored_tokens import ColoredTokens
from .composition_matrix import CompositionMatrix
from .eigenvalue_plot import EigenvaluePlot
from .selection import HeadSelection, PositionSelection, TokenSelection, check_model
from .skip_trigram_table import SkipTrigramTable

TITLES = {
    "loss": "per-token loss",
    "attention": "attention patterns",
    "trigrams": "skip-trigrams",
    "composition": "composition scores",
    "eigen": "eigenvalues (copying)",
}
"""Child view name -> what it shows (used in notices)."""

FOLLOWS = {
    "loss": ("position",),
    "attention": ("layer", "head", "position"),
    "trigrams": ("layer", "head", "token"),
    "composition": ("layer", "head"),
    "eigen": ("layer", "head"),
}
"""Child view name -> the selection traits it shows (and may change by a click). The same
table drives the browser-side linking (js/src/lib/selection.js)."""


def _child(cls):
    return traitlets.Instance(cls, allow_none=True).tag(sync=True, **ipywidgets.widget_serialization)


class CircuitExplorer(HeadSelection, PositionSelection, TokenSelection, CircuitWidget):
    """One model reading one text, seen through every circuit view at once, all following
    one selection: a head ``(layer, head)``, a text ``position`` and a vocabulary ``token``.

    Views (each a full widget, also usable on its own): per-token loss of ``pcw.run(model,
    text)`` (``ColoredTokens``), ``AttentionPatterns``, ``SkipTrigramTable``,
    ``CompositionMatrix``, ``EigenvaluePlot``. A click in any of them (a head thumbnail, a
    composition cell, a point of the eigenvalue plot, a token) moves every view to it: in the
    browser at once (so a saved page with no kernel stays coherent) and in the kernel, which
    recomputes what depends on the selection (skip-trigrams of the head, its eigenvalues, a
    token's query...). ``position`` and ``token`` stay consistent: a position selects its
    token; a token selects its last position in the text (-1 if absent); no token, no position.

    The model reads each text once (``pcw.run``); loss and attention views share that pass.

    A view the model cannot support honestly is not built: ``notices[name]`` says why
    (no composition in a one-layer model, no token x token QK circuit under rotary
    positions, no heads at all in a zero-layer model).

    Args:
        model: a weight view (``pcw.load_pretrained("attn-only-2l")``, ``pcw.from_hf(...)``).
        text: the text the model reads (editable in the attention view).
        layer, head, position, token: the initial selection.
    """

    _view = traitlets.Unicode("CircuitExplorer").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "position", "token", "text"})

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
        self._strings = model.token_strings
        self._ran = None  # (text, RunResult): the one forward pass of the current text
        selection = {k: kwargs.pop(k) for k in ("layer", "head", "position", "token") if k in kwargs}
        super().__init__(text=text, model_name=short_name(getattr(model.cfg, "name", "")), **kwargs)
        # a console bar, shown only when building takes over a second (large models)
        with tqdm(total=1 + 4, desc="CircuitExplorer", unit="view", delay=1.0, leave=False) as progress:
            progress.set_postfix_str("running the model", refresh=False)
            self._show_run()
            progress.update()
            self._build_views(no_heads, progress)
        self._link()
        for name, value in selection.items():
            setattr(self, name, value)

    # -- building ---------------------------------------------------------------------------
    def _build_views(self, no_heads: str, progress) -> None:
        builders = {
            "attention": lambda: AttentionPatterns(self.model, self.text, forward=self._forward,
                                                   layer=self.layer, head=self.head),
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

    def _forward(self, model, text: str):
        """``pcw.run(model, text)``, once per text (the views built here share it)."""
        if self._ran is None or self._ran[0] != text:
            self._ran = (text, run(model, text))
        return self._ran[1]

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
        self.observe(self._to_views, ["layer", "head", "position", "token"])

    @rolls_back
    def _from_view(self, change):
        view, name = change["owner"], change["name"]
        if name in ("layer", "head"):
            with self.hold_trait_notifications():  # never (new layer, old head)
                self.layer, self.head = view.layer, view.head
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
        if self.attention is not None and self.attention.text != self.text:
            self.attention.text = self.text


def short_name(name: str) -> str:
    """A model's name for a header: the last part of a path or hub id
    (``/home/me/models/SmolLM-135M/`` -> ``SmolLM-135M``)."""
    name = str(name).rstrip("/\\")
    return name.replace("\\", "/").rsplit("/", 1)[-1] or name
