"""RequiredChannel against hand-written cases and a text-scanning reference."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from atom_plugin.k3 import START, UNCONSTRAINED, RequiredChannel

# Word-level ids that read like the K3 pieces.
OPEN, CLOSE, SEP, EOM = 1, 2, 3, 4
RESPONSE, TOOLS, CALL, TOOL_ATTR, QUOTE, MESSAGE, WORD, EOS, STOP = 5, 6, 7, 8, 9, 10, 11, 12, 13
AFTER = (CLOSE, RESPONSE, SEP)
OPENING = (OPEN, TOOLS, SEP, OPEN, CALL, TOOL_ATTR, QUOTE)
K3 = RequiredChannel(AFTER, OPENING, 3, [EOM, EOS])


def reference(channel: RequiredChannel, output: list[int]) -> tuple[int | None, frozenset[int]]:
    """(forced id, banned ids) for the next token, found by scanning the decoded output.

    Each id decodes to one character; the earliest place where the text ends
    with `after` or with the opening's head fixes where the forced ids start. An
    optional channel has no `after` and bans nothing until then.
    """
    text = "".join(chr(0x100 + t) for t in output)
    after = "".join(chr(0x100 + t) for t in channel.after)
    head = "".join(chr(0x100 + t) for t in channel.opening[: channel.opens_at])
    hits = []
    for pattern, first_forced in ((after, 0), (head, channel.opens_at)):
        if not pattern:
            continue
        at = text.find(pattern)
        if at >= 0:
            hits.append((at + len(pattern), first_forced))
    if not hits:
        return None, frozenset() if channel.optional else channel.end_ids
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


def test_optional_channel_has_no_trigger_and_bans_nothing_while_waiting():
    auto = K3.as_optional()
    assert auto.after == () and auto.optional and auto != K3 and auto.as_optional() == auto
    with pytest.raises(ValueError, match=r"no trigger: after must be empty, got \[2, 5, 3\]"):
        RequiredChannel(AFTER, OPENING, 3, [EOM], optional=True)
    with pytest.raises(TypeError, match="optional must be True or False"):
        RequiredChannel((), OPENING, 3, [EOM], optional=1)
    # The model answers, closes its response and ends: nothing forced, nothing banned.
    out = follow(auto, [WORD, CLOSE, RESPONSE, SEP, WORD, EOM])
    assert out == [WORD, CLOSE, RESPONSE, SEP, WORD, EOM]
    assert auto.banned_tokens(auto.walk(out)) == frozenset()
    # It writes the head itself: the rest of the opening is forced, end ids banned.
    out = follow(auto, [WORD, OPEN, TOOLS, SEP] + [EOM] * 5)
    assert out == [WORD, *OPENING, EOM]
    assert auto.banned_tokens(auto.walk([WORD, OPEN, TOOLS, SEP])) == {EOM, EOS}
    assert auto.ending_on([STOP]).optional and auto.extended([WORD]).optional
    assert "optional=True" in repr(auto)


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


@settings(max_examples=200, deadline=None)
@given(valid_channels(), st.lists(st.integers(0, 8), max_size=30))
def test_optional_channels_match_the_reference(channel, output):
    auto = channel.as_optional()
    for n in range(len(output) + 1):
        assert machine(auto, output[:n]) == reference(auto, output[:n])
    out = follow(auto, output)
    for n in range(len(out) + 1):
        assert machine(auto, out[:n]) == reference(auto, out[:n])


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


# ---- named tool choices: the opening goes on with the name's ids and the closing quote ----
NAME_IDS = [20, 21, 22, OPEN, CLOSE, SEP, RESPONSE, TOOLS, CALL, TOOL_ATTR, QUOTE, WORD]
NAMES = st.lists(st.sampled_from(NAME_IDS), min_size=1, max_size=6)  # ids may be the channel's
OTHER_TOOL = [23, 24]


def named(name: list[int]) -> RequiredChannel:
    return K3.extended([*name, QUOTE])


def opened_at(output: list[int]) -> tuple[int, int]:
    """(index after the first `after` or head in the output, how much of the opening that is)."""
    head = list(OPENING[:3])
    for end in range(len(output) + 1):
        if output[:end][-3:] == list(AFTER):
            return end, 0
        if output[:end][-3:] == head:
            return end, 3
    raise AssertionError(f"the tools channel never opened in {output}")


def test_named_opening_is_the_required_one_then_the_name():
    channel = named([20, 21])
    assert channel.opening == (*OPENING, 20, 21, QUOTE)
    assert channel.after == K3.after and channel.opens_at == 3 and channel.end_ids == K3.end_ids
    assert channel.num_waiting == K3.num_waiting  # matching is the required channel's
    assert K3.extended([]) == K3 and channel != named([20])
    with pytest.raises(ValueError, match=r"end ids \[4\] are also channel ids"):
        K3.extended([EOM, QUOTE])


@settings(max_examples=300, deadline=None)
@given(NAMES, st.lists(st.integers(0, 24), max_size=30))
def test_named_every_prefix_matches_the_reference(name, output):
    channel = named(name)
    for n in range(len(output) + 1):
        assert machine(channel, output[:n]) == reference(channel, output[:n])


@settings(max_examples=300, deadline=None)
@given(NAMES, st.lists(st.integers(0, 24), max_size=30))
def test_named_agrees_with_required_until_the_name(name, output):
    """Same waiting states and forced ids as `required`; where `required` lets go, the name."""
    channel = named(name)
    state, required = START, START
    for token in output:
        if required == UNCONSTRAINED:
            break
        assert channel.is_waiting(state) == K3.is_waiting(required)
        assert channel.forced_token(state) == K3.forced_token(required)
        assert channel.banned_tokens(state) == K3.banned_tokens(required)
        state, required = channel.step(state, token), K3.step(required, token)
    if required == UNCONSTRAINED:
        tail = [channel.forced_token(channel.walk([0] * i, state)) for i in range(len(name) + 1)]
        assert tail == [*name, QUOTE]


PATHS = st.sampled_from(
    [
        [WORD, CLOSE, RESPONSE, SEP],  # the trigger: the whole opening is forced
        [WORD, OPEN, TOOLS, SEP],  # the model opens the tools channel itself
        [CLOSE, RESPONSE, SEP, OPEN, TOOLS, SEP],  # the trigger, then the model's own head
        [OPEN, TOOLS, SEP, OPEN, CALL, TOOL_ATTR],  # the model's head and call opening
    ]
)


@settings(max_examples=300, deadline=None)
@given(NAMES, PATHS, st.lists(st.integers(0, 24), max_size=12), st.data())
def test_named_every_path_into_the_tools_channel_calls_the_named_tool(name, path, noise, data):
    """The model tries to end or to call another tool; the first call is always the named one."""
    wishes = [
        *noise,
        *path,
        *data.draw(st.sampled_from([[OPEN, CALL, TOOL_ATTR, QUOTE, *OTHER_TOOL, QUOTE], [EOM]])),
        *[WORD] * 30,
    ]
    channel = named(name)
    out = follow(channel, wishes)
    assert channel.walk(out) == UNCONSTRAINED
    end, written = opened_at(out)
    rest = list(channel.opening[written:])
    assert out[end : end + len(rest)] == rest  # ... call tool="NAME"
    assert rest[-len(name) - 1 :] == [*name, QUOTE]
    assert EOM not in out[:end] and EOS not in out[:end]


@settings(max_examples=100, deadline=None)
@given(NAMES, NAMES)
def test_names_sharing_a_prefix_are_different_channels(a, b):
    assume(a != b)
    first, second = named(a), named(a + b)
    assert first != second and len({first, second}) == 2
    assert first.walk([CLOSE, RESPONSE, SEP, *OPENING, *a]) == first.num_states - 1
    assert second.forced_token(second.walk([CLOSE, RESPONSE, SEP, *OPENING, *a])) == b[0]
