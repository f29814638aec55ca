"""The channel logits kernel against its torch reference and the state machine.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors; with CUDA
the same tests run compiled, plus `gpu` tests at the K3 vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_plugin.k3 import START, UNCONSTRAINED, RequiredChannel
from atom_plugin.k3.channel_kernel import (
    advance_states,
    apply_channel_torch,
    apply_channel_triton,
    apply_required_channel,
    tiles_per_row,
)
from atom_plugin.k3.channel_tables import compile_channel, next_states

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPEN, CLOSE, SEP, EOM, RESPONSE, TOOLS, CALL, TOOL_ATTR, QUOTE, WORD, EOS = range(1, 12)
K3 = RequiredChannel(
    (CLOSE, RESPONSE, SEP), (OPEN, TOOLS, SEP, OPEN, CALL, TOOL_ATTR, QUOTE), 3, [EOM, EOS]
)
TABLES = compile_channel(K3, DEVICE)
FORCED = [s for s in range(K3.num_states) if K3.is_forced(s)]
WAITING = [s for s in range(K3.num_states) if K3.is_waiting(s)]
ALL_STATES = [UNCONSTRAINED, *range(K3.num_states)]


def logits_with_specials(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Random fp32 logits with -inf, +inf and NaN sprinkled in, also at channel ids."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    logits[0::3, OPEN] = float("-inf")
    logits[1::3, TOOLS] = float("nan")
    logits[2::3, 0] = float("inf")
    return logits.to(DEVICE)


def expected(logits: torch.Tensor, row_states: list[int]) -> torch.Tensor:
    """What the mask must produce, written from RequiredChannel row by row."""
    out = logits.clone()
    for r, state in enumerate(row_states):
        forced = K3.forced_token(state)
        if forced is not None:
            out[r] = float("-inf")
            out[r, forced] = 0.0
        else:
            for t in K3.banned_tokens(state):
                out[r, t] = float("-inf")
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(
    ("vocab", "block", "programs"), [(50, 16, 1), (300, 32, 64), (1000, 64, 7)]
)
def test_every_state_matches_the_machine(impl, vocab, block, programs):
    row_states = ALL_STATES * 2
    logits = logits_with_specials(len(row_states), vocab)
    want = expected(logits, row_states)
    states = torch.tensor(row_states, dtype=torch.int32, device=DEVICE)
    if impl == "triton":
        apply_channel_triton(logits, TABLES, states, block=block, programs=programs)
    else:
        apply_channel_torch(logits, TABLES, states)
    assert same_bits(logits, want)


def test_forced_row_is_split_over_several_programs():
    assert tiles_per_row(1, 1000, block=64, programs=7) == 7
    assert tiles_per_row(1, 1000, block=64, programs=1024) == 16
    assert tiles_per_row(256, 163840) == 4
    logits = logits_with_specials(1, 1000)
    states = torch.tensor([FORCED[2]], dtype=torch.int32, device=DEVICE)
    apply_channel_triton(logits, TABLES, states, block=64, programs=7)
    assert same_bits(logits, expected(logits_with_specials(1, 1000), [FORCED[2]]))


def test_forced_id_given_minus_inf_becomes_finite():
    logits = torch.full((1, 64), float("-inf"), device=DEVICE)
    states = torch.tensor([FORCED[0]], dtype=torch.int32, device=DEVICE)  # forces OPEN
    apply_channel_triton(logits, TABLES, states, block=16, programs=4)
    assert logits[0, OPEN].item() == 0.0
    assert torch.isneginf(logits[0, torch.arange(64, device=DEVICE) != OPEN]).all()


def test_unconstrained_rows_are_untouched_bit_for_bit():
    logits = logits_with_specials(5, 200)
    logits.view(torch.int32)[:, 7] = 0x7FC01234  # a NaN with a payload
    before = logits.clone()
    states = torch.full((5,), UNCONSTRAINED, dtype=torch.int32, device=DEVICE)
    apply_channel_triton(logits, TABLES, states, block=32, programs=16)
    assert same_bits(logits, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_reference(dtype):
    row_states = ALL_STATES
    logits = logits_with_specials(len(row_states), 130).to(dtype)
    ref = logits.clone()
    states = torch.tensor(row_states, dtype=torch.int32, device=DEVICE)
    apply_channel_triton(logits, TABLES, states, block=32, programs=16)
    apply_channel_torch(ref, TABLES, states)
    assert torch.equal(logits.view(torch.int16), ref.view(torch.int16))


def test_row_slot_mapping_and_strided_rows():
    slot_states = torch.tensor([FORCED[1], UNCONSTRAINED, WAITING[0], FORCED[6]], device=DEVICE)
    slot_states = slot_states.to(torch.int32)
    row_slot = torch.tensor([3, 0, 2, 1, 2], dtype=torch.int32, device=DEVICE)
    wide = logits_with_specials(5, 160)
    logits, ref = wide[:, :100], wide.clone()[:, :100]  # row stride 160, 100 columns
    apply_channel_triton(logits, TABLES, slot_states, row_slot, block=16, programs=20)
    apply_channel_torch(ref, TABLES, slot_states, row_slot)
    assert same_bits(logits, ref)
    assert same_bits(
        logits,
        expected(
            logits_with_specials(5, 160)[:, :100],
            [FORCED[6], FORCED[1], WAITING[0], UNCONSTRAINED, WAITING[0]],
        ),
    )
    assert same_bits(wide[:, 100:], logits_with_specials(5, 160)[:, 100:])


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from(ALL_STATES), min_size=1, max_size=12),
    st.integers(12, 400),
    st.sampled_from([16, 32, 128]),
    st.integers(1, 64),
)
def test_random_batches_match_reference(row_states, vocab, block, programs):
    logits = logits_with_specials(len(row_states), vocab, seed=vocab)
    ref = logits.clone()
    states = torch.tensor(row_states, dtype=torch.int32, device=DEVICE)
    apply_channel_triton(logits, TABLES, states, block=block, programs=programs)
    apply_channel_torch(ref, TABLES, states)
    assert same_bits(logits, ref)


def test_launcher_launches_nothing_without_a_live_row():
    logits = logits_with_specials(2, 64)
    before = logits.clone()
    states = torch.tensor([FORCED[0], WAITING[0]], dtype=torch.int32, device=DEVICE)
    assert apply_required_channel(logits, TABLES, states, live=False) is False
    assert same_bits(logits, before)
    assert apply_required_channel(logits, TABLES, states, live=True, impl="triton") is True
    assert same_bits(logits, expected(before, [FORCED[0], WAITING[0]]))


def test_bad_arguments_are_refused():
    logits = logits_with_specials(1, 8)  # narrower than the channel's ids
    states = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="8 columns but the channel uses ids up to 11"):
        apply_channel_triton(logits, TABLES, states)
    with pytest.raises(ValueError, match="impl 'cuda' is not one of triton, torch"):
        apply_required_channel(logits, TABLES, states, live=True, impl="cuda")
    with pytest.raises(ValueError, match="both row_pos and row_tokens"):
        apply_channel_torch(logits_with_specials(1, 64), TABLES, states, row_pos=states)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(ALL_STATES), min_size=1, max_size=20), st.data())
def test_next_states_matches_step(row_states, data):
    tokens = data.draw(
        st.lists(st.integers(0, 12), min_size=len(row_states), max_size=len(row_states))
    )
    got = next_states(
        TABLES,
        torch.tensor(row_states, dtype=torch.int32, device=DEVICE),
        torch.tensor(tokens, device=DEVICE),
    )
    assert got.tolist() == [K3.step(s, t) for s, t in zip(row_states, tokens, strict=True)]


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_advance_folds_committed_output_only(impl):
    # Slot 0: the prompt's earlier turn holds the trigger; its output then triggers.
    # Slot 1: not in this step. Slot 2: already unconstrained.
    prompt = [CLOSE, RESPONSE, SEP, WORD]
    history = torch.zeros(3, 16, dtype=torch.int32)
    history[0, :4] = torch.tensor(prompt)
    history[0, 4:8] = torch.tensor([WORD, CLOSE, RESPONSE, SEP])
    history[2, :6] = WORD
    token_ids = history.to(DEVICE)
    states = torch.tensor([START, WAITING[1], UNCONSTRAINED], dtype=torch.int32, device=DEVICE)
    scanned = torch.tensor([4, 0, 1], dtype=torch.int32, device=DEVICE)
    total_len = torch.tensor([6, 3, 6], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    advance_states(TABLES, states, scanned, token_ids, total_len, slots, impl=impl)
    assert states.tolist() == [K3.walk([WORD, CLOSE]), WAITING[1], UNCONSTRAINED]
    assert scanned.tolist() == [6, 0, 6]
    total_len[0] = 8
    advance_states(TABLES, states, scanned, token_ids, total_len, slots, impl=impl)
    assert states.tolist() == [FORCED[0], WAITING[1], UNCONSTRAINED]
    assert scanned.tolist() == [8, 0, 6]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), max_size=12), min_size=1, max_size=6), st.data())
def test_advance_triton_matches_walk(outputs, data):
    cut = [data.draw(st.integers(0, len(o))) for o in outputs]
    history = torch.zeros(len(outputs), 13, dtype=torch.int32)
    for i, out in enumerate(outputs):
        history[i, 1 : 1 + len(out)] = torch.tensor(out, dtype=torch.int32)
    token_ids = history.to(DEVICE)
    states = torch.full((len(outputs),), START, dtype=torch.int32, device=DEVICE)
    scanned = torch.ones(len(outputs), dtype=torch.int32, device=DEVICE)  # a 1-token prompt
    slots = torch.arange(len(outputs), dtype=torch.int32, device=DEVICE)
    for lengths in (cut, [len(o) for o in outputs]):
        total_len = torch.tensor([1 + n for n in lengths], dtype=torch.int32, device=DEVICE)
        advance_states(TABLES, states, scanned, token_ids, total_len, slots)
    assert states.tolist() == [K3.walk(o) for o in outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_k3_vocabulary_on_gpu(batch):
    vocab = 163_840
    row_states = [ALL_STATES[i % len(ALL_STATES)] for i in range(batch)]
    logits = logits_with_specials(batch, vocab, seed=batch)
    ref = logits.clone()
    states = torch.tensor(row_states, dtype=torch.int32, device=DEVICE)
    apply_channel_triton(logits, TABLES, states)
    apply_channel_torch(ref, TABLES, states)
    assert same_bits(logits, ref)
    assert same_bits(logits, expected(logits_with_specials(batch, vocab, seed=batch), row_states))


# ---- several channels in one launch: required, named (any name), other stop ids ----
NAME_A, NAME_B, NAME_C, STOP = 12, 13, 14, 15
MIXED = (
    K3,
    K3.extended([NAME_A, QUOTE]),  # a one-id name
    K3.extended([NAME_A, NAME_B, NAME_C, QUOTE]),  # a longer name with the same first id
    K3.extended([CLOSE, RESPONSE, SEP, TOOLS, QUOTE]),  # a name whose ids are the channel's own
    K3.ending_on([STOP]).extended([NAME_B, QUOTE]),  # another request's stop id
)


def mixed_tables():
    from atom_plugin.k3.channel_tables import compile_channels

    return compile_channels(MIXED, DEVICE)


def mixed_expected(logits: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """Per row (channel index, local state): the mask written from RequiredChannel."""
    out = logits.clone()
    for r, (c, state) in enumerate(rows):
        channel = MIXED[c]
        forced = None if state == UNCONSTRAINED else channel.forced_token(state)
        if forced is not None:
            out[r] = float("-inf")
            out[r, forced] = 0.0
        elif state != UNCONSTRAINED:
            for t in channel.banned_tokens(state):
                out[r, t] = float("-inf")
    return out


def global_states(tables, rows: list[tuple[int, int]]) -> torch.Tensor:
    values = [s if s == UNCONSTRAINED else tables.bases[c] + s for c, s in rows]
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


MIXED_ROW = st.integers(0, len(MIXED) - 1).flatmap(
    lambda c: st.tuples(st.just(c), st.integers(UNCONSTRAINED, MIXED[c].num_states - 1))
)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(MIXED_ROW, min_size=1, max_size=12),
    st.integers(20, 300),
    st.sampled_from([16, 64]),
    st.integers(1, 32),
)
def test_mixed_channels_one_launch_match_reference_and_machine(rows, vocab, block, programs):
    tables = mixed_tables()
    logits = logits_with_specials(len(rows), vocab, seed=vocab)
    want = mixed_expected(logits, rows)
    ref = logits.clone()
    states = global_states(tables, rows)
    apply_channel_triton(logits, tables, states, block=block, programs=programs)
    apply_channel_torch(ref, tables, states)
    assert same_bits(logits, ref)
    assert same_bits(logits, want)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, len(MIXED) - 1), st.lists(st.integers(0, 16), max_size=12)),
        min_size=1,
        max_size=6,
    ),
    st.data(),
)
def test_mixed_channels_advance_and_spec_rows_follow_each_machine(requests, data):
    """Committed ids and then drafts: every row's state is its own channel's walk."""
    from atom_plugin.k3.spec_rows import spec_row_states_torch, spec_row_states_triton

    tables = mixed_tables()
    history = torch.zeros(len(requests), 13, dtype=torch.int32)
    for i, (_, out) in enumerate(requests):
        history[i, 1 : 1 + len(out)] = torch.tensor(out, dtype=torch.int32)
    states = torch.tensor([tables.bases[c] for c, _ in requests], dtype=torch.int32)
    states = states.to(DEVICE)
    scanned = torch.ones(len(requests), dtype=torch.int32, device=DEVICE)
    total_len = torch.tensor([1 + len(o) for _, o in requests], dtype=torch.int32, device=DEVICE)
    slots = torch.arange(len(requests), dtype=torch.int32, device=DEVICE)
    advance_states(tables, states, scanned, history.to(DEVICE), total_len, slots)
    walked = [MIXED[c].walk(out) for c, out in requests]
    rows = [(c, w) for (c, _), w in zip(requests, walked, strict=True)]
    assert states.tolist() == global_states(tables, rows).tolist()
    drafts = [data.draw(st.lists(st.integers(0, 16), max_size=4)) for _ in requests]
    row_slot, row_pos, row_tokens, want = [], [], [], []
    for slot, ((c, _), ds) in enumerate(zip(requests, drafts, strict=True)):
        for j in range(len(ds) + 1):
            row_slot.append(slot)
            row_pos.append(j)
            row_tokens.append(WORD if j == 0 else ds[j - 1])
            want.append((c, MIXED[c].walk(ds[:j], walked[slot])))

    def t(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    args = (states, t(row_slot), t(row_pos), t(row_tokens))
    expect_states = global_states(tables, want).tolist()
    assert spec_row_states_triton(tables, *args).tolist() == expect_states
    assert spec_row_states_torch(tables, *args, max_drafts=4).tolist() == expect_states
    logits = logits_with_specials(len(want), 64, seed=len(want))
    ref = logits.clone()
    apply_channel_triton(logits, tables, *args, block=16, programs=8)
    apply_channel_torch(ref, tables, *args, max_drafts=4)
    assert same_bits(logits, ref)
    assert same_bits(logits, mixed_expected(logits_with_specials(len(want), 64, len(want)), want))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [7, 256])
def test_mixed_channels_at_k3_vocabulary_on_gpu(batch):
    vocab = 163_840
    tables = mixed_tables()
    choices = [(c, s) for c in range(len(MIXED)) for s in range(-1, MIXED[c].num_states)]
    rows = [choices[(7 * i) % len(choices)] for i in range(batch)]
    logits = logits_with_specials(batch, vocab, seed=batch)
    ref = logits.clone()
    states = global_states(tables, rows)
    apply_channel_triton(logits, tables, states)
    apply_channel_torch(ref, tables, states)
    assert same_bits(logits, ref)
    assert same_bits(logits, mixed_expected(logits_with_specials(batch, vocab, seed=batch), rows))
