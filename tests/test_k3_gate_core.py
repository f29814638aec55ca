"""The processors' shared core (no vLLM): shared channels, launches, device advance, retiring.

On CPU it runs with the torch reference and with the Triton kernels under
TRITON_INTERPRET=1; with CUDA the same tests run compiled on the GPU.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_plugin.k3.processor_core import MAX_IDLE_CHANNELS, ChannelCore
from atom_plugin.k3.required_channel import (
    START,
    UNCONSTRAINED,
    RequiredChannel,
)

VOCAB = 64
AFTER, HEAD, TAIL, EOS = [10, 11, 12], [13, 14, 12], [13, 15, 16], 20
CHANNEL = RequiredChannel(AFTER, HEAD + TAIL, len(HEAD), {EOS})
OTHER = CHANNEL.ending_on([21, 22])
# Named choices: the call opening goes on with a name's ids and the closing quote (17).
NAMED = CHANNEL.extended([18, 17])
NAMED_LONGER = CHANNEL.extended([18, 19, 17])  # shares NAMED's first name id

CASES = [("cpu", "torch"), ("cpu", "triton")]
if torch.cuda.is_available():
    CASES = [pytest.param("cuda", "triton", marks=pytest.mark.gpu)]


def logits_for(rows, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen)
    logits[:, 3] = float("nan")
    logits[:, 4] = float("-inf")
    return logits.to(device)


def expect_row(after, before, channel, state):
    """`after` is `before` under the channel at `state`: only the forced id left, or the
    ids outside the call's allowed set (masked states) or the banned ids set to -inf."""
    if state != UNCONSTRAINED and channel.forced_token(state) is not None:
        forced = channel.forced_token(state)
        assert torch.isfinite(after[forced])
        assert torch.all(torch.cat([after[:forced], after[forced + 1 :]]) == float("-inf"))
        return
    expect = before.clone()
    if state != UNCONSTRAINED and channel.is_masked(state):
        allowed = channel.calls.allowed_ids(channel.call_state(state), len(after))
        allowed = [t for t in allowed if t not in channel.end_ids]
        expect = torch.full_like(before, float("-inf"))
        expect[allowed] = before[allowed]
    elif state != UNCONSTRAINED:
        expect[sorted(channel.banned_tokens(state))] = float("-inf")
    assert torch.equal(after.view(torch.int32), expect.view(torch.int32))


@pytest.mark.parametrize("device,impl", CASES)
def test_mixed_channels_take_one_launch_and_leave_plain_rows_alone(device, impl):
    core = ChannelCore(8, device, impl)
    rows = {
        0: (CHANNEL, START),
        1: (OTHER, CHANNEL.walk(AFTER[:2])),
        5: (OTHER, CHANNEL.walk(AFTER)),  # forced, other stop ids
        3: (NAMED, NAMED.walk(AFTER + HEAD + TAIL)),  # forcing the name
        6: (NAMED_LONGER, NAMED_LONGER.walk(AFTER + HEAD + TAIL + [18])),
        7: (NAMED, START),
    }
    for slot, (channel, state) in rows.items():
        core.assign(slot, channel, state)
    core.flush()
    assert core.num_channels == 4
    assert NAMED.forced_token(rows[3][1]) == 18 and NAMED_LONGER.forced_token(rows[6][1]) == 19
    before = logits_for(8, device)
    after = before.clone()
    launches = core.apply(after, np.arange(8))
    assert launches == 1
    for slot, (channel, state) in rows.items():
        expect_row(after[slot].cpu(), before[slot].cpu(), channel, state)
        assert core.states_of([slot]) == [state]
    for row in (2, 4):
        assert torch.equal(after[row].view(torch.int32), before[row].view(torch.int32))


@pytest.mark.parametrize("device,impl", CASES)
def test_step_without_live_rows_launches_nothing(device, impl):
    core = ChannelCore(8, device, impl)
    before = logits_for(4, device)
    after = before.clone()
    assert core.apply(after, np.arange(4)) == 0
    core.assign(6, CHANNEL, START)
    core.flush()
    assert core.apply(after, np.arange(4)) == 0  # slot 6 is not in this step
    assert torch.equal(after.view(torch.int32), before.view(torch.int32))
    core.assign(6, None)
    core.flush()
    assert not core.is_live([6]) and core.states_of([6]) == [UNCONSTRAINED]


@pytest.mark.parametrize("device,impl", CASES)
def test_moving_a_slot_between_channels_clears_the_old_state(device, impl):
    core = ChannelCore(4, device, impl)
    core.assign(2, CHANNEL, CHANNEL.walk(AFTER))
    core.flush()
    core.assign(2, OTHER, START)
    core.flush()
    before = logits_for(4, device)
    after = before.clone()
    assert core.apply(after, np.arange(4)) == 1
    expect_row(after[2].cpu(), before[2].cpu(), OTHER, START)


TOKENS = st.lists(st.sampled_from([*AFTER, *HEAD, *TAIL, 1, 2]), max_size=12)


