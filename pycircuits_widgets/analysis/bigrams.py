"""The zero-layer model's bigram table: the direct path ``W_E W_U`` ``[token, next-token logit]``.

Paper ("Zero-layer transformers"): with no attention, a model can only predict the next token
from the current one; its logits are ``W_E W_U`` with the final layer norm's division, a fixed
per-token scale there, applied (``circuits.direct_path``): the rows are the model's logits exactly.
In deeper models the same table (raw ``W_E``: the division then depends on the context) is the
direct-path term of the path expansion.
"""

from __future__ import annotations

import torch

from .circuits import direct_path
from .finite import require_finite


def bigram_top(model, k: int = 10, tokens=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` next tokens of each row of ``W_E W_U``: ``(values [n, k], ids [n, k])``, best first.

    ``tokens`` (vocab ids, ``[n]``) selects rows; default all ``d_vocab`` rows, in row blocks
    (``FactoredMatrix.topk_per_row``: the ``d_vocab x d_vocab`` table is never held whole).
    Values are logits (float32).
    """
    V = model.cfg.d_vocab
    if not 1 <= k <= V:
        raise ValueError(f"k must be in 1..{V}, got {k}")
    table = direct_path(model)
    if tokens is not None:
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"tokens must be vocab ids in 0..{V - 1}, got range {int(ids.min())}..{int(ids.max())}")
        table = type(table)(table.A[ids], table.B)
    with torch.no_grad():
        values, ids = type(table)(table.A.float(), table.B.float()).topk_per_row(k)
    # an overflowing (inf) or NaN logit ranks first in its row, so a top-k check covers the table
    return require_finite(values, "the bigram logits", model, ("W_E", "W_U")), ids
