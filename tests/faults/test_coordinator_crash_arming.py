"""How ``TUNEPLANE_CRASHPOINT`` arms a crash point (agent/crashpoint.py), for the agent and the
coordinator alike: ``<point>`` or ``<point>@<n>``, anything else arms nothing and says so once,
the crash line names what the caller handed it, and every listed point is reached somewhere."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tuneplane.agent import crashpoint as cp

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("after-spawn", cp.CrashPoint("after-spawn", 1)),
        ("mid-heartbeat-batch", cp.CrashPoint("mid-heartbeat-batch", 1)),
        ("mid-heartbeat-batch@3", cp.CrashPoint("mid-heartbeat-batch", 3)),
        (f"after-commit-decided@{cp.MAX_NTH}", cp.CrashPoint("after-commit-decided", cp.MAX_NTH)),
        ("no-such-point", None),
        ("no-such-point@2", None),
        ("after-spawn@", None),
        ("after-spawn@0", None),
        ("after-spawn@-1", None),
        ("after-spawn@two", None),
        ("after-spawn@²", None),
        (f"after-spawn@{cp.MAX_NTH + 1}", None),
        ("after-spawn:2", None),
    ],
)
def test_a_crash_point_is_a_known_point_and_maybe_which_reach(
    value: str, expected: cp.CrashPoint | None
) -> None:
    assert cp.parse_crash(value) == expected


def test_the_agent_and_the_coordinator_name_different_points() -> None:
    assert not cp.AGENT_POINTS & cp.COORDINATOR_POINTS
    assert cp.POINTS == cp.AGENT_POINTS | cp.COORDINATOR_POINTS


@pytest.mark.parametrize(
    ("folder", "points"), [("agent", cp.AGENT_POINTS), ("coordinator", cp.COORDINATOR_POINTS)]
)
def test_every_listed_point_is_reached_in_its_own_process(
    folder: str, points: frozenset[str]
) -> None:
    called: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        if path.name == "crashpoint.py":  # its docstring shows a call
            continue
        called |= set(re.findall(r'crashpoint\(\s*"([a-z-]+)"', path.read_text(encoding="utf-8")))
    assert called == points


def _reach(point: str, times: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A real process that reaches ``point`` ``times`` times, printing each reach it survives."""
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from tuneplane.agent.crashpoint import crashpoint\n"
        f"for reach in range(1, {times} + 1):\n"
        f"    crashpoint({point!r}, beats={{'node-b': 20, 'node-a': 10}}, attempt=reach)\n"
        "    print(reach, flush=True)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_process_dies_at_the_nth_reach_naming_what_it_held() -> None:
    env = {"PATH": "/usr/bin:/bin", cp.CRASH_ENV: "mid-heartbeat-batch@3"}
    done = _reach("mid-heartbeat-batch", 5, env)
    assert done.returncode == 137, done
    assert done.stdout.split() == ["1", "2"]
    assert (
        "crash point reached, exiting point=mid-heartbeat-batch reached=3 "
        "beats=node-a:10,node-b:20 attempt=3"
    ) in done.stderr


def test_another_points_name_or_no_name_never_kills() -> None:
    for env in ({cp.CRASH_ENV: "after-commit-decided"}, {}):
        done = _reach("mid-heartbeat-batch", 3, {"PATH": "/usr/bin:/bin", **env})
        assert done.returncode == 0, done
        assert done.stdout.split() == ["1", "2", "3"]
        assert "not armed" not in done.stderr


def test_a_value_that_names_no_point_arms_nothing_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cp, "_crash", cp._CrashState())
    monkeypatch.setenv(cp.CRASH_ENV, "mid-heartbeat-batch@soon")
    monkeypatch.delenv(cp.HANG_ENV, raising=False)
    caplog.set_level(logging.WARNING, logger=cp.__name__)
    for _ in range(3):
        cp.crashpoint("mid-heartbeat-batch")
    (record,) = caplog.records
    assert record.getMessage() == (
        "crash point not armed variable=TUNEPLANE_CRASHPOINT value=mid-heartbeat-batch@soon "
        f"reason=it is not {cp.CRASH_FORM}"
    )
