"""Task circuits, edges: edge attribution patching (EAP, EAP-IG), a circuit, and its faithfulness.

The model as a graph (Elhage et al., 2021: each layer reads the sum of what every earlier part wrote
to the residual stream). **Upstream nodes**, what writes the stream: ``"embed"`` (the token embedding,
with learned positions), each head ``"L{l}.H{h}"`` (its output ``z @ W_O``) and each MLP ``"MLP{l}"``
(its output). **Downstream inputs**, what reads it: each head's query, key and value input
(``("L{l}.H{h}", "Q" | "K" | "V")``, the stream before the layer's norm, read by that head alone), each
MLP's input (``("MLP{l}", "mlp")``) and the logits' (``("logits", "logits")``, the final stream). An
**edge** ``(upstream, downstream, via)`` joins every upstream node to every input after it: the
upstream node's output is one term of that input (biases, the same in every run, are no node's).

**Edge attribution patching** (Syed et al., 2023): the metric's change when one edge carries the
corrupted run's value (the downstream input becomes the clean one plus that node's corrupted output
minus its clean output), to first order on the clean run: ``(a_u(corrupted) - a_u(clean)) . dm/dx_d``,
``x_d`` the downstream input. Every gradient ``dm/dx_d`` comes from one forward with zero read taps that
require grad at every head's query, key and value input, every MLP's input and the final stream
(``Interventions(taps=)``: ``models.interventions.READ_TAPS``) and one backward; every score is then one
product of the upstream differences ``[U, b * pos * d_model]`` with those gradients. **EAP-IG**
(Hanna et al., 2024, integrated gradients on the inputs): the gradient is the mean over ``k = 1..steps``
of the gradient on the run whose embedding is ``embed(corrupted) + k / steps (embed(clean) -
embed(corrupted))`` (one forward and backward per step; ``steps=1`` is EAP).

``EdgeAttribution.circuit(top_n= | threshold= | edges=)`` keeps some edges; ``.faithfulness(circuit)``
measures it exactly: the clean run in which every edge outside the circuit carries the corrupted run's
value (each downstream input is the run's own stream minus, for each edge left out, the upstream node's
output in this run minus its corrupted output, added by the read taps), its metric normalised as
``Task.normalise`` (1 the clean run, which is every edge's circuit; 0 the corrupted run, no edge's).
Each node's output in that run depends on the circuit's edges into it, so the inputs are set layer by
layer: one forward per attention layer and per MLP, and one for the metric.

Models whose heads or MLPs are normalised after they are summed (``cfg.post_norms``) are refused: their
outputs do not enter the stream additively.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..models.interventions import VIAS, Interventions
from .ablation import check_model
from .attribution import metric_gradients
from .patching import Task, head_outs

METHODS = ("eap", "eap-ig")
DEFAULT_STEPS = {"eap": 1, "eap-ig": 5}
"""Integration steps by default: EAP takes the gradient on the clean run alone; EAP-IG five points, as
Hanna et al. (2024)."""


def _head(layer: int, head: int) -> str:
    return f"L{layer}.H{head}"


@dataclass(frozen=True)
class Graph:
    """The nodes of a model (module docstring), in the order of the forward: ``upstream`` names ``[U]``,
    ``inputs`` ``[(downstream, via)]``; ``before[i]``: how many of the first upstream nodes input ``i``
    reads (a prefix: embed, then layer by layer each head and the MLP); ``edges`` ``[(upstream,
    downstream, via)]``, input by input, each input's upstream nodes in order."""

    n_layers: int
    n_heads: int
    mlps: bool
    parallel: bool
    upstream: tuple[str, ...]
    inputs: tuple[tuple[str, str], ...]
    before: tuple[int, ...]
    edges: tuple[tuple[str, str, str], ...] = field(repr=False)

    @staticmethod
    def of(cfg) -> Graph:
        L, H, mlps = cfg.n_layers, cfg.n_heads, not cfg.attn_only
        upstream, inputs, before = ["embed"], [], []
        for layer in range(L):
            for via in VIAS:
                for h in range(H):
                    inputs.append((_head(layer, h), via))
                    before.append(len(upstream))
            upstream += [_head(layer, h) for h in range(H)]
            if mlps:
                inputs.append((f"MLP{layer}", "mlp"))
                before.append(len(upstream) - (H if cfg.parallel_attn_mlp else 0))
                upstream.append(f"MLP{layer}")
        inputs.append(("logits", "logits"))
        before.append(len(upstream))
        edges = tuple((u, d, via) for (d, via), n in zip(inputs, before) for u in upstream[:n])
        return Graph(L, H, mlps, bool(cfg.parallel_attn_mlp), tuple(upstream), tuple(inputs), tuple(before), edges)

    def rank(self, node: str) -> int:
        """Where ``node`` sits in a drawing by layer: ``"embed"`` 0, layer ``l``'s heads ``2l + 1``, its MLP
        ``2l + 2``, ``"logits"`` ``2L + 1``."""
        if node == "embed":
            return 0
        if node == "logits":
            return 2 * self.n_layers + 1
        if node.startswith("MLP"):
            return 2 * int(node[3:]) + 2
        return 2 * int(node[1:node.index(".")]) + 1


