"""benchmarks/engine_turns.py: the rotating schedule of a benchmark wave, and cases in
threads taking their turns through the marks in a folder."""

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.engine_turns import Turns, schedule


@given(st.integers(1, 6), st.integers(1, 8))
def test_every_case_has_one_slot_a_round_and_the_first_place_rotates(n, rounds):
    cases = [f"c{i}" for i in range(n)]
    slots = schedule(cases, rounds)
    assert len(slots) == n * rounds
    for r in range(rounds):
        in_round = [case for rr, case in slots if rr == r]
        assert sorted(in_round) == sorted(cases)
        assert in_round[0] == cases[r % n]
    # slots run round by round
    assert [r for r, _ in slots] == sorted(r for r, _ in slots)


def _wave(tmp_path, cases, rounds, body):
    """Each case in a thread taking its `rounds` turns; returns the (round, case) entries
    in the order the turns ran, and the places each case was given."""
    ran, lock, places, errors = [], threading.Lock(), {}, []

    def case_thread(case):
        turns = Turns(tmp_path, cases, rounds, case, timeout=20, poll=0.001)
        try:
            for r in range(rounds):
                with turns.turn(r):
                    with lock:
                        ran.append((r, case))
                    body(case, r)
        except RuntimeError as exc:
            errors.append(str(exc))
        turns.wait_for_all()
        places[case] = turns.positions

    threads = [threading.Thread(target=case_thread, args=(c,)) for c in cases]
    for t in reversed(threads):  # started in the opposite order: the schedule decides
        t.start()
    for t in threads:
        t.join(timeout=60)
    return ran, places, errors


def test_cases_in_threads_take_their_turns_in_the_schedules_order(tmp_path):
    cases = ["ATOM_AITER_MLA", "FLASH_ATTN_MLA", "FLASHMLA"]
    ran, places, errors = _wave(tmp_path, cases, 4, lambda case, r: None)
    assert errors == []
    assert ran == schedule(cases, 4)
    assert places["ATOM_AITER_MLA"] == [1, 3, 2, 1]
    assert places["FLASH_ATTN_MLA"] == [2, 1, 3, 2]


def test_a_case_that_fails_in_its_turn_lets_the_rest_of_the_wave_go_on(tmp_path):
    cases = ["a", "b", "c"]

    def body(case, r):
        if (case, r) == ("b", 1):
            raise RuntimeError("engine died")

    ran, _, errors = _wave(tmp_path, cases, 3, body)
    assert errors == ["engine died"]
    assert (tmp_path / "b.failed").exists()
    # b ran up to its failing turn; a and c ran all theirs, in the schedule's order
    expected = [s for s in schedule(cases, 3) if s[1] != "b" or s[0] <= 1]
    assert ran == expected


def test_a_case_not_in_the_wave_is_refused(tmp_path):
    with pytest.raises(ValueError, match="case 'd' is not in the wave"):
        Turns(tmp_path, ["a", "b"], 2, "d", timeout=1)


def test_the_slots_of_a_case_whose_process_is_gone_pass(tmp_path):
    import subprocess
    import sys

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True)  # fmt: skip
    (tmp_path / "a.pid").write_text(ended.stdout.strip())  # "a" was killed mid-run
    turns = Turns(tmp_path, ["a", "b"], 2, "b", timeout=5, poll=0.001)
    with turns.turn(0) as place:  # a's slot of round 0 comes first: it passes
        assert place == 2
    with turns.turn(1) as place:
        assert place == 1
    assert turns.wait_for_all()  # a's slot of round 1 passes too


def test_a_case_still_starting_holds_the_turns_after_its_own(tmp_path):
    turns = Turns(tmp_path, ["a", "b"], 1, "b", timeout=0.05, poll=0.001)
    assert not turns._wait(1)  # "a" has no pid file yet: still starting, not gone
