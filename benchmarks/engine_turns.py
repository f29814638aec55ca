"""Which case of an engine-benchmark wave measures when.

The cases of a wave measure one at a time, in rounds: round 0 sets each case up (the
physical limits, the cold pass, the warm-ups), each later round runs one measured pass of
every case, and the last one the profiles. Within round r the cases go in the wave's order
rotated by r. So no case always goes first, and a drift in the machine's state over the
minutes of a wave (clocks, a neighbour's load on the host) falls on every case alike
instead of on whichever case measured while it lasted. On 2026-12-06, with each case
measuring all its passes in one turn, one H100 gave ATOM_AITER_MLA's decode-2k step
5.20 ms in one pass and 3.66 ms in the next (the same decode work), and
FLASH_ATTN_MLA's 5.0 ms where the day before it had taken 3.6 ms.

Cases coordinate through marks in the wave's folder: `turn-N.done` once the schedule's
N-th slot has run, `CASE.failed` once a case has stopped, `CASE.pid` its process; the
slots of a stopped case, or of one whose process is gone (killed, crashed), pass.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def schedule(cases: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, case) for every slot, in the order the slots run."""
    n = len(cases)
    return [(r, cases[(i + r) % n]) for r in range(rounds) for i in range(n)]


class Turns:
    """One case's side of the wave's schedule."""

    def __init__(
        self, folder: Path, cases: list[str], rounds: int, case: str, timeout: float, poll=0.05
    ):
        if case not in cases:
            raise ValueError(f"case {case!r} is not in the wave {cases}")
        self.folder, self.case, self.timeout, self.poll = Path(folder), case, timeout, poll
        self.slots = schedule(cases, rounds)
        self.width = len(cases)  # slots a round
        self.positions: list[int] = []  # this case's place in each round taken, from 1
        (self.folder / f"{case}.pid").write_text(str(os.getpid()))

    def _index(self, round_: int) -> int:
        return self.slots.index((round_, self.case))

    def _passed(self, index: int) -> bool:
        _, case = self.slots[index]
        if (self.folder / f"turn-{index}.done").exists():
            return True
        return (self.folder / f"{case}.failed").exists() or _gone(self.folder / f"{case}.pid")

    def _wait(self, before: int) -> bool:
        """Until every slot before `before` has run or belongs to a stopped case; False
        after the timeout."""
        deadline = time.monotonic() + self.timeout
        pending = list(range(before))
        while pending:
            pending = [i for i in pending if not self._passed(i)]
            if pending and time.monotonic() > deadline:
                return False
            if pending:
                time.sleep(self.poll)
        return True

    @contextmanager
    def turn(self, round_: int) -> Iterator[int]:
        """This case's slot of `round_`: waits for the slots before it, yields the case's
        place in the round (from 1), marks the slot done after. An error inside marks the
        case stopped, so the rest of the wave goes on without it."""
        index = self._index(round_)
        if not self._wait(index):
            print(f"# {self.case}: earlier turns unfinished after {self.timeout:.0f} s; "
                  "measuring anyway", flush=True)  # fmt: skip
        position = index - round_ * self.width + 1
        self.positions.append(position)
        try:
            yield position
        except BaseException:
            self.stop()
            raise
        (self.folder / f"turn-{index}.done").touch()

    def stop(self) -> None:
        (self.folder / f"{self.case}.failed").touch()

    def wait_for_all(self) -> bool:
        """Until every slot of the wave has run (or its case stopped)."""
        return self._wait(len(self.slots))


def _gone(pid_file: Path) -> bool:
    """Whether the process named in `pid_file` has ended (False while there is no file:
    that case has not reached its turns yet)."""
    try:
        pid = int(pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
