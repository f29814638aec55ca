"""Speculative verification rows: each row's state as if the drafts before it were accepted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_plugin.k3 import START, UNCONSTRAINED, RequiredChannel
from atom_plugin.k3.channel_kernel import apply_channel_torch, apply_channel_triton
from atom_plugin.k3.channel_tables import compile_channel
from atom_plugin.k3.spec_rows import (
    spec_row_states_torch,
    spec_row_states_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPEN, CLOSE, SEP, EOM, RESPONSE, TOOLS, CALL, TOOL_ATTR, QUOTE, WORD, EOS = range(1, 12)
OPENING = (OPEN, TOOLS, SEP, OPEN, CALL, TOOL_ATTR, QUOTE)
K3 = RequiredChannel((CLOSE, RESPONSE, SEP), OPENING, 3, [EOM, EOS])
TABLES = compile_channel(K3, DEVICE)
ALL_STATES = [UNCONSTRAINED, *range(K3.num_states)]


def layout(slot_drafts: list[tuple[int, list[int]]]):
    """MRV2-style rows: per request (slot, drafts), rows 0..k with the drafts at positions 1..k."""
    row_slot, row_pos, row_tokens = [], [], []
    for slot, drafts in slot_drafts:
        for j in range(len(drafts) + 1):
            row_slot.append(slot)
            row_pos.append(j)
            row_tokens.append(WORD if j == 0 else drafts[j - 1])  # position 0: last committed id

    def t(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    return t(row_slot), t(row_pos), t(row_tokens)


def loop_states(slot_states: list[int], slot_drafts: list[tuple[int, list[int]]]) -> list[int]:
    """The python loop the device versions must agree with."""
    out = []
    for slot, drafts in slot_drafts:
        state = slot_states[slot]
        out.append(state)
        for draft in drafts:
            state = K3.step(state, draft)
            out.append(state)
    return out


def both(slot_states, slot_drafts, max_drafts=7):
    states = torch.tensor(slot_states, dtype=torch.int32, device=DEVICE)
    args = (TABLES, states, *layout(slot_drafts))
    return (
        spec_row_states_torch(*args, max_drafts).tolist(),
        spec_row_states_triton(*args).tolist(),
    )


def test_drafts_that_follow_the_channel():
    waiting_after_close = K3.walk([CLOSE])
    drafts = [RESPONSE, SEP, OPEN, TOOLS, SEP, OPEN, CALL]
    got_torch, got_triton = both([waiting_after_close], [(0, drafts)])
    want = loop_states([waiting_after_close], [(0, drafts)])
    assert got_torch == got_triton == want
    forced = [K3.forced_token(s) for s in want]
    assert forced == [None, None, OPEN, TOOLS, SEP, OPEN, CALL, TOOL_ATTR]


def test_drafts_that_break_the_channel_still_advance_later_rows():
    # Forced to OPEN but the drafter proposes EOM: row 1 is built as if EOM were
    # accepted (the sampler rejects it since its logit is -inf in row 0).
    forced_open = K3.walk([CLOSE, RESPONSE, SEP])
    drafts = [EOM, WORD, WORD]
    got_torch, got_triton = both([forced_open], [(0, drafts)])
    assert got_torch == got_triton == loop_states([forced_open], [(0, drafts)])
    assert [K3.forced_token(s) for s in got_torch] == [OPEN, TOOLS, SEP, OPEN]


def test_bonus_row_comes_after_every_draft_and_requests_are_independent():
    slot_states = [START, K3.walk([CLOSE, RESPONSE]), UNCONSTRAINED]
    slot_drafts = [(1, [SEP, OPEN]), (0, []), (2, [EOM, EOM, EOM]), (1, [WORD])]
    got_torch, got_triton = both(slot_states, slot_drafts)
    want = loop_states(slot_states, slot_drafts)
    assert got_torch == got_triton == want
    assert K3.forced_token(want[2]) == TOOLS  # request 0's bonus row, after SEP and OPEN


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from(ALL_STATES), min_size=1, max_size=4),
    st.data(),
)
def test_random_drafts_match_the_python_loop(slot_states, data):
    token = st.sampled_from([OPEN, CLOSE, SEP, EOM, RESPONSE, TOOLS, CALL, WORD])
    slot_drafts = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(slot_states) - 1), st.lists(token, max_size=7)),
            min_size=1,
            max_size=5,
        )
    )
    got_torch, got_triton = both(slot_states, slot_drafts)
    assert got_torch == got_triton == loop_states(slot_states, slot_drafts)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_verify_step_logits_use_the_row_states(impl):
    slot_states = [K3.walk([CLOSE, RESPONSE, SEP]), START]
    slot_drafts = [(0, [OPEN, TOOLS, EOM, OPEN]), (1, [CLOSE, RESPONSE, SEP])]
    rows = loop_states(slot_states, slot_drafts)
    states = torch.tensor(slot_states, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(rows), 96, generator=gen).to(DEVICE)
    flat = logits.clone()
    if impl == "triton":
        apply_channel_triton(logits, TABLES, states, *layout(slot_drafts), block=16, programs=40)
    else:
        apply_channel_torch(logits, TABLES, states, *layout(slot_drafts), max_drafts=4)
    apply_channel_torch(flat, TABLES, torch.tensor(rows, dtype=torch.int32, device=DEVICE))
    assert torch.equal(logits.view(torch.int32), flat.view(torch.int32))
    forced_rows = [K3.forced_token(s) for s in rows]
    assert forced_rows[:5] == [OPEN, TOOLS, SEP, OPEN, CALL]
    assert forced_rows[5:] == [None, None, None, OPEN]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_k3_vocabulary_verify_step_on_gpu(batch):
    vocab = 163_840
    forced_open = K3.walk([CLOSE, RESPONSE, SEP])
    slot_states = [forced_open if i % 2 == 0 else START for i in range(batch)]
    slot_drafts = [(i, list(OPENING)) for i in range(batch)]
    rows = loop_states(slot_states, slot_drafts)
    states = torch.tensor(slot_states, dtype=torch.int32, device=DEVICE)
    logits = torch.randn(len(rows), vocab, device=DEVICE)
    ref, flat = logits.clone(), logits.clone()
    apply_channel_triton(logits, TABLES, states, *layout(slot_drafts))
    apply_channel_torch(ref, TABLES, states, *layout(slot_drafts), max_drafts=7)
    apply_channel_torch(flat, TABLES, torch.tensor(rows, dtype=torch.int32, device=DEVICE))
    assert torch.equal(logits.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(logits.view(torch.int32), flat.view(torch.int32))
