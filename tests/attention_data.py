"""Synthetic attention data shared by the attention widget's Python and browser tests."""

import numpy as np


def causal_softmax(L, H, n, seed=0, sharp=3.0):
    """Random causal attention patterns [L, H, n, n] (softmax of scores, src > dest masked)."""
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((L, H, n, n)).astype(np.float32) * sharp
    s[..., np.triu(np.ones((n, n), bool), 1)] = -np.inf
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def toks(n):
    """n distinct token strings, each starting with a space."""
    return [f" t{i}" for i in range(n)]
