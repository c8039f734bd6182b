"""Hang points (agent/crashpoint.py): ``TUNEPLANE_HANGPOINT=<point>:<seconds>`` blocks the thread
that reaches the point, once. tests/integration/test_watchdog_blocked_loop.py uses it for real."""

from __future__ import annotations

import logging
import time

import pytest

from tuneplane.agent import crashpoint as cp


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("after-spawn:2", cp.HangPoint("after-spawn", 2.0)),
        ("after-prepare-journaled:0.25", cp.HangPoint("after-prepare-journaled", 0.25)),
        ("after-spawn", None),
        ("after-spawn:", None),
        ("after-spawn:soon", None),
        ("after-spawn:0", None),
        ("after-spawn:-1", None),
        ("after-spawn:nan", None),
        (f"after-spawn:{cp.MAX_HANG_S + 1:g}", None),
        ("no-such-point:1", None),
    ],
)
def test_a_hang_point_is_a_known_point_and_a_bounded_positive_time(
    value: str, expected: cp.HangPoint | None
) -> None:
    assert cp.parse_hang(value) == expected


def test_a_hang_point_blocks_the_thread_once_and_only_at_its_point(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cp, "_hang", cp._HangState())
    monkeypatch.setenv(cp.HANG_ENV, "after-spawn:0.2")
    monkeypatch.delenv(cp.CRASH_ENV, raising=False)
    caplog.set_level(logging.WARNING, logger=cp.__name__)

    def timed(point: str) -> float:
        began = time.monotonic()
        cp.crashpoint(point)
        return time.monotonic() - began

    assert timed("after-commit-journaled") < 0.2
    assert timed("after-spawn") >= 0.2
    assert timed("after-spawn") < 0.2
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "hang point reached, blocking point=after-spawn seconds=0.2",
        "hang point over, going on point=after-spawn seconds=0.2",
    ]


def test_a_malformed_hang_point_arms_nothing_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cp, "_hang", cp._HangState())
    monkeypatch.setenv(cp.HANG_ENV, "after-spawn:forever")
    caplog.set_level(logging.WARNING, logger=cp.__name__)
    began = time.monotonic()
    cp.crashpoint("after-spawn")
    cp.crashpoint("after-spawn")
    assert time.monotonic() - began < 0.2
    (record,) = caplog.records
    assert "hang point not armed variable=TUNEPLANE_HANGPOINT value=after-spawn:forever" in (
        record.getMessage()
    )
