"""A sweep's mergeable accumulators: top-k example tables in a total order, and sums.

An example is a ``(window, position)`` with a score. Examples are ranked in one total order: score
descending, then window ascending, then position ascending; ``(window, position)`` is unique, so any
set of examples has exactly one top k. Hence ``TopK.merge`` is associative and commutative exactly:
shards merged in any grouping, by any number of workers, keep the serial answer. Sums merge by
addition (float64 or int64: associative up to float64 rounding, exactly for the counts).

Empty slots (fewer than ``k`` examples seen) hold window ``-1`` and score ``-inf`` and rank last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

EMPTY = -1


def top_k_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of each row of ``scores [R, N]`` in the total order (value descending, then index
    ascending): ``(values [R, k'], indices [R, k'])``, ``k' = min(k, N)``, best first.

    ``torch.topk`` picks any of equal values; it is asked for ``k + 1``, and a row whose ``(k+1)``-th
    value equals its ``k``-th (a tie across the boundary) is resolved by a stable sort of that row."""
    n = scores.shape[-1]
    k = min(k, n)
    if k == 0:
        return scores[:, :0], torch.zeros(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    values, index = scores.topk(min(k + 1, n), dim=-1)
    if values.shape[-1] > k:
        tied = (values[:, k] == values[:, k - 1]).nonzero()[:, 0]
        values, index = values[:, :k].clone(), index[:, :k].clone()
        if len(tied):
            order = torch.sort(scores[tied], dim=-1, descending=True, stable=True).indices[:, :k]
            index[tied] = order
            values[tied] = scores[tied].gather(-1, order)
    return _ordered(values, index)


def _ordered(values: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [R, k]`` and ``index [R, k]`` sorted by value descending, then index ascending."""
    index, by_index = index.sort(-1)
    values = values.gather(-1, by_index)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    return values, index.gather(-1, by_value)


@dataclass
class TopK:
    """The best ``k`` examples of each of ``R`` rows (a head or a neuron each), best first.

    ``score [R, k]``, ``window [R, k]`` (int64, ``EMPTY`` in an empty slot), ``position [R, k]`` (int64) and
    any ``extras`` carried with an example (``{name: [R, k]}``: a head's ``source`` and ``attention``)."""

    score: torch.Tensor
    window: torch.Tensor
    position: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def k(self) -> int:
        return self.score.shape[-1]

    def fields(self) -> dict[str, torch.Tensor]:
        return {"score": self.score, "window": self.window, "position": self.position, **self.extras}

    def merge(self, other: TopK) -> TopK:
        """The best ``k`` of both, in the total order (module docstring)."""
        return TopK.merge_all([self, other])

    @staticmethod
    def merge_all(tables: list[TopK]) -> TopK:
        """The best ``k`` of all ``tables`` (same rows, ``k`` and extras), in the total order: one selection
        over their concatenation, the same as merging them pairwise in any grouping."""
        first = tables[0]
        for t in tables[1:]:
            if t.score.shape != first.score.shape or set(t.extras) != set(first.extras):
                raise ValueError(f"cannot merge top-k tables of shapes {tuple(first.score.shape)} and "
                                 f"{tuple(t.score.shape)} (or different extras)")
        both = {name: torch.cat([t.fields()[name] for t in tables], -1) for name in first.fields()}
        # lexicographic by three stable sorts, least significant key first
        order = both["position"].sort(dim=-1, stable=True).indices
        for key, descending in (("window", False), ("score", True)):
            keyed = both[key].gather(-1, order)
            order = order.gather(-1, keyed.sort(dim=-1, descending=descending, stable=True).indices)
        order = order[:, :first.k]
        # an empty slot's window (-1) would sort before real windows of equal score; scores are finite,
        # empty ones -inf, so empties stay last
        picked = {name: t.gather(-1, order) for name, t in both.items()}
        return TopK(picked.pop("score"), picked.pop("window"), picked.pop("position"), picked)

    def padded(self, k: int) -> TopK:
        """The same table with empty slots appended up to ``k`` columns (a batch with fewer examples than ``k``)."""
        short = k - self.k
        if short <= 0:
            return self
        fill = {"score": float("-inf"), "window": EMPTY}

        def pad(name, t):
            return torch.cat([t, t.new_full((t.shape[0], short), fill.get(name, 0))], -1)

        fields = {name: pad(name, t) for name, t in self.fields().items()}
        return TopK(fields.pop("score"), fields.pop("window"), fields.pop("position"), fields)

    def rows(self, start: int, stop: int) -> TopK:
        """The table of rows ``start .. stop - 1``."""
        fields = {name: t[start:stop] for name, t in self.fields().items()}
        return TopK(fields.pop("score"), fields.pop("window"), fields.pop("position"), fields)

    def to(self, device) -> TopK:
        return TopK(*(t.to(device) for t in (self.score, self.window, self.position)),
                    {n: t.to(device) for n, t in self.extras.items()})


@dataclass
class Accumulator:
    """What a sweep records over some windows: ``heads`` (``TopK`` of ``L * H`` rows, head ``(l, h)`` at
    row ``l * H + h``, by ``||head_out||``; None when only scores are recorded), ``neurons`` (``L * d_mlp``
    rows, neuron ``(l, n)`` at ``l * d_mlp + n``; None without MLPs or when only scores are recorded),
    ``sums`` (``{name: tensor}``, float64 or int64, added on merge) and ``roles`` (``{score name: TopK}``,
    rows as ``heads``: each head's top k by its attention to that score's targets at a position; empty
    when only scores are recorded)."""

    heads: TopK | None
    neurons: TopK | None
    sums: dict[str, torch.Tensor]
    roles: dict[str, TopK] = field(default_factory=dict)

    def merge(self, other: Accumulator) -> Accumulator:
        return Accumulator.merge_all([self, other])

    @staticmethod
    def merge_all(accs: list[Accumulator]) -> Accumulator:
        """All of ``accs`` merged: top-k tables in one selection, sums added in list order."""
        first = accs[0]
        for a in accs[1:]:
            if set(a.sums) != set(first.sums) or (a.heads is None) != (first.heads is None) \
                    or (a.neurons is None) != (first.neurons is None) or set(a.roles) != set(first.roles):
                raise ValueError("cannot merge accumulators of different sweeps (different statistics recorded)")
        sums = {}
        for name in first.sums:
            total = first.sums[name]
            for a in accs[1:]:
                total = total + a.sums[name]
            sums[name] = total
        return Accumulator(
            None if first.heads is None else TopK.merge_all([a.heads for a in accs]),
            None if first.neurons is None else TopK.merge_all([a.neurons for a in accs]),
            sums,
            {name: TopK.merge_all([a.roles[name] for a in accs]) for name in first.roles},
        )

    def to(self, device) -> Accumulator:
        return Accumulator(None if self.heads is None else self.heads.to(device),
                           None if self.neurons is None else self.neurons.to(device),
                           {n: t.to(device) for n, t in self.sums.items()},
                           {n: t.to(device) for n, t in self.roles.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}`` (``heads.score``, ``sums.z``, ``roles.induction.score``, ...) for a
        safetensors file."""
        out = {f"sums.{n}": t for n, t in self.sums.items()}
        tables = {"heads": self.heads, "neurons": self.neurons, **{f"roles.{n}": t for n, t in self.roles.items()}}
        for part, table in tables.items():
            if table is not None:
                out.update({f"{part}.{n}": t for n, t in table.fields().items()})
        return {n: t.contiguous() for n, t in out.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Accumulator:
        parts: dict[str, dict[str, torch.Tensor]] = {"heads": {}, "neurons": {}, "sums": {}}
        for name, t in tensors.items():
            part, _, key = name.partition(".")
            if part == "roles":
                role, _, key = key.partition(".")
                part = f"roles.{role}"
                parts.setdefault(part, {})
            if part not in parts:
                raise ValueError(f"unexpected tensor {name!r} in an accumulator file")
            parts[part][key] = t

        def table(fields):
            if not fields:
                return None
            return TopK(fields.pop("score"), fields.pop("window"), fields.pop("position"), fields)

        roles = {part.removeprefix("roles."): table(fields) for part, fields in parts.items()
                 if part.startswith("roles.")}
        return cls(table(parts["heads"]), table(parts["neurons"]), parts["sums"], roles)
