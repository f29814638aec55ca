"""A call automaton's build laid out as a `CallTable`'s arrays, with numpy.

`CallAutomaton` (call_automaton.py) holds a state's edges in one of four ways: a dict of
its own (`edges[s]`, and `class_edges[s]` for its class edges); a run of states that each
force one id (`Chains`: most states); a run of a number's states that leave on an
explicit id (`NumberRuns`: every integer or number argument and call index); or a copied
trie node (`NodeVersions`, node_versions.py). Runs are final once added and copies keep
their edges apart, so the build keeps no dicts for either. `table_arrays` reads each
kind in bulk (the dicts through C iterators, the others as arrays), checks the sizes
against `LIMITS` before writing the copies' rows, and places every edge at its state's
offset plus its rank there (ids and classes ascending within a state).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from atom_plugin.k3.call_table import check_sizes
from atom_plugin.k3.node_versions import NodeVersions

# A number language's states (call_automaton `_number_shape`): per state its (class,
# state index) moves and whether it accepts.
Shape = tuple[tuple[tuple[tuple[int, int], ...], bool], ...]


class Chains:
    """Runs of states forcing ids: the run from `first` forces `ids` (state first + k has
    the one edge ids[k] -> first + k + 1, the last one to `target`)."""

    def __init__(self) -> None:
        self._first: list[int] = []
        self._ids: list[Sequence[int]] = []
        self._target: list[int] = []

    def add(self, first: int, ids: Sequence[int], target: int) -> None:
        self._first.append(first)
        self._ids.append(ids)
        self._target.append(target)

    def edges(self, state: int) -> dict[int, int]:
        """The one edge of `state`; KeyError if it is in no run."""
        run = bisect.bisect_right(self._first, state) - 1
        first, ids = (self._first[run], self._ids[run]) if run >= 0 else (0, ())
        k = state - first
        if not 0 <= k < len(ids):
            raise KeyError(f"state {state} is in no run of forced ids")
        return {ids[k]: first + k + 1 if k < len(ids) - 1 else self._target[run]}

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every state of a run, its id and its target."""
        counts = np.fromiter(map(len, self._ids), dtype=np.int64, count=len(self._ids))
        total = int(counts.sum())
        starts = np.cumsum(counts) - counts
        state = np.repeat(np.asarray(self._first, dtype=np.int64) - starts, counts)
        state += np.arange(total)
        ids = np.fromiter(itertools.chain.from_iterable(self._ids), dtype=np.int64, count=total)
        targets = state + 1
        targets[starts + counts - 1] = self._target
        return state, ids, targets


@dataclass(frozen=True)
class _NumberEdges:
    states: np.ndarray  # every state of a run
    edge_state: np.ndarray  # an accepting state's explicit edge: its state, id and target
    edge_ids: np.ndarray
    edge_targets: np.ndarray
    class_state: np.ndarray  # a class edge: its state, rank there, class and target
    class_rank: np.ndarray
    classes: np.ndarray
    class_targets: np.ndarray


class NumberRuns:
    """Runs of a number language's states: the run from `first` has `shape`'s states
    (first + j for its state j), an accepting one leaving on the id `end` to `after`."""

    def __init__(self) -> None:
        # By the shape's id (one object per language: `_number_shape` is cached).
        self._runs: dict[int, tuple[Shape, list[tuple[int, int, int]]]] = {}

    def add(self, first: int, shape: Shape, end: int, after: int) -> None:
        self._runs.setdefault(id(shape), (shape, []))[1].append((first, end, after))

    def arrays(self) -> _NumberEdges:
        parts = []
        for shape, runs in self._runs.values():
            first, end, after = np.array(runs, dtype=np.int64).T
            accepting = [j for j, (_, accepts) in enumerate(shape) if accepts]
            moves = [(j, r, c, k) for j, (m, _) in enumerate(shape) for r, (c, k) in enumerate(m)]
            j, rank, cls, k = np.array(moves, dtype=np.int64).reshape(-1, 4).T
            at = first[:, None]
            parts.append(
                (
                    (at + np.arange(len(shape))).ravel(),
                    (at + accepting).ravel(),
                    np.repeat(end, len(accepting)),
                    np.repeat(after, len(accepting)),
                    (at + j).ravel(),
                    np.tile(rank, len(runs)),
                    np.tile(cls, len(runs)),
                    (at + k).ravel(),
                )
            )
        columns = zip(*parts, strict=True) if parts else [()] * 8
        return _NumberEdges(*(np.concatenate(c) if c else np.zeros(0, np.int64) for c in columns))


