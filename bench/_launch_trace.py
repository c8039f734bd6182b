"""Where a launch's time goes: each durable step of one Job, in ms after submit, read back from
what the processes recorded (the coordinator's decision log, the agent's journal, the runner's
``runner.json`` and ``exit.json``). Printed by ``bench agent`` for the 1-process size as medians
over its runs, so a change can be aimed at the step that costs (issue 13's "profile first").

Rules: only reads, after the Job ended; each database is opened read-only beside the process
that owns it (SQLite in WAL mode allows it). A step absent from a run is left out of its median.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
from collections.abc import Iterable
from pathlib import Path


def _rows(db: Path, sql: str, args: tuple[object, ...]) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def job_steps(
    run_id: str,
    submitted_s: float,
    coordinator_db: Path,
    agents: Iterable[tuple[str, Path]],
    boot_skew: float,
) -> dict[str, float]:
    """``step name -> ms after submit`` for Job ``run_id``'s first attempt (the first time each
    step was recorded); ``boot_skew`` makes a kernel start time wall-clock time."""
    steps: dict[str, float] = {}

    def put(name: str, at_ms: float) -> None:
        steps.setdefault(name, at_ms - submitted_s * 1000)

    for at_ms, kind in _rows(
        coordinator_db,
        "SELECT at_ms, kind FROM decisions WHERE run_id = ? ORDER BY id",
        (run_id,),
    ):
        put(f"coordinator: {kind}", float(str(at_ms)))
    for name, state_dir in agents:
        for at_ms, kind, to_state in _rows(
            state_dir / "journal.db",
            "SELECT at_ms, kind, coalesce(to_state, '') FROM events "
            "WHERE member_key LIKE ? ORDER BY id",
            (f"{run_id}.1.%",),
        ):
            put(f"{name}: {kind}{f' -> {to_state}' if to_state else ''}", float(str(at_ms)))
        for member in sorted((state_dir / "members").glob(f"{run_id}.1.*")):
            runner = member / "runner.json"
            if runner.exists():
                record = json.loads(runner.read_text())
                # Kernel start times (10 ms granular) made wall-clock by ``boot_skew``.
                put(f"{name}: runner process started", (record["start_time"] + boot_skew) * 1000)
                starts = [p["start_time"] for p in record["processes"]]
                if starts:
                    put(f"{name}: last local process started", (max(starts) + boot_skew) * 1000)
                put(f"{name}: runner.json written", runner.stat().st_mtime * 1000)
            exit_record = member / "exit.json"
            if exit_record.exists():
                finished = json.loads(exit_record.read_text())["finished_at"]
                put(f"{name}: exit.json finished_at (runner)", finished * 1000)
    return steps


def trace_lines(runs: list[dict[str, float]]) -> list[str]:
    """Median ms after submit of every step, in the order of those medians."""
    names = {name for run in runs for name in run}
    medians = {name: statistics.median(run[name] for run in runs if name in run) for name in names}
    lines = [f"  where the time goes (median ms after submit, {len(runs)} runs):"]
    previous = 0.0
    for name in sorted(names, key=lambda n: medians[n]):
        counted = sum(1 for run in runs if name in run)
        also = "" if counted == len(runs) else f" (in {counted} runs)"
        lines.append(f"    {medians[name]:7.1f}  (+{medians[name] - previous:5.1f})  {name}{also}")
        previous = medians[name]
    return lines
