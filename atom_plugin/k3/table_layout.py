"""A call automaton's build laid out as a `CallTable`'s arrays, with numpy.

`CallAutomaton` (call_automaton.py) holds a state's edges in one of three ways: a dict of
its own (`edges[s]`); a run of states that each force one id (`Chains`: most states, kept
as runs, with no dict each); or a copied trie node (`NodeVersions`, node_versions.py).
`table_arrays` reads each kind in bulk (the dicts through C iterators, the others as
arrays), checks the sizes against `LIMITS` before writing the copies' rows, and places
every edge at its state's offset plus its rank there (ids ascending within a state).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Mapping, Sequence

import numpy as np

from atom_plugin.k3.call_table import check_sizes
from atom_plugin.k3.node_versions import NodeVersions


class Chains:
    """Runs of states forcing ids: the run from `first` forces `ids` (state first + k has
    the one edge ids[k] -> first + k + 1, the last one to `target`). Nothing sets an edge
    on them once added, so the build keeps no dict for them."""

    def __init__(self) -> None:
        self._first: list[int] = []
        self._ids: list[Sequence[int]] = []
        self._target: list[int] = []

    def add(self, first: int, ids: Sequence[int], target: int) -> None:
        self._first.append(first)
        self._ids.append(ids)
        self._target.append(target)

    def edges(self, state: int) -> dict[int, int]:
        """The one edge of `state`, a state of a run."""
        run = bisect.bisect_right(self._first, state) - 1
        first, ids = self._first[run], self._ids[run]
        k = state - first
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


def table_arrays(
    edges: Sequence[Mapping[int, int] | None],
    chains: Chains,
    class_edges: Mapping[int, Mapping[int, int]],
    copies: NodeVersions,
) -> dict[str, np.ndarray]:
    """The arrays of a `CallTable` (call_table.py) of `len(edges)` states: `edges[s]` is
    s's own edges (None for a state of `chains`, empty for a copy of `copies`),
    `class_edges[s]` its class edges (states without are absent). CallsTooLarge beyond
    `LIMITS`."""
    n = len(edges)
    chain_state, chain_ids, chain_targets = chains.arrays()
    own = np.ones(n, dtype=bool)
    own[chain_state] = False
    own_states = np.flatnonzero(own)
    src, ids, targets = _sorted_edges([edges[s] for s in own_states.tolist()], own_states)
    with_classes = np.fromiter(class_edges, dtype=np.int64, count=len(class_edges))
    class_src, cls, class_targets = _sorted_edges(list(class_edges.values()), with_classes)
    copied, lengths = copies.lengths()
    own_counts = np.bincount(src, minlength=n)
    counts = own_counts + np.bincount(chain_state, minlength=n)
    counts[copied] += lengths
    class_counts = np.bincount(class_src, minlength=n)
    check_sizes(n, int(counts.max(initial=0)), int(counts.sum() + class_counts.sum()))
    ptr = _offsets(counts)
    out_ids = np.empty(int(ptr[-1]), dtype=np.int32)
    out_targets = np.empty_like(out_ids)
    # A state's own edges are in order already: the i-th of them goes to ptr[s] + i.
    at = ptr[src] + np.arange(len(src)) - (np.cumsum(own_counts) - own_counts)[src]
    out_ids[at], out_targets[at] = ids, targets
    out_ids[ptr[chain_state]], out_targets[ptr[chain_state]] = chain_ids, chain_targets
    copies.place(ptr, out_ids, out_targets)
    return {
        "edge_ptr": ptr.astype(np.int32),
        "edge_tok": out_ids,
        "edge_dst": out_targets,
        "class_ptr": _offsets(class_counts).astype(np.int32),
        "class_cls": cls.astype(np.int32),
        "class_dst": class_targets.astype(np.int32),
    }


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


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