def table_arrays(
    edges: Sequence[Mapping[int, int] | None],
    chains: Chains,
    numbers: NumberRuns,
    class_edges: Mapping[int, Mapping[int, int]],
    copies: NodeVersions,
) -> dict[str, np.ndarray]:
    """The arrays of a `CallTable` (call_table.py) of `len(edges)` states: `edges[s]` is
    s's own edges (None for a state of a run or a copy of `copies`),
    `class_edges[s]` its class edges (states without are absent). CallsTooLarge beyond
    `LIMITS`."""
    n = len(edges)
    chain_state, chain_ids, chain_targets = chains.arrays()
    runs = numbers.arrays()
    copied, lengths = copies.lengths()
    own = np.ones(n, dtype=bool)
    own[chain_state] = False
    own[runs.states] = False
    own[copied] = False
    own_states = np.flatnonzero(own)
    src, ids, targets = _sorted_edges([edges[s] for s in own_states.tolist()], own_states)
    with_classes = np.fromiter(class_edges, dtype=np.int64, count=len(class_edges))
    class_src, cls, class_targets = _sorted_edges(list(class_edges.values()), with_classes)
    own_counts = np.bincount(src, minlength=n)
    counts = own_counts + np.bincount(chain_state, minlength=n)
    counts += np.bincount(runs.edge_state, minlength=n)
    counts[copied] += lengths
    own_class_counts = np.bincount(class_src, minlength=n)
    class_counts = own_class_counts + np.bincount(runs.class_state, minlength=n)
    check_sizes(n, int(counts.max(initial=0)), int(counts.sum() + class_counts.sum()))
    ptr = _offsets(counts)
    out_ids = np.empty(int(ptr[-1]), dtype=np.int32)
    out_targets = np.empty_like(out_ids)
    # Each state's edges come from one source: its own, in order already (the i-th of a
    # state's goes to ptr[s] + i), a run's (one each) or its copy's.
    at = ptr[src] + _rank_in_state(src, own_counts)
    out_ids[at], out_targets[at] = ids, targets
    out_ids[ptr[chain_state]], out_targets[ptr[chain_state]] = chain_ids, chain_targets
    at = ptr[runs.edge_state]
    out_ids[at], out_targets[at] = runs.edge_ids, runs.edge_targets
    copies.place(ptr, out_ids, out_targets)
    class_ptr = _offsets(class_counts)
    out_cls = np.empty(int(class_ptr[-1]), dtype=np.int32)
    out_cls_targets = np.empty_like(out_cls)
    at = class_ptr[class_src] + _rank_in_state(class_src, own_class_counts)
    out_cls[at], out_cls_targets[at] = cls, class_targets
    at = class_ptr[runs.class_state] + runs.class_rank
    out_cls[at], out_cls_targets[at] = runs.classes, runs.class_targets
    return {
        "edge_ptr": ptr.astype(np.int32),
        "edge_tok": out_ids,
        "edge_dst": out_targets,
        "class_ptr": class_ptr.astype(np.int32),
        "class_cls": out_cls,
        "class_dst": out_cls_targets,
    }


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _rank_in_state(src: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each entry's place among its state's, for entries sorted by state (`counts` per
    state)."""
    return np.arange(len(src)) - (np.cumsum(counts) - counts)[src]


def _sorted_edges(
    maps: Sequence[Mapping[int, int]], states: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(state, key, value) of every entry of `maps` (`maps[i]` is state `states[i]`'s),
    by state, then key.

    The maps are read by C iterators (no Python step per entry) and ordered by one stable
    sort of (state, key) as a single int64, mostly in order already (a state's keys are
    distinct, so no two entries tie).
    """
    counts = np.fromiter(map(len, maps), dtype=np.int64, count=len(maps))
    total = int(counts.sum())
    keys = np.fromiter(itertools.chain.from_iterable(maps), dtype=np.int64, count=total)
    values = np.fromiter(
        itertools.chain.from_iterable(map(operator.methodcaller("values"), maps)),
        dtype=np.int64,
        count=total,
    )
    src = np.repeat(states.astype(np.int64), counts)
    if total:
        low = int(keys.min())
        span = int(keys.max()) - low + 1
        order = np.argsort(src * span + (keys - low), kind="stable")
        src, keys, values = src[order], keys[order], values[order]
    return src, keys, values
