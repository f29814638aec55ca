"""Chains of copied trie nodes kept as one dict and a record per edge set, laid out with numpy.

The call automaton's key windows (`CallAutomaton._insert`) copy the nodes along each new
key's path and set one edge on each copy: a node of window i is its copy in window i + 1
with one edge set. A node that branches to many keys (the ids after `key="p` with 2,000
properties `p0`, `p1`, ...) would cost every window all of its edges in Python twice, as
a dict copy and again as the table's arrays. Here a chain of copies is a family: one dict
holds the edges of its newest copy (the only copy the build reads or sets), the edges of
the node first copied are its base, and each edge set on a copy is recorded. `place()`
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

    def place(self, row_start: np.ndarray, ids_out: np.ndarray, targets_out: np.ndarray) -> None:
        """Write every copy's edges into a table's `ids_out` and `targets_out`, where state
        s has its edges from `row_start[s]` on. Call it once `lengths()` are within
        `LIMITS` (every added id then has its rank)."""
        n = self._numbering()
        if not len(n.states):
            return
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
        # Per record its id's first record, whose rank is the id's rank when added; that
        # record may hold no copy (a base edge set again at the family's first copy), so
        # each id's rows start at the first of its records that hold any.
        first_of_id = np.concatenate([[True], ~same_next[:-1]])
        owner = np.flatnonzero(first_of_id)[np.cumsum(first_of_id) - 1]
        id_rank = added_rank[owner]
        keep = count > 0
        owner = owner[keep]
        records = _Records(
            ids=ids[keep].astype(np.int32),
            at=at[keep],
            targets=targets[keep].astype(np.int32),
            count=count[keep],
            id_start=np.concatenate([[True], owner[1:] != owner[:-1]]),
            id_rank=id_rank[keep],
        )
        # The copy at which each id was added (the rank counts the smaller ones since).
        added_at = np.full(len(n.states), np.iinfo(np.int32).max, dtype=np.int32)
        adds = n.set_rank >= 0
        added_at[n.set_copy[adds]] = n.set_ids[adds]
        # Rows (one per edge of a copy) go in blocks of whole ids: the copies of a node
        # with many ids have many rows, and buffers of a block's rows are reused where a
        # buffer of all rows would be fresh memory (a page fault per page) on each compile.
        begins = np.cumsum(records.count) - records.count  # each record's first row
        row_of = np.append(begins, begins[-1] + records.count[-1])  # and the end
        id_first = np.flatnonzero(records.id_start)
        marks = np.arange(0, row_of[-1], _BLOCK)  # each block's cut: the id holding a mark
        cut_ids = np.searchsorted(row_of[id_first], marks, side="right") - 1
        cuts = np.unique(np.append(id_first[cut_ids], len(begins)))
        buffers = _Buffers(int(np.diff(row_of[cuts]).max()))
        copy_start = row_start[n.states]
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            where, rank, edge_ids, edge_targets = buffers.rows(records, lo, hi)
            # An id's rank at a copy: its rank when added plus the smaller ids added at
            # its copies since (its own add is not smaller), a running count over the
            # id's rows (contiguous here) reset to its rank at its first row.
            np.take(added_at, where, out=rank)
            np.less(rank, edge_ids, out=rank)
            reset = (begins[lo:hi] - begins[lo])[records.id_start[lo:hi]]
            per_id = np.add.reduceat(rank, reset)  # the smaller ids over each id's rows
            start_rank = records.id_rank[lo:hi][records.id_start[lo:hi]]
            rank[reset] += np.diff(start_rank, prepend=0) - np.concatenate([[0], per_id[:-1]])
            np.cumsum(rank, out=rank)
            np.take(copy_start, where, out=where)
            where += rank
            ids_out[where] = edge_ids
            targets_out[where] = edge_targets

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


_BLOCK = 1 << 14  # rows laid out at a time (a block may hold more: it ends with an id)


@dataclass(frozen=True)
class _Records:
    """Runs of rows: record r gives `count[r]` copies from `at[r]` on the edge `ids[r]` ->
    `targets[r]`; `id_start[r]` where a new id starts (its rank when added: `id_rank`)."""

    ids: np.ndarray
    at: np.ndarray
    targets: np.ndarray
    count: np.ndarray
    id_start: np.ndarray
    id_rank: np.ndarray


class _Buffers:
    """The rows of a block of records, in buffers reused from block to block."""

    def __init__(self, size: int) -> None:
        self.where = np.empty(size, dtype=np.intp)
        self.rank = np.empty(size, dtype=np.int32)
        self.record = np.empty(size, dtype=np.intp)
        self.ids = np.empty(size, dtype=np.int32)
        self.targets = np.empty(size, dtype=np.int32)

    def rows(self, records: _Records, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """Records lo..hi-1 as rows: each row's copy, a rank buffer, its id and target."""
        count = records.count[lo:hi]
        begins = np.cumsum(count) - count
        size = int(begins[-1] + count[-1])
        where, record = self.where[:size], self.record[:size]
        # Running sums of 1s that jump where a record starts: each row's copy and record.
        at = records.at[lo:hi]
        where.fill(1)
        where[0] = at[0]
        where[begins[1:]] = at[1:] - (at[:-1] + count[:-1] - 1)
        np.cumsum(where, out=where)
        record.fill(0)
        record[begins[1:]] = 1
        np.cumsum(record, out=record)
        ids, targets = self.ids[:size], self.targets[:size]
        np.take(records.ids[lo:hi], record, out=ids)
        np.take(records.targets[lo:hi], record, out=targets)
        return where, self.rank[:size], ids, targets


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
