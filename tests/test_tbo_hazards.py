"""The split veto for prefix-cache readers of blocks written in the same step."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_plugin.tbo.hazards import reads_blocks_written_now


def brute_force(computed, lens, table, block_size) -> bool:
    """Token by token: a reader's whole cached blocks against every block a new token lands in."""
    written = {
        table[i][p // block_size]
        for i in range(len(lens))
        for p in range(computed[i], computed[i] + lens[i])
    }
    return any(
        table[r][b] in written
        for r in range(len(lens))
        if lens[r] > 1 and computed[r] > 0
        for b in range(computed[r] // block_size)
    )


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    n = draw(st.integers(1, 6))
    computed = [draw(st.integers(0, 40)) for _ in range(n)]
    lens = [draw(st.integers(1, 20)) for _ in range(n)]
    width = max((c + q + block_size - 1) // block_size for c, q in zip(computed, lens, strict=True))
    pool = draw(st.integers(1, 3 * width * n))  # small pools make requests share blocks
    table = [[draw(st.integers(0, pool - 1)) for _ in range(width)] for _ in range(n)]
    return computed, lens, table, block_size


@settings(max_examples=300, deadline=None)
@given(batches())
def test_matches_the_token_by_token_rule(batch):
    computed, lens, table, block_size = batch
    got = reads_blocks_written_now(
        np.array(computed), np.array(lens), [(np.array(table), block_size)]
    )
    assert got == brute_force(computed, lens, table, block_size)


def test_a_hit_on_a_block_written_now_is_found_and_decodes_never_are():
    table = np.array([[7, 8, 9], [7, 8, 3]])
    # request 1 hit request 0's blocks 7 and 8 (64 tokens) while request 0 computes them
    assert reads_blocks_written_now(np.array([0, 64]), np.array([70, 6]), [(table, 32)])
    # the same cached blocks read by a decode: written in an earlier step
    assert not reads_blocks_written_now(np.array([0, 64]), np.array([70, 1]), [(table, 32)])
    # no request computes them now
    assert not reads_blocks_written_now(np.array([80, 64]), np.array([1, 6]), [(table, 32)])
