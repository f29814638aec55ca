"""An LRU map bounded in entries and in bytes, so that no client can grow it without limit."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

MISSING = object()


class BoundedCache:
    """At most `max_entries` values and `max_bytes` bytes (each value's size as `put` says);
    the least recently used go first. A value larger than `max_bytes` is not kept."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries <= 0 or max_bytes <= 0:
            raise ValueError(
                f"a bounded cache needs positive limits, got max_entries={max_entries}, "
                f"max_bytes={max_bytes}"
            )
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> Any:
        """The value, or MISSING."""
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return MISSING
        self._items.move_to_end(key)
        self.hits += 1
        return item[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        if nbytes > self.max_bytes:
            return
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self.nbytes -= size
            self.evictions += 1
