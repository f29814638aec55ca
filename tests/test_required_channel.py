"""RequiredChannel against hand-written cases and a text-scanning reference."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from atom_plugin.parsers import START, UNCONSTRAINED, RequiredChannel

# Word-level ids that read like the K3 pieces.
OPEN, CLOSE, SEP, EOM = 1, 2, 3, 4
RESPONSE, TOOLS, CALL, TOOL_ATTR, QUOTE, MESSAGE, WORD, EOS, STOP = 5, 6, 7, 8, 9, 10, 11, 12, 13
AFTER = (CLOSE, RESPONSE, SEP)
OPENING = (OPEN, TOOLS, SEP, OPEN, CALL, TOOL_ATTR, QUOTE)
K3 = RequiredChannel(AFTER, OPENING, 3, [EOM, EOS])


def reference(channel: RequiredChannel, output: list[int]) -> tuple[int | None, frozenset[int]]:
    """(forced id, banned ids) for the next token, found by scanning the decoded output.

    Each id decodes to one character; the earliest place where the text ends
    with `after` or with the opening's head fixes where the forced ids start.
    """
    text = "".join(chr(0x100 + t) for t in output)
    after = "".join(chr(0x100 + t) for t in channel.after)
    head = "".join(chr(0x100 + t) for t in channel.opening[: channel.opens_at])
    hits = []
    for pattern, first_forced in ((after, 0), (head, channel.opens_at)):
        at = text.find(pattern)
        if at >= 0:
            hits.append((at + len(pattern), first_forced))
    if not hits:
        return None, channel.end_ids
    end, first_forced = min(hits)
    position = first_forced + len(text) - end
    if position >= len(channel.opening):
        return None, frozenset()
    return channel.opening[position], channel.end_ids


def machine(channel: RequiredChannel, output: list[int]) -> tuple[int | None, frozenset[int]]:
    state = channel.walk(output)
    return channel.forced_token(state), channel.banned_tokens(state)


def follow(channel: RequiredChannel, wishes: list[int]) -> list[int]:
    """The output of a model wishing `wishes` under the mask: forced ids win, banned wishes drop."""
    out: list[int] = []
    state = START
    for wish in wishes:
        forced = channel.forced_token(state)
        token = wish if forced is None else forced
        if forced is None and token in channel.banned_tokens(state):
            continue
        out.append(token)
        state = channel.step(state, token)
    return out


def test_forces_opening_after_response_close():
    out = follow(K3, [WORD, EOM, WORD, CLOSE, RESPONSE, SEP] + [EOM] * 9)
    assert out == [WORD, WORD, CLOSE, RESPONSE, SEP, *OPENING, EOM, EOM]
    assert K3.walk(out[:-2]) == UNCONSTRAINED


def test_waiting_bans_end_ids_and_forces_nothing():
    for state in range(K3.num_waiting):
        assert K3.forced_token(state) is None
        assert K3.banned_tokens(state) == {EOM, EOS}
    assert K3.banned_tokens(UNCONSTRAINED) == frozenset()
    assert K3.forced_token(UNCONSTRAINED) is None


def test_model_opening_the_channel_itself_forces_only_the_rest():
    state = K3.walk([CLOSE, MESSAGE, SEP, OPEN, TOOLS, SEP])
    assert K3.forced_token(state) == OPEN
    assert follow(K3, [OPEN, TOOLS, SEP] + [WORD] * 6) == [*OPENING, WORD, WORD]


def test_head_equal_to_opening_means_unconstrained_once_written():
    channel = RequiredChannel(AFTER, (OPEN, TOOLS, SEP), 3, [EOM])
    assert channel.walk([OPEN, TOOLS, SEP]) == UNCONSTRAINED
    assert channel.walk([OPEN, TOOLS]) != UNCONSTRAINED


def test_prompt_turns_do_not_count_output_starts_at_start():
    # An earlier turn's `<|close|>response<|sep|>` is in the prompt, never fed.
    assert K3.walk([]) == START
    assert K3.walk([SEP, WORD]) == START
    assert K3.forced_token(K3.walk([RESPONSE, SEP])) is None  # tail of a prompt's trigger


def test_after_seen_twice_and_overlapping_partial_matches():
    # CLOSE CLOSE RESPONSE SEP: the first CLOSE must not spoil the match.
    assert K3.forced_token(K3.walk([CLOSE, CLOSE, RESPONSE, SEP])) == OPEN
    # A second `after` once unconstrained changes nothing.
    out = follow(K3, [CLOSE, RESPONSE, SEP] + [WORD] * 7 + [CLOSE, RESPONSE, SEP, EOM])
    assert out[-4:] == [CLOSE, RESPONSE, SEP, EOM]
    assert K3.walk(out) == UNCONSTRAINED


def test_self_overlapping_after_is_matched_exactly():
    # after = a a b: "a a a b" must match (a naive reset would miss it).
    channel = RequiredChannel((20, 20, 21), (30, 31), 1, [EOM])
    assert channel.forced_token(channel.walk([20, 20, 20, 21])) == 30
    assert channel.forced_token(channel.walk([20, 21, 20, 20, 21])) == 30
    assert channel.forced_token(channel.walk([20, 20, 22, 21])) is None


def test_ending_on_adds_stop_ids():
    channel = K3.ending_on([STOP, 40])
    assert channel.banned_tokens(START) == {EOM, EOS, STOP, 40}
    assert K3.banned_tokens(START) == {EOM, EOS}  # immutable original
    assert channel.walk([CLOSE, RESPONSE, SEP]) == K3.walk([CLOSE, RESPONSE, SEP])
    with pytest.raises(ValueError, match=r"\[3\]"):
        K3.ending_on([SEP])


def test_immutable_and_hashable():
    with pytest.raises(AttributeError, match="immutable"):
        K3.after = (1,)
    assert RequiredChannel(AFTER, OPENING, 3, {EOS, EOM}) == K3
    assert len({K3, RequiredChannel(AFTER, OPENING, 3, [EOM, EOS])}) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((AFTER, OPENING, 3, [EOM, SEP]), r"end ids \[3\] are also channel ids"),
        ((AFTER, OPENING, 3, [TOOLS, CALL, EOM]), r"end ids \[6, 7\]"),
        (((OPEN, TOOLS), OPENING, 3, [EOM]), r"after=\[1, 6\].*one contains the other"),
        (((9, OPEN, TOOLS, SEP), OPENING, 3, [EOM]), "one contains the other"),
        (((SEP,), OPENING, 3, [EOM]), "one contains the other"),
        ((AFTER, OPENING, 0, [EOM]), r"opens_at=0 must be between 1 and len\(opening\)=7"),
        ((AFTER, OPENING, 8, [EOM]), "opens_at=8"),
        (((), OPENING, 3, [EOM]), "after must hold"),
        ((AFTER, (), 1, [EOM]), "opening must hold"),
        ((AFTER, (1, -2), 1, [EOM]), r"bad values: \[-2\]"),
        ((AFTER, OPENING, 3, [EOM, 1.5]), r"end_ids.*\[1.5\]"),
    ],
)
def test_constructor_refuses(args, message):
    with pytest.raises(ValueError, match=message):
        RequiredChannel(*args)


def test_bad_states_and_tokens_are_refused():
    with pytest.raises(ValueError, match=r"state 99 .* valid are 0\.\.\d+ and UNCONSTRAINED"):
        K3.step(99, WORD)
    with pytest.raises(ValueError, match="state -2"):
        K3.forced_token(-2)
    with pytest.raises(ValueError, match="token must be"):
        K3.step(START, -1)


# Small alphabets make triggers frequent; the channel shapes vary too.
@st.composite
def valid_channels(draw):
    after = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    opening = draw(st.lists(st.integers(0, 5), min_size=1, max_size=5))
    opens_at = draw(st.integers(1, len(opening)))
    ends = draw(st.sets(st.integers(6, 8), max_size=2))
    try:
        return RequiredChannel(after, opening, opens_at, ends)
    except ValueError as err:
        assert "one contains the other" in str(err)
        assume(False)


@settings(max_examples=400, deadline=None)
@given(valid_channels(), st.lists(st.integers(0, 8), max_size=30))
def test_every_prefix_matches_the_reference(channel, output):
    for n in range(len(output) + 1):
        assert machine(channel, output[:n]) == reference(channel, output[:n])


@settings(max_examples=300, deadline=None)
@given(valid_channels(), st.lists(st.integers(0, 8), max_size=30))
def test_forced_outputs_match_the_reference(channel, wishes):
    out = follow(channel, wishes)
    for n in range(len(out) + 1):
        assert machine(channel, out[:n]) == reference(channel, out[:n])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([OPEN, CLOSE, SEP, RESPONSE, TOOLS, MESSAGE, WORD]), max_size=40))
def test_k3_pieces_match_the_reference(output):
    for n in range(len(output) + 1):
        assert machine(K3, output[:n]) == reference(K3, output[:n])