@dataclass(frozen=True)
class Circuit:
    """Some edges of a model's graph: ``edges [(upstream, downstream, via)]``, their ``scores [n]`` (float64,
    the attribution's, NaN for an edge not scored), ``nodes`` (every node an edge touches, in the
    forward's order) and ``ranks {node: column}`` for a drawing by layer (``Graph.rank``: embed 0, layer
    ``l``'s heads ``2l + 1``, its MLP ``2l + 2``, the logits last)."""

    edges: tuple[tuple[str, str, str], ...]
    scores: torch.Tensor
    nodes: tuple[str, ...]
    ranks: dict

    def __len__(self) -> int:
        return len(self.edges)

    def __repr__(self) -> str:
        shown = ", ".join(f"{u}->{d}{'' if via in ('mlp', 'logits') else ' ' + via} {float(s):+.3g}"
                          for (u, d, via), s in zip(self.edges[:6], self.scores[:6]))
        return f"Circuit({len(self.edges)} edges, {len(self.nodes)} nodes: {shown}{', ...' if len(self) > 6 else ''})"


@dataclass(frozen=True)
class Faithfulness:
    """A circuit's run (every edge outside it carrying the corrupted run's value): ``score`` its metric
    normalised (``Task.normalise``: 1 the clean run, the full model; 0 the corrupted run), ``metric``
    the raw metric, beside ``metric_clean`` (the full model's) and ``metric_corrupted``; ``edges`` in the
    circuit, of ``total``. ``float(f)`` is ``score``."""

    score: float
    metric: float
    metric_clean: float
    metric_corrupted: float
    edges: int
    total: int

    def __float__(self) -> float:
        return self.score


