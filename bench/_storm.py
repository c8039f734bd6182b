"""The reconnect storm: how long after a coordinator comes back all its Nodes are welcomed again.

With every Node connected (``bench/_storm_load.py``, reconnecting as real agents do), the
coordinator is killed (-9, as a crash or a lost machine would end it) and served again on the
same ports and store. The figure is the time from the new coordinator's readiness (its
endpoints.json) until the last Node's new Welcome, and Hellos/s over it, beside the first
connect of the same Nodes to the same (live) coordinator in the same run: the ratio says what a
storm costs over Nodes arriving as fast as the load processes can dial.
"""

from __future__ import annotations

import json
import select
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .coordinator import Backend, Coordinator, Figures

#: How long the Nodes may take to all come back before the bench gives up on the figure.
STORM_TIMEOUT_S = 900.0
#: How long a storm load process may take to answer "go".
ARMED_TIMEOUT_S = 30.0

StartLoaders = Callable[..., list[subprocess.Popen[str]]]


def reconnect_storm(
    coord: Coordinator,
    root: Path,
    figures: Figures,
    backend: Backend,
    nodes: list[dict[str, str]],
    loaders: int,
    start_loaders: StartLoaders,
) -> None:
    count = len(nodes)
    started = time.perf_counter()
    procs = start_loaders(coord, root, "_storm_load", nodes, loaders)
    first_s = time.perf_counter() - started
    try:
        for p in procs:  # from now on an ended stream and the Welcome after it count
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            _armed(p)
        killed = time.time()
        ready = coord.restart()
        results = [_result(p) for p in procs]
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    storm_s = max(r["all_at"] for r in results) - ready
    first_back = min(r["first_at"] for r in results) - ready
    failed = sum(r["failed_dials"] for r in results)
    causes: dict[str, int] = {}
    for r in results:
        for cause, n in r.get("failed_by", {}).items():
            causes[cause] = causes.get(cause, 0) + n
    why = ", ".join(f"{n} {cause}" for cause, n in sorted(causes.items(), key=lambda c: -c[1]))
    print(
        f"reconnect storm: {count} Nodes connected ({count} first Welcomes in {first_s:.1f} s, "
        f"{count / first_s:.0f} Hellos/s); coordinator killed (-9) and served again on the same "
        f"ports and store: ready {ready - killed:.1f} s after the kill; all {count} welcomed "
        f"again {storm_s:.1f} s after it was ready ({count / storm_s:.0f} Hellos/s; first one "
        f"after {first_back:.2f} s; {failed} streams and dials failed meanwhile: {why}); "
        f"storm/first-connect time {storm_s / first_s:.2f}"
    )
    figures.add(f"reconnect storm: all {count} welcomed again (s)", backend, storm_s)
    figures.add(f"reconnect storm: Hellos/s, {count} Nodes", backend, count / storm_s)
    figures.add(f"first connect: Hellos/s, {count} Nodes", backend, count / first_s)


def _armed(proc: subprocess.Popen[str]) -> None:
    """Until the storm load process says it counts ended streams (its answer to "go")."""
    assert proc.stdout is not None
    ready = select.select([proc.stdout], [], [], ARMED_TIMEOUT_S)[0]
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "armed":
        raise RuntimeError(
            f'a storm load process did not answer "go" within {ARMED_TIMEOUT_S:g} s (it said '
            f"{line.strip()!r}, exit status {proc.poll()}); see its output above."
        )


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The JSON line a storm load process prints once all its Nodes are welcomed again."""
    assert proc.stdout is not None
    deadline = time.monotonic() + STORM_TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([proc.stdout], [], [], left)[0]:
            break
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            return result
    raise RuntimeError(
        f"a storm load process did not see all its Nodes welcomed again within "
        f"{STORM_TIMEOUT_S:g} s (exit status {proc.poll()}); see serve.log in the bench folder."
    )
