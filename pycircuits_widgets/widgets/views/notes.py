"""What a view's numbers leave out, named per model, so every note says the same true thing."""

from __future__ import annotations


def direct_path_ignores(cfg, *, composition: bool = True) -> list[str]:
    """The parts of ``cfg``'s model that a head's weight-only circuits (``W_E ... W_U``,
    composition of ``W_OV``/``W_QK``) leave out: composition with other heads (when
    ``composition`` and the model has more than one layer), MLPs, the layer norm's
    per-token scale (centring and the learned scale fold into the weights; the division
    by the norm does not, except where the stream is the embedding alone: see
    ``analysis.circuits.embedding``)."""
    out = []
    if composition and cfg.n_layers > 1:
        out.append("composition with other heads")
    if not cfg.attn_only:
        out.append("MLPs")
    if cfg.normalization is not None:
        norm = f"{'RMS' if cfg.normalization == 'rmsnorm' else 'layer'} norm"
        if cfg.positional == "learned":
            out.append(f"the {norm}'s per-token scale")
        else:  # the first read sees the embedding alone: its scale is applied (analysis.circuits.embedding)
            where = "the unembedding" + (" and layers after the first" if cfg.n_layers > 1 else "")
            out.append(f"the {norm}'s division where it depends on the context ({where})")
    return out
