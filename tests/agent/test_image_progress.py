"""How often a preparing member's image pull is journaled and sent (agent/image_progress.py):
at its start, each tenth of its bytes, each new phase, else at most every 5 s while it moves."""

from __future__ import annotations

from tuneplane.agent.image_cache import PullProgress
from tuneplane.agent.image_progress import EVERY_S, ProgressPace

MIB = 1 << 20


def _at(done: int, phase: str = "pulling", layers: int = 0) -> PullProgress:
    return PullProgress(done * MIB, 100 * MIB, layers, 3, phase)


def test_a_pull_is_told_at_its_start_each_tenth_and_each_new_phase() -> None:
    pace = ProgressPace()
    told = [done for done in range(0, 101) if pace.due(_at(done), now=0.0)]
    # One per tenth of the bytes over a pull of 101 chunks, however many chunks there are.
    assert told == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert pace.due(_at(100, "unpacking", 3), now=0.0)
    assert not pace.due(_at(100, "unpacking", 3), now=60.0)  # nothing moved: nothing to tell


def test_a_slow_pull_is_told_every_few_seconds_while_it_moves() -> None:
    pace = ProgressPace()
    assert pace.due(_at(0), now=0.0)
    assert not pace.due(_at(1), now=EVERY_S - 0.1)
    assert pace.due(_at(2), now=EVERY_S)
    assert not pace.due(_at(3), now=EVERY_S + 1)
    assert pace.due(_at(3, layers=1), now=2 * EVERY_S)