@dataclass(frozen=True)
class EdgeAttribution:
    """Every edge's score (module docstring): ``edges [(upstream, downstream, via)]`` (``via`` one of "Q",
    "K", "V", "mlp", "logits"), ``scores [n_edges]`` (float64, the metric's units: its estimated change
    when that edge alone carries the corrupted run's value; divide by ``metric_clean - metric_corrupted``
    for the fraction of the behaviour), ``method`` ("eap", "eap-ig"), ``steps``; ``upstream`` and
    ``inputs`` name the nodes (``Graph``)."""

    method: str
    steps: int
    scores: torch.Tensor
    graph: Graph = field(repr=False)
    task: Task = field(repr=False)

    @property
    def edges(self) -> tuple[tuple[str, str, str], ...]:
        return self.graph.edges

    @property
    def upstream(self) -> tuple[str, ...]:
        return self.graph.upstream

    @property
    def inputs(self) -> tuple[tuple[str, str], ...]:
        return self.graph.inputs

    def score(self, upstream: str, downstream: str, via: str) -> float:
        """The score of one edge (refused, naming it, if the graph has no such edge)."""
        return float(self.scores[self._index()[_edge(upstream, downstream, via, self.graph)]])

    def top(self, k: int = 10) -> list[tuple[str, str, str, float]]:
        """The ``k`` edges of largest ``|score|``, largest first: ``(upstream, downstream, via, score)``."""
        order = torch.argsort(self.scores.abs(), descending=True, stable=True)[:k].tolist()
        return [(*self.edges[i], float(self.scores[i])) for i in order]

    def _index(self) -> dict:
        index = self.__dict__.get("_index_cache")
        if index is None:
            index = {e: i for i, e in enumerate(self.edges)}
            object.__setattr__(self, "_index_cache", index)
        return index

    def circuit(self, top_n: int | None = None, threshold: float | None = None, edges=None,
                prune: bool = False) -> Circuit:
        """A circuit of this graph, by exactly one of: ``top_n`` (the ``top_n`` edges of largest
        ``|score|``), ``threshold`` (every edge with ``|score| >= threshold``, in the metric's units) or
        ``edges`` (these ``(upstream, downstream, via)`` triples, e.g. a known circuit). ``prune``: then
        drop, until none is left, every edge into a node none of whose outputs the circuit keeps (the
        logits aside): what it carries reaches no output, so the circuit's ``faithfulness`` is the same
        without it, and its drawing shows only paths to the logits."""
        given = [name for name, value in (("top_n", top_n), ("threshold", threshold), ("edges", edges))
                 if value is not None]
        if len(given) != 1:
            raise ValueError(f"circuit: give exactly one of top_n, threshold or edges, got "
                             f"{', '.join(given) if given else 'none'}")
        n = len(self.edges)
        if top_n is not None:
            if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= n:
                raise ValueError(f"circuit: top_n must be an int in 0..{n} (the graph's edges), got {top_n!r}")
            chosen = torch.argsort(self.scores.abs(), descending=True, stable=True)[:top_n]
        elif threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0 \
                    or math.isnan(threshold):
                raise ValueError(f"circuit: threshold must be a number >= 0 (an |edge score|, in the metric's "
                                 f"units), got {threshold!r}")
            chosen = (self.scores.abs() >= threshold).nonzero().flatten()
        else:
            if isinstance(edges, (str, bytes)) or not hasattr(edges, "__iter__"):
                raise TypeError(f"circuit: edges must be (upstream, downstream, via) triples, got "
                                f"{type(edges).__name__}")
            index = self._index()
            chosen = torch.tensor(sorted({index[_edge(*_triple(e), self.graph)] for e in edges}), dtype=torch.long)
        chosen = torch.sort(chosen).values  # the graph's order: input by input
        if not isinstance(prune, bool):
            raise TypeError(f"circuit: prune must be True or False, got {prune!r}")
        while prune:
            read = {self.edges[i][0] for i in chosen.tolist()}  # nodes whose output an edge of the circuit carries
            reaching = torch.tensor([self.edges[i][1] in read or self.edges[i][1] == "logits" for i in chosen.tolist()],
                                    dtype=torch.bool)
            prune = not bool(reaching.all())
            chosen = chosen[reaching]
        kept = tuple(self.edges[i] for i in chosen.tolist())
        order = {name: i for i, name in enumerate((*self.graph.upstream, "logits"))}
        nodes = tuple(sorted({node for u, d, _ in kept for node in (u, d)}, key=order.__getitem__))
        return Circuit(kept, self.scores[chosen].clone(), nodes, {node: self.graph.rank(node) for node in nodes})

    @torch.no_grad()
    def faithfulness(self, circuit: Circuit) -> Faithfulness:
        """The circuit's metric, exactly (module docstring): the clean run with every edge outside
        ``circuit`` carrying the corrupted run's value, normalised (1 the full model, 0 the corrupted run),
        beside the raw metrics."""
        if not isinstance(circuit, Circuit):
            raise TypeError(f"faithfulness: circuit must be a Circuit (result.circuit(top_n=...)), got "
                            f"{type(circuit).__name__}")
        index = self._index()
        for e in circuit.edges:
            _edge(*e, self.graph, where="faithfulness")
        g, task = self.graph, self.task
        model = task.model
        left_out = torch.ones(len(self.edges), dtype=torch.bool)
        left_out[[index[e] for e in circuit.edges]] = False
        tokens = task.tokens_clean
        corrupted = _outputs(model, g, task.corrupted).flatten(1)  # [U, b * pos * d]
        patched = [task.clean.embed.flatten()]  # each upstream node's output in the circuit's run, in order
        starts = [0, *torch.tensor(g.before).cumsum(0).tolist()]  # input i's edges: starts[i]..starts[i + 1]
        shape = task.clean.embed.shape  # [b, pos, d]

        def less(first: int, count: int) -> torch.Tensor:
            """``[count, b, pos, d]``: what inputs ``first..first + count`` (of one upstream prefix) read less than
            the circuit's run's stream: minus the sum, over each one's edges outside the circuit, of the
            upstream node's output in this run minus its corrupted output."""
            n = g.before[first]
            mask = torch.stack([left_out[starts[i]:starts[i + 1]] for i in range(first, first + count)])  # [count, n]
            differences = torch.stack(patched[:n]) - corrupted[:n]  # [n, N]
            return -(mask.to(differences.dtype) @ differences).view(count, *shape)

        taps: dict = {}
        i = 0
        for layer in range(g.n_layers):
            for via in VIAS:
                taps[layer, via] = less(i, g.n_heads).transpose(0, 1)  # [b, H, pos, d]
                i += g.n_heads
            _, cache = model.run_with_cache(tokens, Interventions(taps=dict(taps)), logits=False, layers=layer + 1)
            patched += list(head_outs(model, cache, layer).transpose(0, 1).flatten(1))  # [b, H, pos, d]: H outputs
            if g.mlps:
                taps[layer, "mlp_in"] = less(i, 1)[0]
                i += 1
                _, cache = model.run_with_cache(tokens, Interventions(taps=dict(taps)), logits=False,
                                                layers=layer + 1)
                patched.append(cache.mlp_out[:, layer].flatten())
        taps[g.n_layers - 1, "post" if g.mlps else "mid"] = less(i, 1)[0]
        metric = task.run_metric(tokens, Interventions(taps=taps), task.clean, "the circuit's run (faithfulness)")
        return Faithfulness(task.normalise(metric), metric, task.metric_clean, task.metric_corrupted,
                            len(circuit.edges), len(self.edges))

    def __repr__(self) -> str:
        best = ", ".join(f"{u}->{d}{'' if via in ('mlp', 'logits') else ' ' + via} {s:+.3g}"
                         for u, d, via, s in self.top(3))
        return (f"EdgeAttribution({self.method}, steps={self.steps}: {len(self.edges)} edges; top {best}; metric clean "
                f"{self.task.metric_clean:.4g}, corrupted {self.task.metric_corrupted:.4g})")


