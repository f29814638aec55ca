"""Each distinct tool set's call table, compiled once where requests come in (the API server).

`CallCache(tokenizer, classes)` turns a request's tools (with the named tool and
`parallel_tool_calls`) into the wire form of their `CallTable`: the schemas'
call spec (schema.py), then the automaton (call_automaton.py), bounded by
`call_table.LIMITS`. A tool set is keyed by a digest of its function names and
parameters in their order, so the same tools compile once; the result, or the
reason they cannot be enforced, is kept in an LRU bounded in entries and bytes
(`BoundedCache`), so no client can grow it without limit. The engine then only
lays out the finished rows.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from atom_plugin.k3.bounded_cache import MISSING, BoundedCache
from atom_plugin.k3.call_automaton import compile_calls
from atom_plugin.k3.call_table import CallSpecError
from atom_plugin.k3.schema import call_spec_for, function_tools
from atom_plugin.k3.token_classes import TokenClasses

MAX_ENTRIES = 256
MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class CompiledCalls:
    """A tool set's call table on the wire (`CallTable.to_wire()`), with what it cost."""

    wire: dict[str, Any]
    num_states: int
    seconds: float

    @property
    def nbytes(self) -> int:
        return len(self.wire["data"]) + 256


class CallCache:
    """Compiled call tables of one tokenizer's requests. `compiles` counts the tool sets
    compiled here (each once while cached); `stats()` gives the cache's other counters."""

    def __init__(
        self,
        tokenizer: Any,
        classes: TokenClasses,
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.classes = classes
        self._cache = BoundedCache(max_entries, max_bytes)

    @property
    def compiles(self) -> int:
        """Tool sets compiled here: every lookup that missed compiled one."""
        return self._cache.misses

    def calls_for(
        self, tools: Sequence[Any] | None, name: str | None, parallel: bool
    ) -> tuple[CompiledCalls | CallSpecError, bool]:
        """The request's compiled calls, or why they cannot be enforced (a CallSpecError,
        `UnsupportedSchema` or `CallsTooLarge` among them), and whether this call compiled."""
        try:
            key = tool_set_key(tools, name, parallel)
        except CallSpecError as err:  # not function tools: nothing worth keeping
            return err, False
        hit = self._cache.get(key)
        if hit is not MISSING:
            return hit, False
        start = time.perf_counter()
        try:
            spec = call_spec_for(self.tokenizer, tools, name, parallel)
            table = compile_calls(spec, self.classes)
            result: CompiledCalls | CallSpecError = CompiledCalls(
                table.to_wire(), table.num_states, time.perf_counter() - start
            )
            size = result.nbytes
        except CallSpecError as err:
            result, size = err, len(str(err)) + 256
        self._cache.put(key, result, size)
        return result, True

    def stats(self) -> dict[str, int]:
        cache = self._cache
        return {
            "hits": cache.hits,
            "entries": len(cache),
            "bytes": cache.nbytes,
            "evictions": cache.evictions,
        }


def tool_set_key(tools: Sequence[Any] | None, name: str | None, parallel: bool) -> str:
    """A digest of the function tools' names and parameters (in their order: the order of
    properties is the order of keys), the named tool and `parallel`."""
    functions = function_tools(tools)
    text = json.dumps(
        [name, bool(parallel), functions], ensure_ascii=False, separators=(",", ":"), default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()
