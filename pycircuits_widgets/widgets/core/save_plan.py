"""The plan of a saved page: what each section's work costs at this model's size, and what fits.

A page of a large model cannot hold everything within its time and byte budgets (every head's exact
skip-trigram table of a 49k-token model is most of an hour of work). So before any work runs, each
view says what it could add to the page (``CircuitWidget.page_items``: a :class:`PlanItem` per piece
of work, its cost in seconds estimated from FLOP counts at this model's shape, scaled by a
:class:`Rate` measured once per save, and its bytes in the page), and :class:`SavePlan` keeps, in
order of value, what fits the save's seconds and the page's bytes. What was left out is named on the
page with its cost ("exact skip-trigram tables of 261 more heads: about 40 min in a kernel").

The value order (``PlanItem.value_rank``, lower first): views read from the weights alone (:data:`WEIGHTS`),
the corpus sweep's dataset examples (:data:`EXAMPLES`), exact tables of the heads a reader chose
(:data:`CHOSEN`), then measured matrices and the head-loss table (:data:`MEASURED`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

WEIGHTS, EXAMPLES, CHOSEN, MEASURED, REST = range(5)
"""``PlanItem.value_rank``: weight-only views first, then dataset examples, exact tables of chosen heads,
measured matrices and the head-loss table, then the rest (other heads' exact tables)."""

PAGE_BYTES_PER_ANSWER_BYTE = 4 / 3
"""A view's kernel-less answers (``offline.Answers`` counts their JSON before deflating, and their packed
arrays) land in the page as base64: at most 4/3 bytes of page per byte counted."""


@dataclass(frozen=True)
class Rate:
    """This machine's multiply-add rate at the model's width, measured once per save: ``flops_per_s`` of a
    ``[tokens, d_model] @ [d_model, d_hidden]`` product in the model's dtype, on its device (the best of at
    least 5 tries and ``MEASURE_S`` seconds: a busy machine's worst moment is not its rate)."""

    flops_per_s: float

    MEASURE_S = 0.05

    @classmethod
    def measure(cls, model, tokens: int = 256) -> Rate:
        cfg = model.cfg
        device, dtype = model.W_E.device, model.W_E.dtype
        hidden = max(cfg.d_mlp or 0, 4 * cfg.d_model)
        a = torch.randn(tokens, cfg.d_model, device=device, dtype=dtype)
        b = torch.randn(cfg.d_model, hidden, device=device, dtype=dtype)
        best, tries, began = float("inf"), 0, time.perf_counter()
        with torch.inference_mode():
            a @ b  # (the allocator's first touch is no multiply)
            while tries < 5 or time.perf_counter() - began < cls.MEASURE_S:
                start = time.perf_counter()
                (a @ b).sum().item()  # .item(): the product is done, on any device
                best, tries = min(best, time.perf_counter() - start), tries + 1
        return cls(2 * tokens * cfg.d_model * hidden / max(best, 1e-9))

    def seconds(self, flops: float) -> float:
        """Estimated seconds of ``flops`` multiply-adds x 2 at this rate."""
        return flops / self.flops_per_s


def forward_flops(cfg, tokens: int, seq_len: int, layers: int | None = None) -> float:
    """FLOPs of a forward of ``tokens`` tokens in windows of ``seq_len`` through the first ``layers``
    layers (default all; the unembedding only with all): the QKVO, MLP and unembedding products and the
    attention scores."""
    layers = cfg.n_layers if layers is None else layers
    heads = cfg.n_heads * cfg.d_head
    mlp = 0 if cfg.attn_only else (3 if cfg.gated_mlp else 2) * cfg.d_model * cfg.d_mlp
    per_layer = 4 * cfg.d_model * heads + mlp + 2 * heads * seq_len
    unembed = cfg.d_model * cfg.d_vocab if layers == cfg.n_layers else 0
    return 2.0 * tokens * (layers * per_layer + unembed)


@dataclass(frozen=True)
class PlanContext:
    """What a view is asked with for its page items (``CircuitWidget.page_items``): its ``section`` (the
    explorer's name for it), the save's measured ``rate`` and the heads the reader ``chosen`` (listed in
    ``save_html(heads=)``, then the selected one), most wanted first."""

    section: str
    rate: Rate
    chosen: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class PlanItem:
    """One piece of work a view could add to a saved page.

    Attributes:
        section: the view's explorer section ("examples").
        what: what it adds, in a phrase ("dataset examples").
        cost_s: estimated seconds of all its units (a FLOP count at this model's shape over a :class:`Rate`).
        bytes_estimate: estimated page bytes of all its units.
        value_rank: its place in the value order (:data:`WEIGHTS` ... :data:`REST`; lower first).
        run: ``run(n)`` computes the first ``n`` units (in the view's order: the selected head first), so
            the page written next holds them.
        units: how many units it has (heads); a plan may keep the first few.
        unit: the units' noun ("head"), "" for work done whole.
        leave: what the view does when the plan leaves the item out whole (so its save computes none of it:
            the page says it needs a kernel); None: nothing.
        cost_at: ``cost_at(n)``: estimated seconds of the first ``n`` units, where they do not cost alike (the
            examples' attention: the windows the first ``n`` heads show, each read once); None: ``n / units``
            of ``cost_s``.
    """

    section: str
    what: str
    cost_s: float
    bytes_estimate: int
    value_rank: int
    run: Callable[[int], None] = field(repr=False, compare=False)
    units: int = 1
    unit: str = ""
    leave: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    cost_at: Callable[[int], float] | None = field(default=None, repr=False, compare=False)

    def seconds(self, n: int) -> float:
        """Estimated seconds of the first ``n`` units."""
        return self.cost_at(n) if self.cost_at is not None else self.cost_s * n / self.units

    def bytes(self, n: int) -> float:
        """Estimated page bytes of the first ``n`` units."""
        return self.bytes_estimate * n / self.units

    def fitting(self, seconds: float | None, room: float) -> int:
        """The most units (from the first) whose estimates fit ``seconds`` (None: no limit) and ``room`` bytes."""
        fits = lambda n: (seconds is None or self.seconds(n) <= seconds) and self.bytes(n) <= room
        lo, hi = 0, self.units  # (costs grow with n: the largest n that fits, by bisection)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def __post_init__(self):
        if self.units < 1 or self.cost_s < 0 or self.bytes_estimate < 0:
            raise ValueError(f"PlanItem {self.section}/{self.what}: units must be >= 1 and costs >= 0, got units "
                             f"{self.units}, {self.cost_s} s, {self.bytes_estimate} bytes")

    def phrase(self, n: int, more: bool = False) -> str:
        """``what`` of ``n`` units ("dataset examples of 120 more heads"); ``what`` alone for work done whole."""
        if not self.unit:
            return self.what
        return f"{self.what} of {n} {'more ' if more else ''}{self.unit}{'' if n == 1 else 's'}"


MAX_BYTES = 4_000_000
"""Default most bytes of a saved page (``save_html(max_bytes=)``): a page a reader can mail."""


def check_max_bytes(max_bytes) -> int:
    """``max_bytes`` if it is a positive int, else a ``ValueError`` saying what was expected."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int (bytes of the page), got {max_bytes!r}")
    return max_bytes


def check_heads(heads, cfg) -> tuple[tuple[int, int], ...]:
    """``heads`` (``[(layer, head), ...]``, the heads whose exact tables a page should hold) as a tuple of
    int pairs, each within the model's ``n_layers x n_heads``, without repeats; else a ``ValueError`` naming
    the bad entry and the valid ranges."""
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
        raise ValueError(f"heads must be a list of (layer, head) pairs, got {heads!r}")
    out = []
    for entry in heads:
        pair = tuple(entry) if isinstance(entry, (list, tuple)) else None
        if (pair is None or len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in pair)
                or not (0 <= pair[0] < cfg.n_layers and 0 <= pair[1] < cfg.n_heads)):
            raise ValueError(f"heads: each entry must be a (layer, head) pair with layer in 0..{cfg.n_layers - 1} "
                             f"and head in 0..{cfg.n_heads - 1}, got {entry!r}")
        out.append(pair)
    return tuple(dict.fromkeys(out))


def duration(seconds: float) -> str:
    """A cost as a reader says it: "under a second", "about 40 s", "about 3 min", "about 2.5 h"."""
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"about {seconds:.0f} s"
    if seconds < 5400:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"


def megabytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


class SavePlan:
    """What a save computes, in order of value, within ``budget_s`` seconds (None: no limit) and the page's
    ``max_bytes``, of which ``base_bytes`` (the bundle and the views' state before any item) are spent.

    ``kept``: ``[(item, n units)]`` in the order they run; ``left``: ``[(item, n units left out)]``. An item
    is kept whole or its first units that fit; an item that does not fit at all does not stop a later,
    cheaper one."""

    def __init__(self, items: list[PlanItem], *, budget_s: float | None, max_bytes: int, base_bytes: int):
        if base_bytes > max_bytes:
            raise ValueError(f"max_bytes={max_bytes:,} is less than the page holds before any section's saved "
                             f"answers (the front end and the views' state: {base_bytes:,} bytes); give at least that")
        self.budget_s, self.max_bytes, self.base_bytes = budget_s, max_bytes, base_bytes
        self.items = sorted(items, key=lambda item: item.value_rank)  # (stable: each rank in the views' order)
        self.kept: list[tuple[PlanItem, int]] = []
        self.left: list[tuple[PlanItem, int]] = []
        seconds, room = budget_s, max_bytes - base_bytes
        for item in self.items:
            n = item.fitting(seconds, room)
            if n > 0:
                self.kept.append((item, n))
                seconds = None if seconds is None else seconds - item.seconds(n)
                room -= item.bytes(n)
            if n < item.units:
                self.left.append((item, item.units - n))

    @property
    def total_s(self) -> int:
        """The save bar's total: the kept work's estimated seconds, rounded up."""
        return max(1, math.ceil(self.cost_s))

    @property
    def cost_s(self) -> float:
        """Estimated seconds of the kept work (the save bar's estimate)."""
        return sum(item.seconds(n) for item, n in self.kept)

    def run(self, bar=None) -> None:
        """Leave out what did not fit (``PlanItem.leave``), then compute the kept items in order; ``bar`` (a
        ``progress`` bar of ``ceil(cost_s)`` estimated seconds, if given) names each and moves by its estimate."""
        for item, n in self.left:
            if n == item.units and item.leave is not None:
                item.leave()
        done = 0.0
        for item, n in self.kept:
            if bar is not None:
                bar.note(f"{item.section}: {item.phrase(n)}")
            item.run(n)
            before, done = done, done + item.seconds(n)
            if bar is not None:
                bar.update(round(done) - round(before))

    def left_out(self) -> list[str]:
        """What did not fit, each with its cost ("exact skip-trigram tables of 261 more heads: about 40 min
        in a kernel")."""
        kept = {(item.section, item.what) for item, _ in self.kept}  # ("more": some of the same were kept)
        return [f"{item.phrase(n, more=n < item.units or (item.section, item.what) in kept)}: "
                f"{duration(item.seconds(item.units) - item.seconds(item.units - n))} in a kernel, "
                f"{megabytes(int(item.bytes(n)))} of page"
                for item, n in self.left]

    def statement(self, page_bytes: int) -> str:
        """The page's own line about its budgets: its size of ``max_bytes`` and the seconds spent."""
        limit = "no time limit" if self.budget_s is None else f"a {self.budget_s:g} s budget"
        return (f"This page: {megabytes(page_bytes)} of its {megabytes(self.max_bytes)} budget (max_bytes), "
                f"computed within {limit} (planned work: {duration(self.cost_s)}).")
