"""What a runner leaves behind: ``launch.claim``, ``runner.json`` and ``exit.json``.

Rules: the runner is the only writer; each file is written whole (``durable``) so readers (the
agent, possibly after a restart) never see a partial record. ``exit.json`` is final: once it
exists the member has exited and nothing rewrites it. Stdlib only (ships inside ``runner.pyz``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .durable import read_json

CLAIM_FILE = "launch.claim"
RUNNER_FILE = "runner.json"
EXIT_FILE = "exit.json"
RUNNER_LOG = "runner.log"


class RecordError(ValueError):
    """A runner record exists but cannot be read; ``str()`` names the file and what is wrong."""


@dataclasses.dataclass(frozen=True)
class ProcessIdentity:
    """A started local process: pid, its process group and its start time (pid reuse guard)."""

    local_rank: int
    pid: int
    pgid: int
    start_time: float


@dataclasses.dataclass(frozen=True)
class RunnerRecord:
    """Who runs the member: the runner's pid and start time, and its local processes."""

    pid: int
    start_time: float
    processes: tuple[ProcessIdentity, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "start_time": self.start_time,
            "processes": [dataclasses.asdict(p) for p in self.processes],
        }


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """How one local process ended; ``error`` says why it never ran (exit_code 127 then)."""

    local_rank: int
    exit_code: int | None
    signal: int | None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class ExitRecord:
    """How the member ended: the first failure's exit code or signal, or 0 when all succeeded."""

    exit_code: int | None
    signal: int | None
    finished_at: float
    stop_reason: str | None
    processes: tuple[ProcessResult, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "signal": self.signal,
            "finished_at": self.finished_at,
            "stop_reason": self.stop_reason,
            "processes": [dataclasses.asdict(p) for p in self.processes],
        }


def _load(path: Path) -> dict[str, Any] | None:
    try:
        raw = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RecordError(f"{path} cannot be read as JSON: {exc}.") from None
    if not isinstance(raw, dict):
        raise RecordError(f"{path} does not hold a JSON object.")
    return raw


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) else None


def read_claim(member_dir: Path) -> tuple[int, float] | None:
    """The claiming runner's (pid, start time), or None when the launch is not claimed.

    Raises :class:`RecordError` when the claim exists but its content is unreadable (a runner
    that died between creating the claim and fsyncing it).
    """
    path = member_dir / CLAIM_FILE
    try:
        raw = _load(path)
        if raw is None:
            return None
        return int(raw["pid"]), float(raw["start_time"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"{path} exists but holds no runner identity ({exc}).") from None


def read_runner_record(member_dir: Path) -> RunnerRecord | None:
    """``runner.json``, or None before the runner has written it."""
    path = member_dir / RUNNER_FILE
    raw = _load(path)
    if raw is None:
        return None
    try:
        return RunnerRecord(
            pid=int(raw["pid"]),
            start_time=float(raw["start_time"]),
            processes=tuple(
                ProcessIdentity(
                    local_rank=int(p["local_rank"]),
                    pid=int(p["pid"]),
                    pgid=int(p["pgid"]),
                    start_time=float(p["start_time"]),
                )
                for p in raw["processes"]
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"{path} lacks a field or has a wrong one ({exc}).") from None


def read_exit_record(member_dir: Path) -> ExitRecord | None:
    """``exit.json``, or None while the member has not exited (or its runner vanished)."""
    path = member_dir / EXIT_FILE
    raw = _load(path)
    if raw is None:
        return None
    try:
        return ExitRecord(
            exit_code=_int_or_none(raw["exit_code"]),
            signal=_int_or_none(raw["signal"]),
            finished_at=float(raw["finished_at"]),
            stop_reason=raw.get("stop_reason"),
            processes=tuple(
                ProcessResult(
                    local_rank=int(p["local_rank"]),
                    exit_code=_int_or_none(p["exit_code"]),
                    signal=_int_or_none(p["signal"]),
                    error=p.get("error"),
                )
                for p in raw["processes"]
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"{path} lacks a field or has a wrong one ({exc}).") from None
