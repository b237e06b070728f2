"""The anywidget views. Each class's front end is one Svelte file in js/src/views/."""

from .base import CircuitWidget
from .colored_tokens import ColoredTokens

__all__ = ["CircuitWidget", "ColoredTokens"]