def _triple(edge) -> tuple:
    if not isinstance(edge, (tuple, list)) or len(edge) != 3:
        raise ValueError(f"circuit: an edge is an (upstream, downstream, via) triple, got {edge!r}")
    return tuple(edge)


def _edge(upstream, downstream, via, graph: Graph, where: str = "circuit") -> tuple[str, str, str]:
    """``(upstream, downstream, via)`` if the graph has that edge; else a ValueError saying why."""
    edge = (upstream, downstream, via)
    if edge in _edge_set(graph):
        return edge
    if upstream not in graph.upstream:
        raise ValueError(f"{where}: unknown upstream node {upstream!r}; upstream nodes are 'embed', 'L{{l}}.H{{h}}' "
                         f"and 'MLP{{l}}' (first {graph.upstream[:3]}, last {graph.upstream[-1]!r})")
    if (downstream, via) not in graph.inputs:
        raise ValueError(f"{where}: unknown input ({downstream!r}, {via!r}); inputs are (head, 'Q' | 'K' | 'V'), "
                         f"('MLP{{l}}', 'mlp') and ('logits', 'logits')")
    raise ValueError(f"{where}: no edge {upstream!r} -> ({downstream!r}, {via!r}): {upstream!r} writes after that "
                     "input is read")


def _edge_set(graph: Graph) -> frozenset:
    edges = graph.__dict__.get("_set")
    if edges is None:
        edges = frozenset(graph.edges)
        object.__setattr__(graph, "_set", edges)
    return edges


def _outputs(model, graph: Graph, cache) -> torch.Tensor:
    """``[U, b, pos, d_model]``: each upstream node's output in the run ``cache``, in ``graph.upstream``'s order."""
    parts = [cache.embed[None]]
    head_out = cache.head_out  # [b, L, H, pos, d]
    for layer in range(graph.n_layers):
        parts.append(head_out[:, layer].transpose(0, 1))
        if graph.mlps:
            parts.append(cache.mlp_out[None, :, layer])
    return torch.cat(parts)


