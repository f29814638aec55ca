"""The Kimi-K3 required tools channel as a small deterministic state machine.

A request with `tool_choice="required"` must call a tool. The machine reads the
request's output (never its prompt: earlier turns contain the trigger too) one
token at a time:

- Waiting: the output has not yet ended with `after` (`<|close|>response<|sep|>`)
  nor with the opening's head `opening[:opens_at]` (`<|open|>tools<|sep|>`). End
  ids (`<|end_of_msg|>`, EOS, engine stop ids) are banned.
- Forced: the output just ended with `after` (forced from `opening[0]`) or the
  model wrote the head itself (the tools channel is open: forced from
  `opening[opens_at]`). Each forced state allows exactly one token.
- Calls (only for a channel built `with_calls`): after the last forced id the
  call automaton (call_automaton.py) takes over: tool names, argument keys and
  values from the request's schemas, the channel's close. Its states follow the
  forced ones; a call state forces one id or allows a set of ids (masked).
- UNCONSTRAINED: after the last forced id of a channel without calls (the tool
  name and arguments are the model's), or after the calls' `<|end_of_msg|>`. It
  is absorbing.

Waiting states are the proper prefixes of the two patterns (`after` and the
head), so matching is exact for every sequence, overlaps included (the longest
suffix of the output that is a proper prefix of a pattern is all the machine
needs to know). States are small ints so they fit a GPU tensor: waiting states
are `0 .. num_waiting - 1` (START = 0 is the empty prefix), forced state
`num_waiting + i` forces `opening[i]`, call state `calls_base + j` is the
automaton's state j, and UNCONSTRAINED is -1.

A forced state advances to the next forced position whatever the token: a
different token can only be a speculative draft, which the sampler rejects, so
nothing built on it is ever committed.

An optional channel (`optional=True`, for `tool_choice="auto"`) has no trigger
(`after` is empty) and its waiting states ban nothing: the model may answer
without a call. Once the model writes the head itself, the rest of the opening
is forced and its calls are constrained as in a required channel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from atom_plugin.k3.call_automaton import CallAutomaton
from atom_plugin.k3.call_table import FINAL, CallTable

START = 0
UNCONSTRAINED = -1


def _ids(what: str, values: Iterable[int]) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be token ids, got the string {values!r}")
    out = tuple(values)
    bad = [v for v in out if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ValueError(f"{what} must be non-negative int token ids; bad values: {bad}")
    return out


def _contains(haystack: tuple[int, ...], needle: tuple[int, ...]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


class RequiredChannel:
    """Immutable description of the channel plus its transition function.

    `after`: ids after which the opening is forced; `opening`: the forced ids;
    `opens_at`: how many leading ids of `opening` open the channel when the
    model writes them itself; `end_ids`: ids banned until the channel is open
    (and in its call states); `optional`: no trigger (`after` empty) and nothing
    banned while waiting.
    """

    __slots__ = (
        "after",
        "opening",
        "opens_at",
        "end_ids",
        "calls",
        "optional",
        "num_waiting",
        "num_states",
        "_delta",
    )

    def __init__(
        self,
        after: Sequence[int],
        opening: Sequence[int],
        opens_at: int,
        end_ids: Iterable[int],
        calls: CallTable | CallAutomaton | None = None,
        optional: bool = False,
    ) -> None:
        if isinstance(calls, CallAutomaton):
            calls = calls.table
        after_t = _ids("after", after)
        opening_t = _ids("opening", opening)
        ends = frozenset(_ids("end_ids", end_ids))
        if not isinstance(optional, bool):
            raise TypeError(f"optional must be True or False, got {optional!r}")
        if optional and after_t:
            raise ValueError(
                f"an optional channel has no trigger: after must be empty, got {list(after_t)}"
            )
        if not optional and not after_t:
            raise ValueError("after must hold at least one token id, got ()")
        if not opening_t:
            raise ValueError("opening must hold at least one token id, got ()")
        if isinstance(opens_at, bool) or not isinstance(opens_at, int):
            raise TypeError(f"opens_at must be an int, got {opens_at!r}")
        if not 1 <= opens_at <= len(opening_t):
            raise ValueError(
                f"opens_at={opens_at} must be between 1 and len(opening)={len(opening_t)} "
                f"(opening={list(opening_t)})"
            )
        head = opening_t[:opens_at]
        if after_t and (_contains(head, after_t) or _contains(after_t, head)):
            # Whichever completes first would hide the other, or both would
            # complete on the same token with different forced positions.
            raise ValueError(
                f"cannot match after={list(after_t)} and the opening's head "
                f"opening[:{opens_at}]={list(head)}: one contains the other"
            )
        clash = sorted(ends & (set(after_t) | set(opening_t)))
        if clash:
            raise ValueError(
                f"end ids {clash} are also channel ids (after={list(after_t)}, "
                f"opening={list(opening_t)}): they cannot be banned and matched or forced"
            )
        set_ = object.__setattr__
        set_(self, "after", after_t)
        set_(self, "opening", opening_t)
        set_(self, "opens_at", opens_at)
        set_(self, "end_ids", ends)
        set_(self, "calls", calls)
        set_(self, "optional", optional)
        self._build(after_t, head)

    def _build(self, after: tuple[int, ...], head: tuple[int, ...]) -> None:
        # Waiting states: distinct proper prefixes of both patterns, shortest first.
        prefixes = sorted(
            {after[:n] for n in range(len(after))} | {head[:n] for n in range(len(head))},
            key=lambda p: (len(p), p),
        )
        index = {p: i for i, p in enumerate(prefixes)}
        num_waiting = len(prefixes)
        opened = num_waiting + self.opens_at
        if self.opens_at == len(self.opening):
            opened = self._after_opening(num_waiting)
        delta: list[dict[int, int]] = []
        for p in prefixes:
            row: dict[int, int] = {}
            for t in sorted(set(after) | set(head)):
                text = p + (t,)
                if after and text[-len(after) :] == after:
                    row[t] = num_waiting
                elif text[-len(head) :] == head:
                    row[t] = opened
                else:
                    # Longest suffix that is still a proper prefix of a pattern.
                    k = next(k for k in range(len(text), -1, -1) if text[len(text) - k :] in index)
                    row[t] = index[text[len(text) - k :]]
            delta.append(row)
        object.__setattr__(self, "num_waiting", num_waiting)
        calls = 0 if self.calls is None else self.calls.num_states
        object.__setattr__(self, "num_states", num_waiting + len(self.opening) + calls)
        object.__setattr__(self, "_delta", tuple(delta))

    def _after_opening(self, num_waiting: int) -> int:
        """The state after the opening's last id: the calls' first, or UNCONSTRAINED."""
        return UNCONSTRAINED if self.calls is None else num_waiting + len(self.opening)

    @property
    def calls_base(self) -> int:
        """The channel state of the call automaton's state 0."""
        return self.num_waiting + len(self.opening)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"RequiredChannel is immutable (tried to set {name!r})")

    def __repr__(self) -> str:
        calls = "" if self.calls is None else f", calls={self.calls.num_states} states"
        return (
            f"RequiredChannel(after={list(self.after)}, opening={list(self.opening)}, "
            f"opens_at={self.opens_at}, end_ids={sorted(self.end_ids)}{calls}"
            f"{', optional=True' if self.optional else ''})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequiredChannel):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        calls = None if self.calls is None else (self.calls.digest, self.calls.token_classes)
        return (self.after, self.opening, self.opens_at, self.end_ids, calls, self.optional)

    def ending_on(self, stop_ids: Iterable[int]) -> RequiredChannel:
        """The same channel with the engine's stop ids banned too."""
        extra = _ids("stop_ids", stop_ids)
        ends = self.end_ids | set(extra)
        return RequiredChannel(
            self.after, self.opening, self.opens_at, ends, self.calls, self.optional
        )

    def extended(self, tail: Iterable[int]) -> RequiredChannel:
        """The same channel with `tail` forced after its opening.

        A named tool choice is the required channel whose opening goes on with
        the tool's name and the attribute's closing quote: every path into the
        tools channel (the trigger after `after`, or the model writing the head
        itself) then forces the whole named call opening.
        """
        extra = _ids("tail", tail)
        return RequiredChannel(
            self.after, self.opening + extra, self.opens_at, self.end_ids, self.calls, self.optional
        )

    def with_calls(self, calls: CallTable | CallAutomaton) -> RequiredChannel:
        """The same channel whose opening goes on into `calls` instead of letting go."""
        return RequiredChannel(
            self.after, self.opening, self.opens_at, self.end_ids, calls, self.optional
        )

    def as_optional(self) -> RequiredChannel:
        """The channel of `tool_choice="auto"`: the same opening (and calls) without the
        trigger, banning nothing until the model writes the head itself."""
        return RequiredChannel(
            (), self.opening, self.opens_at, self.end_ids, self.calls, optional=True
        )

    def bans_while_waiting(self, state: int) -> bool:
        """Whether `state` is a waiting state that bans the end ids (not in an optional one)."""
        return self.is_waiting(state) and not self.optional

    def _check_state(self, state: int) -> None:
        if isinstance(state, bool) or not isinstance(state, int):
            raise TypeError(f"state must be an int, got {state!r}")
        if state != UNCONSTRAINED and not 0 <= state < self.num_states:
            raise ValueError(
                f"state {state} is not a state of this channel: valid are "
                f"0..{self.num_states - 1} and UNCONSTRAINED ({UNCONSTRAINED})"
            )

    def is_waiting(self, state: int) -> bool:
        self._check_state(state)
        return 0 <= state < self.num_waiting

    def is_forced(self, state: int) -> bool:
        return self.forced_token(state) is not None

    def is_masked(self, state: int) -> bool:
        """A call state allowing several ids: every other id is masked."""
        self._check_state(state)
        return state >= self.calls_base and self.forced_token(state) is None

    def call_state(self, state: int) -> int | None:
        """The call automaton's state for `state`, None outside the calls."""
        self._check_state(state)
        return state - self.calls_base if state >= self.calls_base else None

    def step(self, state: int, token: int) -> int:
        """The state after `token` is appended to the output."""
        self._check_state(state)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"token must be a non-negative int id, got {token!r}")
        if state == UNCONSTRAINED:
            return UNCONSTRAINED
        if state >= self.calls_base:
            return self._call_step(state, self.calls.step(state - self.calls_base, token))
        if state >= self.num_waiting:
            nxt = state + 1
            return nxt if nxt < self.calls_base else self._after_opening(self.num_waiting)
        return self._delta[state].get(token, START)

    def _call_step(self, state: int, nxt: int | None) -> int:
        # A token the state does not allow can only be a rejected draft: stay.
        if nxt is None:
            return state
        return UNCONSTRAINED if nxt == FINAL else self.calls_base + nxt

    def walk(self, tokens: Iterable[int], state: int = START) -> int:
        """The state after every token of `tokens`, starting from `state`."""
        for token in tokens:
            state = self.step(state, token)
        return state

    def forced_token(self, state: int) -> int | None:
        """The only id allowed in `state`, or None when the state forces nothing."""
        self._check_state(state)
        if state >= self.calls_base:
            return self.calls.forced_token(state - self.calls_base)
        if state >= self.num_waiting:
            return self.opening[state - self.num_waiting]
        return None

    def banned_tokens(self, state: int) -> frozenset[int]:
        """End ids while the channel is not open yet (waiting or forced), else nothing.

        A forced state bans every id but its forced one; this set only names
        the end ids, which stay banned until the request is UNCONSTRAINED. An
        optional channel's waiting states ban nothing.
        """
        self._check_state(state)
        if state == UNCONSTRAINED or (self.optional and self.is_waiting(state)):
            return frozenset()
        return self.end_ids