@settings(max_examples=25, deadline=None)
@given(outputs=st.lists(TOKENS, min_size=1, max_size=3), data=st.data())
@pytest.mark.parametrize("device,impl", CASES)
def test_advance_folds_committed_tokens_like_the_state_machine(device, impl, outputs, data):
    core = ChannelCore(4, device, impl)
    prompt = [10, 11, 12]  # an earlier turn's trigger: must not count
    width = len(prompt) + 24
    token_ids = torch.zeros(4, width, dtype=torch.int32)
    total = torch.zeros(4, dtype=torch.int32)
    for slot, _ in enumerate(outputs):
        core.assign(slot, CHANNEL, START, scanned=len(prompt))
        token_ids[slot, : len(prompt)] = torch.tensor(prompt)
        total[slot] = len(prompt)
    core.flush()
    done = [0] * len(outputs)
    slots = np.arange(len(outputs))
    for _ in range(3):  # a few steps, each committing some more tokens
        for slot, out in enumerate(outputs):
            more = data.draw(st.integers(0, len(out) - done[slot]))
            new = out[done[slot] : done[slot] + more]
            start = len(prompt) + done[slot]
            token_ids[slot, start : start + len(new)] = torch.tensor(new, dtype=torch.int32)
            done[slot] += more
            total[slot] = len(prompt) + done[slot]
        core.advance(token_ids.to(device), total.to(device), slots)
        want = [CHANNEL.walk(out[: done[s]]) for s, out in enumerate(outputs)]
        got = [
            UNCONSTRAINED if core.channel_of(s) is None else core.states_of([s])[0]
            for s in range(len(outputs))
        ]
        assert got == want


@pytest.mark.parametrize("device,impl", CASES)
def test_snapshot_retires_open_slots_but_not_reused_ones(device, impl):
    core = ChannelCore(4, device, impl)
    opened = CHANNEL.walk(AFTER + HEAD + TAIL)
    assert opened == UNCONSTRAINED
    token_ids = torch.zeros(4, 16, dtype=torch.int32)
    token_ids[0, : len(AFTER + HEAD + TAIL)] = torch.tensor(AFTER + HEAD + TAIL)
    token_ids[1, : len(AFTER + HEAD + TAIL)] = torch.tensor(AFTER + HEAD + TAIL)
    total = torch.tensor([9, 9, 0, 0], dtype=torch.int32)
    core.assign(0, CHANNEL, START)
    core.assign(1, CHANNEL, START)
    core.flush()
    core.advance(token_ids.to(device), total.to(device), np.array([0, 1]))
    core.snapshot()
    core.assign(1, CHANNEL, START)  # slot 1 reused by a new request after the snapshot
    core.flush()
    if device == "cuda":
        torch.cuda.synchronize()
    core.retire_finished()
    assert not core.is_live([0])
    assert core.is_live([1]) and core.states_of([1]) == [START]


@pytest.mark.parametrize("device,impl", CASES)
def test_idle_channels_are_dropped_and_live_states_renumbered(device, impl):
    core = ChannelCore(4, device, impl)
    # Slot 1 keeps a named channel half way through its forced opening all along.
    kept = NAMED_LONGER.ending_on([40])
    kept_state = kept.walk(AFTER + [13, 14])
    core.assign(0, CHANNEL.ending_on([29]), START)  # numbered before `kept`, soon idle
    core.assign(1, kept, kept_state)
    core.flush()
    numbered = int(core.states[1])
    channels = [CHANNEL.ending_on([30 + i]).extended([18 + i % 2, 17]) for i in range(20)]
    for channel in channels:
        core.assign(0, channel, START)
        core.flush()
    assert core.num_channels <= MAX_IDLE_CHANNELS + 2  # idle ones go beyond MAX_IDLE_CHANNELS
    assert core.states_of([1]) == [kept_state]
    assert int(core.states[1]) != numbered  # renumbered on the device
    core.assign(2, channels[0], START)  # dropped by now: registered again
    core.flush()
    before = logits_for(4, device)
    after = before.clone()
    assert core.apply(after, np.arange(4)) == 1
    expect_row(after[0].cpu(), before[0].cpu(), channels[-1], START)
    expect_row(after[1].cpu(), before[1].cpu(), kept, kept_state)
    expect_row(after[2].cpu(), before[2].cpu(), channels[0], START)
    assert after[2, 30 + 19].item() != float("-inf")  # slot 2 does not get slot 0's stop id
    # The renumbered state still advances through the rest of its opening.
    token_ids = torch.zeros(4, 8, dtype=torch.int32)
    total = torch.tensor([0, 4, 0, 0], dtype=torch.int32)
    core.assign(1, kept, kept_state, scanned=0)
    core.flush()
    core.advance(token_ids.to(device), total.to(device), np.array([1]))
    assert core.states_of([1]) == [kept.walk([0] * 4, kept_state)]


@pytest.mark.parametrize("device,impl", CASES)
def test_every_channel_idle_leaves_no_tables_and_no_launch(device, impl):
    core = ChannelCore(2, device, impl)
    core.assign(0, CHANNEL, START)
    core.flush()
    for i in range(MAX_IDLE_CHANNELS + 2):  # requests come and go within one step
        core.assign(0, CHANNEL.ending_on([30 + i]), START)
    core.assign(0, None)
    core.flush()  # no slot holds any of the 19 channels: all dropped
    assert core.num_channels == 0 and core.states_of([0, 1]) == [UNCONSTRAINED] * 2
    before = logits_for(2, device)
    after = before.clone()
    assert core.apply(after, np.arange(2)) == 0
    assert torch.equal(after.view(torch.int32), before.view(torch.int32))
    core.assign(1, NAMED, START)  # and back to work
    core.flush()
    assert core.apply(after, np.arange(2)) == 1
    expect_row(after[1].cpu(), before[1].cpu(), NAMED, START)
