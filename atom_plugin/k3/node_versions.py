"""Chains of copied trie nodes kept as one dict and a record per edge set, laid out with numpy.

The call automaton's key windows (`CallAutomaton._insert`) copy the nodes along each new
key's path and set one edge on each copy: a node of window i is its copy in window i + 1
with one edge set. A node that branches to many keys (the ids after `key="p` with 2,000
properties `p0`, `p1`, ...) would cost every window all of its edges in Python twice, as
a dict copy and again as the table's arrays. Here a chain of copies is a family: one dict
holds the edges of its newest copy (the only copy the build reads or sets), the edges of
the node first copied are its base, and each edge set on a copy is recorded. `rows()`
writes the edges of every copy, ids ascending, with numpy: an id's position at a copy is
its rank when it was added plus the count of smaller ids added since.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from atom_plugin.k3 import call_table

_THERE = -1  # the rank recorded for a set whose id had an edge already
_UNRANKED = -2  # for a set that added an id past `LIMITS.allowed` (see `set`)


@dataclass
class _Family:
    index: int
    base: dict[int, int]  # the edges of the node first copied
    edges: dict[int, int]  # the newest copy's
    states: list[int] = field(default_factory=list)  # the copies, oldest first
    sorted_ids: list[int] = field(default_factory=list)  # the newest copy's ids, ascending


@dataclass(frozen=True)
class CopiedRows:
    """Edge i of the copies is `ids[i]` -> `targets[i]`, at `at[i]` in the table's edges."""

    at: np.ndarray
    ids: np.ndarray
    targets: np.ndarray


