"""The anywidget views. Each class's front end is one Svelte file in js/src/views/."""

from .attention import AttentionPatterns
from .base import CircuitWidget
from .colored_tokens import ColoredTokens

__all__ = ["AttentionPatterns", "CircuitWidget", "ColoredTokens"]