def _check(model, task, method, steps) -> int:
    check_model(model, "edge_attribution")
    if not isinstance(task, Task) or task.model is not model:
        raise TypeError("edge_attribution: task must be the pcw.Task of this model (pcw.Task(model, clean, corrupted, "
                        f"answers)), got {type(task).__name__ if not isinstance(task, Task) else 'another model'}")
    if method not in METHODS:
        raise ValueError(f"edge_attribution: method must be one of {METHODS}, got {method!r}")
    if steps is None:
        steps = DEFAULT_STEPS[method]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"edge_attribution: steps must be an int >= 1 (integration steps), got {steps!r}")
    if method == "eap" and steps != 1:
        raise ValueError(f"edge_attribution: method 'eap' takes the gradient on the clean run alone (steps=1), got "
                         f"steps={steps}; integrated gradients over steps: method='eap-ig'")
    c = model.cfg
    if c.post_norms:
        raise ValueError(f"edge_attribution: {c.name!r} normalises its heads' and MLPs' outputs after summing them "
                         "(post-norms), so no node's output enters the stream additively")
    if c.qk_norm is not None and not c.qk_norm_heads:
        raise ValueError(f"edge_attribution: {c.name!r} normalises the queries and keys of all heads of a position "
                         "together, so one head's query or key input is not its own")
    return steps


def _read_gradients(model, task: Task, graph: Graph, embed: torch.Tensor | None, where: str) -> list[torch.Tensor]:
    """The metric's gradient at every input of ``graph`` on the clean run (``embed``: with this embedding
    ``[b, pos, d_model]``): per layer ``Q``, ``K``, ``V`` ``[b, H, pos, d]`` then the MLP's ``[b, pos, d]``;
    the final stream's last. One forward with zero read taps that require grad, one backward."""
    tokens = task.tokens_clean
    b, pos = tokens.shape
    dtype = model.dtype if model.dtype in (torch.float32, torch.float64) else torch.float32
    zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=model.device, requires_grad=True)
    d, H, L = model.cfg.d_model, graph.n_heads, graph.n_layers
    taps = {}
    for layer in range(L):
        for via in VIAS:
            taps[layer, via] = zeros(b, H, pos, d)
        if graph.mlps:
            taps[layer, "mlp_in"] = zeros(b, pos, d)
    taps[L - 1, "post" if graph.mlps else "mid"] = zeros(b, pos, d)
    edits = Interventions(taps=taps, resid={} if embed is None else {0: embed})
    return list(metric_gradients(task, None, list(taps.values()), where,
                                  metric=lambda: task.metric_tensor(tokens, edits)))


def edge_attribution(model, task: Task, method: str = "eap", steps: int | None = None) -> EdgeAttribution:
    """Every edge's attribution score (module docstring) for ``task``: ``method`` "eap" (the gradient on the
    clean run: one forward and one backward) or "eap-ig" (integrated gradients over ``steps`` runs of
    the embedding from the corrupted to the clean one, default 5: a forward and a backward each).
    Returns an ``EdgeAttribution`` (``.scores [n_edges]``, ``.circuit()``, ``.faithfulness()``)."""
    steps = _check(model, task, method, steps)
    graph = Graph.of(model.cfg)
    total = None
    for k in range(1, steps + 1):
        embed = None
        if method == "eap-ig":
            embed = torch.lerp(task.corrupted.embed, task.clean.embed, k / steps)
        where = "edge_attribution" + (f" (step {k} of {steps}, the embedding {k}/{steps} of the way from the "
                                      "corrupted run's to the clean one's)" if method == "eap-ig" else "")
        grads = _read_gradients(model, task, graph, embed, where)
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    with torch.no_grad():
        delta = _outputs(model, graph, task.corrupted) - _outputs(model, graph, task.clean)  # [U, b, pos, d]
        delta = delta.flatten(1).to(total[0].dtype)  # [U, N]
        scores, i = [], 0
        for grad in total:
            if grad.ndim == 4:  # one via of every head of a layer [b, H, pos, d]: H inputs
                per_input = grad.transpose(0, 1).flatten(1)
            else:
                per_input = grad.flatten()[None]
            n = graph.before[i]
            # [n, N] @ [N, inputs]: each input's score from each upstream node before it
            block = (delta[:n] @ per_input.T).T.double() / steps  # [inputs, n]
            scores += list(block)
            i += len(per_input)
        scores = torch.cat(scores)
        if not bool(torch.isfinite(scores).all()):
            raise ValueError("edge_attribution: the metric's gradient is not finite on some run (its scores are NaN or "
                             "inf): the metric must be differentiable, with finite gradients, on the runs between the "
                             "corrupted and the clean one")
    return EdgeAttribution(method, steps, scores.cpu(), graph, task)
