"""Steps that must not split: a request reading blocks that this step is still writing.

With prefix caching a request can be admitted on a hit against blocks that
another request of the same step computes now. Run whole, the step writes every
KV slot before any attention reads it; cut in two, a reader in micro-batch 0
would attend over blocks that micro-batch 1 has not written yet. A rank that
sees such a step marks its `BatchShape` unsplittable, and then no rank splits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def reads_blocks_written_now(
    num_computed: np.ndarray,
    query_lens: np.ndarray,
    block_tables: Sequence[tuple[np.ndarray, int]],
) -> bool:
    """Whether a request with cached context reads a whole block written in this step.

    `num_computed[i]` and `query_lens[i]` are request i's cached and new tokens;
    `block_tables` holds, per KV-cache group, its block table rows (one per
    request) and block size. A decode (one new token) only reads what earlier
    steps wrote; a request's partly filled last block is private to it.
    """
    computed = np.asarray(num_computed, dtype=np.int64)
    lens = np.asarray(query_lens, dtype=np.int64)
    readers = np.flatnonzero((lens > 1) & (computed > 0))
    if readers.size == 0:
        return False
    for table, block_size in block_tables:
        columns = np.arange(table.shape[1])
        first = computed // block_size
        stop = (computed + lens + block_size - 1) // block_size
        writes = (columns >= first[:, None]) & (columns < stop[:, None])
        whole = columns < (computed[readers] // block_size)[:, None]
        if np.isin(table[readers][whole], table[: len(lens)][writes]).any():
            return True
    return False
