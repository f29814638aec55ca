"""Host objects made once for a KV cache and kept for the engine's life: a launch over a
cache that needs its TMA descriptors (or another fact of its layout) looks them up here
instead of building them at every layer call, where building costs more host time than
the launch itself. vLLM hands each step new views of the same memory, so a cache is known
by its address, shape, strides and dtype. An entry made of views of its cache (the
descriptors) holds that memory, so its address is never another tensor's; an entry that
only answers a question about the layout (a kernel's input check) holds nothing and is
right for any tensor the key matches."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")

# A few entries a layer (the descriptors, per box) for models of a few hundred attention
# layers; a model with more rebuilds some at each call.
KEPT_ENTRIES = 1024


def cache_key(cache: torch.Tensor) -> tuple:
    """What identifies a cache's memory and layout across the views vLLM hands each step."""
    return (cache.data_ptr(), tuple(cache.shape), cache.stride(), cache.dtype)


class KeptPerCache:
    """A bounded table of objects made once per cache (and whatever else the key holds);
    past `limit` entries the oldest is dropped (made again when next asked for)."""

    def __init__(self, limit: int = KEPT_ENTRIES) -> None:
        self.limit = limit
        self._table: dict[Hashable, object] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        kept = self._table.get(key)
        if kept is None:
            kept = make()
            if len(self._table) >= self.limit:
                self._table.pop(next(iter(self._table)), None)  # None: another thread took it
            self._table[key] = kept
        return kept

    def __len__(self) -> int:
        return len(self._table)
