"""The MLA decode's per-step token plan (`mla_token_plan`): which request each query token
belongs to and how many cached keys it sees, against the definition token by token."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mla.plan import mla_token_plan


def _meta(rows: list[tuple[int, int]]) -> PagedAttentionMetadata:
    """rows: (query tokens, seq_len) per request; seq_len 0 is an inert padding row."""
    q_lens = [q for q, _ in rows]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = len(rows)
    return PagedAttentionMetadata(
        num_reqs=n,
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(q_lens),
        max_seq_len=max(s for _, s in rows),
        num_decodes=n if max(q_lens) <= 1 else 0,
        num_decode_tokens=int(qsl[-1]) if max(q_lens) <= 1 else 0,
        query_start_loc=qsl,
        seq_lens=torch.tensor([s for _, s in rows], dtype=torch.int32),
        block_table=torch.zeros(n, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
    )


def _definition(rows, num_tokens):
    """Token j of a request with q query tokens and s cached keys sees s - q + j + 1 of
    them (causal); tokens past the requests and inert rows see none."""
    req, kv = [], []
    for r, (q, s) in enumerate(rows):
        for j in range(q):
            req.append(r)
            kv.append(max(0, s - q + j + 1) if s > 0 else 0)
    pad = num_tokens - len(req)
    return req + [-1] * pad, kv + [0] * pad


_row = st.integers(1, 4).flatmap(
    lambda q: st.tuples(st.just(q), st.one_of(st.just(0), st.integers(q, 300)))
)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(_row, min_size=1, max_size=9), pad_tokens=st.integers(0, 3))
def test_token_plan_matches_the_definition(rows, pad_tokens):
    num_tokens = sum(q for q, _ in rows) + pad_tokens
    req, kv_len = mla_token_plan(_meta(rows), num_tokens)
    assert (req.dtype, kv_len.dtype) == (torch.int32, torch.int32)
    assert (req.tolist(), kv_len.tolist()) == _definition(rows, num_tokens)


@settings(max_examples=100, deadline=None)
@given(seq_lens=st.lists(st.one_of(st.just(0), st.integers(1, 5000)), min_size=1, max_size=64))
def test_uniform_decode_step_matches_the_definition(seq_lens):
    rows = [(1, s) for s in seq_lens]
    req, kv_len = mla_token_plan(_meta(rows), len(rows))
    assert (req.tolist(), kv_len.tolist()) == _definition(rows, len(rows))


def _ops(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.cpu_parent is None]


def test_uniform_decode_step_takes_the_short_path():
    """A decode step of single-token requests (every step of a decode-only batch) plans
    with an arange and the step's seq_lens, not the general search: each op is a kernel
    launch with its host cost, on every step."""
    uniform = _meta([(1, 40), (1, 0), (1, 7)])
    mixed = _meta([(1, 40), (2, 9)])
    short = _ops(lambda: mla_token_plan(uniform, 3))
    general = _ops(lambda: mla_token_plan(mixed, 3))
    assert "aten::searchsorted" in general and "aten::searchsorted" not in short
    assert len(short) <= 4 < len(general), (short, general)
