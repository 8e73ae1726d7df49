"""Forwards of the two engines take turns on the cores (cpu_engine/turns.py):
never two at once, and alternating when both wait."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from cpu_engine.turns import TURNS_VARIABLE, ForwardTurns


def _forwards(prefix: str, name: str, count: int, seconds: float, log: str, started) -> None:
    turns = ForwardTurns(prefix)
    started.wait()
    for _ in range(count):
        with open(log, "a") as out:
            out.write(f"{name} want {time.monotonic()}\n")
        with turns:
            with open(log, "a") as out:
                out.write(f"{name} start {time.monotonic()}\n")
            time.sleep(seconds)
            with open(log, "a") as out:
                out.write(f"{name} end {time.monotonic()}\n")


def run_two_engines(tmp_path, prefix, count=6, seconds=0.05):
    log = tmp_path / "log"
    log.touch()
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    engines = [context.Process(target=_forwards, args=(prefix, name, count, seconds, str(log), started))
               for name in ("target", "draft")]
    for engine in engines:
        engine.start()
    time.sleep(0.5)  # both have opened their lock files
    started.set()
    for engine in engines:
        engine.join(timeout=30)
        assert engine.exitcode == 0
    return sorted((float(at), name, what) for name, what, at in (line.split() for line in log.read_text().splitlines()))


def overlaps(events) -> int:
    running, most = 0, 0
    for _, _, what in events:
        running += {"start": 1, "end": -1}.get(what, 0)
        most = max(most, running)
    return most


def turns_taken_past_a_waiting_engine(events, margin=0.02) -> list[float]:
    """Times at which an engine started a second turn in a row although the
    other had asked for the cores before its first turn ended (by ``margin``
    seconds: its log line is written just before it asks)."""
    waiting_since: dict[str, float] = {}
    last_turn, last_end, unfair = None, 0.0, []
    for at, name, what in events:
        if what == "want":
            waiting_since[name] = at
        elif what == "start":
            other_waited = any(n != name and since < last_end - margin for n, since in waiting_since.items())
            if name == last_turn and other_waited:
                unfair.append(at)
            waiting_since.pop(name)
            last_turn = name
        else:
            last_end = at
    return unfair


def test_forwards_never_overlap_and_alternate_when_both_wait(tmp_path):
    events = run_two_engines(tmp_path, tmp_path / "turns" / "forwards")
    assert overlaps(events) == 1
    assert sum(what == "start" for _, _, what in events) == 12
    # each engine asks again at once: without the queue lock the releasing one may win again
    assert turns_taken_past_a_waiting_engine(events) == [], events


def test_without_a_path_forwards_run_at_once(tmp_path):
    events = run_two_engines(tmp_path, None, count=3, seconds=0.2)
    assert overlaps(events) == 2  # the check above can fail


def test_the_variable_names_the_lock_files_and_an_empty_one_turns_them_off(tmp_path):
    assert not ForwardTurns.from_environment({TURNS_VARIABLE: ""}).enabled
    assert not ForwardTurns.from_environment({}).enabled
    turns = ForwardTurns.from_environment({TURNS_VARIABLE: str(tmp_path / "x" / "turns")})
    assert turns.enabled and (tmp_path / "x" / "turns.cores").exists()
    turns.close()


def test_a_path_that_cannot_hold_the_lock_files_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=TURNS_VARIABLE):
        ForwardTurns(blocker / "turns")