class NodeVersions:
    """The copied nodes of one automaton's build. The build keeps no edges of its own for
    a copy: it reads and sets a family's newest copy through `edges` and `set`."""

    def __init__(self) -> None:
        self._newest: dict[int, _Family] = {}  # a family's newest copy -> the family
        self._families: list[_Family] = []
        self.copies: set[int] = set()
        # Per set: its family, the copy within the family, id, target and rank when added
        # (_THERE or _UNRANKED).
        self._sets: list[tuple[int, int, int, int, int]] = []
        self._numbered: _Numbering | None = None

    def edges(self, state: int) -> dict[int, int] | None:
        """The edges of `state` if it is a family's newest copy, else None."""
        family = self._newest.get(state)
        return None if family is None else family.edges

    def copy(self, source: int, state: int, edges_of: Callable[[int], dict[int, int]]) -> None:
        """Make `state` a copy of `source`: a family's newest copy, or a node whose edges
        are `edges_of(source)`. `source` is final from then on."""
        family = self._newest.pop(source, None)
        if family is None and source in self.copies:
            raise RuntimeError(f"state {source} is an older copy: its edges are not kept")
        if family is None:
            base = edges_of(source)
            family = _Family(len(self._families), dict(base), dict(base))
            family.sorted_ids = sorted(base)
            self._families.append(family)
        family.states.append(state)
        self._newest[state] = family
        self.copies.add(state)

    def set(self, state: int, token: int, target: int) -> bool:
        """Set an edge of `state` if it is a family's newest copy; False if it is not."""
        family = self._newest.get(state)
        if family is None:
            return False
        rank = _THERE
        if token not in family.edges:
            ids = family.sorted_ids
            if len(ids) < call_table.LIMITS.allowed:
                rank = bisect.bisect_left(ids, token)
                ids.insert(rank, token)
            else:  # the copy allows more ids than a state may: the table fails its check
                rank = _UNRANKED
        family.edges[token] = target
        self._sets.append((family.index, len(family.states) - 1, token, target, rank))
        return True

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Every copy's state and its number of edges."""
        n = self._numbering()
        added = np.bincount(n.set_copy[n.set_rank != _THERE], minlength=len(n.states))
        through = np.cumsum(added)  # ids added up to each copy (all families)
        first = n.first[n.family]
        lengths = n.base_size[n.family] + through - through[first] + added[first]
        return n.states, lengths

    def rows(self, row_start: np.ndarray) -> CopiedRows:
        """Every copy's edges, placed for a table whose state s has its edges from
        `row_start[s]` on. Call it once `lengths()` are within `LIMITS` (every added id
        then has its rank)."""
        n = self._numbering()
        if not len(n.states):
            empty = np.zeros(0, dtype=np.int64)
            return CopiedRows(empty, empty, empty)
        if (n.set_rank == _UNRANKED).any():
            raise ValueError("copies allowing more ids than LIMITS.allowed have no layout")
        # The records of edges: each base's (at its family's first copy, before a set
        # there) and each set's, ordered by family, id and copy: each id's records in
        # turn, each holding from its copy until the id's next record.
        sets = len(n.set_copy)
        family = np.concatenate([n.base_family, n.set_family])
        ids = np.concatenate([n.base_ids, n.set_ids])
        at = np.concatenate([n.first[n.base_family], n.set_copy])
        is_set = np.repeat([False, True], [len(n.base_ids), sets])
        targets = np.concatenate([n.base_targets, n.set_targets])
        added_rank = np.concatenate([n.base_rank, n.set_rank])
        order = np.lexsort((is_set, at, ids, family))
        family, ids, at, targets, added_rank = (
            a[order] for a in (family, ids, at, targets, added_rank)
        )
        same_next = np.zeros(len(ids), dtype=bool)
        same_next[:-1] = (ids[1:] == ids[:-1]) & (family[1:] == family[:-1])
        last = n.first + n.count - 1  # per family
        end = np.where(same_next, np.roll(at, -1) - 1, last[family])
        count = np.maximum(end - at + 1, 0)
        begins = np.cumsum(count) - count  # each record's first row
        total = int(begins[-1] + count[-1])
        # One row per edge of a copy, record by record (int32: ids, states and positions
        # are within LIMITS).
        copy = np.repeat((at - begins).astype(np.int32), count)
        copy += np.arange(total, dtype=np.int32)
        edge_id = np.repeat(ids.astype(np.int32), count)
        # An id's rank at a copy: its rank when added (its first record's) plus the
        # smaller ids added at its copies since: a running count over the id's rows,
        # contiguous here (its own add is not smaller: it counts 0).
        added_at = np.full(len(n.states), np.iinfo(np.int32).max, dtype=np.int32)
        adds = n.set_rank >= 0
        added_at[n.set_copy[adds]] = n.set_ids[adds]
        running = np.cumsum(added_at[copy] < edge_id, dtype=np.int32)
        # Per record, what turns the running count into the rank: the id's rank when
        # added less the count before the id's first row.
        starts = np.flatnonzero(np.concatenate([[True], ~same_next[:-1]]))
        before = np.concatenate([[0], running])[begins[starts]]
        per_id = added_rank[starts] - before
        per_record = np.repeat(per_id, np.diff(np.append(starts, len(ids))))
        at_row = np.repeat(per_record.astype(np.int32), count)
        at_row += running
        at_row += row_start[n.states].astype(np.int32)[copy]
        return CopiedRows(at_row, edge_id, np.repeat(targets.astype(np.int32), count))

    def _numbering(self) -> _Numbering:
        """The copies numbered family by family, each family's contiguous, oldest first
        (once the build is done: the first call keeps it)."""
        if self._numbered is None:
            self._numbered = self._number()
        return self._numbered

    def _number(self) -> _Numbering:
        families = self._families
        count = np.array([len(f.states) for f in families], dtype=np.int64)
        base_size = np.array([len(f.base) for f in families], dtype=np.int64)
        first = np.cumsum(count) - count
        bases = int(base_size.sum())
        base_family = np.repeat(np.arange(len(families)), base_size)
        base_ids = _flat(bases, (f.base for f in families))
        # A base id's rank among its family's base ids.
        base_rank = np.empty(bases, dtype=np.int64)
        base_rank[np.lexsort((base_ids, base_family))] = np.arange(bases) - np.repeat(
            np.cumsum(base_size) - base_size, base_size
        )
        sets = np.array(self._sets, dtype=np.int64).reshape(-1, 5)
        return _Numbering(
            states=_flat(int(count.sum()), (f.states for f in families)),
            family=np.repeat(np.arange(len(families)), count),
            first=first,
            count=count,
            base_size=base_size,
            base_family=base_family,
            base_ids=base_ids,
            base_targets=_flat(bases, (f.base.values() for f in families)),
            base_rank=base_rank,
            set_family=sets[:, 0],
            set_copy=first[sets[:, 0]] + sets[:, 1],
            set_ids=sets[:, 2],
            set_targets=sets[:, 3],
            set_rank=sets[:, 4],
        )


@dataclass(frozen=True)
class _Numbering:
    states: np.ndarray  # per copy
    family: np.ndarray  # per copy
    first: np.ndarray  # per family: its first copy
    count: np.ndarray  # per family: its copies
    base_size: np.ndarray  # per family
    base_family: np.ndarray  # per base edge (and its id, target, rank)
    base_ids: np.ndarray
    base_targets: np.ndarray
    base_rank: np.ndarray
    set_family: np.ndarray  # per set (and its copy, id, target, rank)
    set_copy: np.ndarray
    set_ids: np.ndarray
    set_targets: np.ndarray
    set_rank: np.ndarray


def _flat(count: int, parts) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=count)
