"""The sweep's accumulators: exact top-k in the total order (score descending, then window, then position),
and merges that give the serial answer under any grouping. Oracle: Python's ``sorted`` on tuples."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pycircuits_widgets.corpus.accumulators import EMPTY, Accumulator, TopK, top_k_first


def oracle_top(scores: list[float], k: int) -> list[int]:
    return [i for _, i in sorted((-s, i) for i, s in enumerate(scores))[:k]]


@given(st.lists(st.lists(st.sampled_from([-1.0, -0.0, 0.0, 0.5, 2.0, 3.0]), min_size=1, max_size=30),
                min_size=1, max_size=4), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_top_k_first_breaks_ties_by_index_like_a_full_sort(rows, k):
    n = min(len(r) for r in rows)
    rows = [r[:n] for r in rows]
    values, index = top_k_first(torch.tensor(rows), k)
    for r, row in enumerate(rows):
        expected = oracle_top(row, k)
        assert index[r].tolist() == expected
        assert values[r].tolist() == [row[i] for i in expected]


def test_a_tie_across_the_boundary_takes_the_first_indices():
    scores = torch.tensor([[1.0, 5.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    values, index = top_k_first(scores, 3)
    assert index.tolist() == [[1, 0, 2]] and values.tolist() == [[5.0, 1.0, 1.0]]


def table(examples: list[tuple[float, int, int]], k: int) -> TopK:
    """One row's ``TopK`` from ``(score, window, position)`` examples (already ranked), padded to ``k``."""
    t = TopK(torch.tensor([[e[0] for e in examples]], dtype=torch.float32),
             torch.tensor([[e[1] for e in examples]]), torch.tensor([[e[2] for e in examples]]),
             {"source": torch.tensor([[e[2] // 2 for e in examples]])})
    return t.padded(k)


def ranked(examples, k):
    return sorted(examples, key=lambda e: (-e[0], e[1], e[2]))[:k]


@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, 2.5, 7.0]), st.integers(0, 20), st.integers(0, 7)),
                min_size=0, max_size=40, unique_by=lambda e: (e[1], e[2])),
       st.integers(1, 6), st.integers(1, 5), st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None)
def test_any_sharding_and_merge_order_gives_the_serial_top_k(examples, k, n_shards, rnd):
    shards = [[] for _ in range(n_shards)]
    for e in examples:
        shards[rnd.randrange(n_shards)].append(e)
    tables = [table(ranked(s, k), k) for s in shards]
    rnd.shuffle(tables)
    merged = tables[0]
    for t in tables[1:]:
        merged = merged.merge(t) if rnd.random() < 0.5 else t.merge(merged)
    expected = ranked(examples, k)
    got = [(s, w, p) for s, w, p in zip(merged.score[0].tolist(), merged.window[0].tolist(), merged.position[0].tolist())
           if w != EMPTY]
    assert got == expected
    assert merged.extras["source"][0, :len(expected)].tolist() == [p // 2 for _, _, p in expected]


def test_accumulators_round_trip_through_flat_tensors_and_add_their_sums():
    acc = Accumulator(table([(2.0, 1, 3)], 2), None, {"z": torch.ones(2, 3, dtype=torch.float64),
                                                        "positions": torch.tensor(5)},
                      {"induction": table([(0.5, 1, 2)], 2), "previous_token": table([(0.9, 1, 0)], 2)})
    again = Accumulator.from_tensors(acc.tensors())
    assert again.neurons is None and set(again.roles) == {"induction", "previous_token"}
    assert acc.tensors().keys() == again.tensors().keys()
    assert all(torch.equal(acc.tensors()[n], again.tensors()[n]) for n in acc.tensors())
    other = Accumulator(table([(3.0, 2, 0)], 2), None, {"z": torch.ones(2, 3, dtype=torch.float64),
                                                          "positions": torch.tensor(7)},
                        {"induction": table([(0.7, 0, 5)], 2), "previous_token": table([(0.1, 2, 1)], 2)})
    both = acc.merge(other)
    assert both.roles["induction"].window.tolist() == [[0, 1]] and both.roles["previous_token"].window.tolist() == [[1, 2]]
    assert torch.equal(both.sums["z"], 2 * torch.ones(2, 3, dtype=torch.float64)) and int(both.sums["positions"]) == 12
    assert both.heads.window.tolist() == [[2, 1]] and both.heads.extras["source"].tolist() == [[0, 1]]


def test_accumulators_of_different_sweeps_do_not_merge():
    a = Accumulator(table([(2.0, 1, 3)], 2), None, {"positions": torch.tensor(5)})
    b = Accumulator(None, None, {"positions": torch.tensor(5)})
    with pytest.raises(ValueError, match="different statistics"):
        a.merge(b)
    with pytest.raises(ValueError, match="different statistics"):  # one recorded examples by role, one not
        a.merge(Accumulator(a.heads, None, a.sums, {"induction": a.heads}))
    with pytest.raises(ValueError, match="cannot merge top-k"):
        table([(1.0, 0, 0)], 2).merge(table([(1.0, 0, 0)], 3))


def test_merge_is_associative_on_random_tables():
    rnd = random.Random(0)
    examples = [(float(rnd.randrange(5)), w, p) for w in range(30) for p in range(4)]
    rnd.shuffle(examples)
    a, b, c = (table(ranked(examples[i::3], 5), 5) for i in range(3))
    left, right = a.merge(b).merge(c), a.merge(b.merge(c))
    for name in ("score", "window", "position"):
        assert torch.equal(getattr(left, name), getattr(right, name))
