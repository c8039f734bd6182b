"""Takeover figures: kill -9 the leading coordinator and time how soon the Fleet is served again.

Two real ``tuneplane-coordinator serve`` processes share one database on an embedded PostgreSQL
(the one ``tuneplane demo --store postgresql`` uses), set up as docs/operator.md says (the second
state directory holds copies of the first one's ``tls/``, ``coordinator.toml``, ``admin.token``).
Many Nodes, enrolled for real, hold Connect streams from a few load processes
(``bench/_takeover_load.py``) that dial as the real agent does: every coordinator's address in
turn, the agent's jittered backoff between rounds, cut short by a TCP probe.

Each repetition SIGKILLs whichever coordinator leads and measures, from the kill:
- **leads**: the other one's ``endpoints.json`` names its pid (all its listeners accept);
- **admission**: a Preview + Commit succeeds through the API, asked as ``tp`` asks (every API
  address in turn, ``tp``'s jittered pause after a whole round; :mod:`tuneplane.coordinator.cli.
  failover`), started at the kill;
- **Nodes back**: every Node has been welcomed again (the reconnect storm: p50 and all).
The killed one is started again on its own ports as the new standby, and the next kill hits the
other once every Node is back (a series whose Nodes are not all back within four WAIT_S stops:
the next figures would measure the tail of this storm). The baseline, in the same run on the
same Fleet: one coordinator (the standby stopped) killed and restarted on the same ports, which
is what a site without a standby gets from a supervisor that restarts it at once. The last table
gives takeover / restart and takeover / the lease's ttl_s.

Knobs: ``TUNEPLANE_BENCH_TAKEOVER_NODES`` (1000), ``TUNEPLANE_BENCH_TAKEOVER_RUNS`` kills of each
kind (3), ``TUNEPLANE_BENCH_LOADERS`` load processes (2).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tuneplane.coordinator.demo import postgres as embedded
from tuneplane.coordinator.leadership import LeaseSettings

from ._takeover_clients import Admission, enroll

ADMIN = [sys.executable, "-m", "tuneplane.coordinator.cli.admin"]
SHARED = ("tls", "coordinator.toml", "admin.token")
START_S = 60.0
WAIT_S = 120.0


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class Serve:
    """One coordinator's state directory and its ``serve`` process (none until started)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.log_path = state_dir.parent / f"{state_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports = (0, 0, 0)
        self.api = self.control = ""

    def start(self) -> None:
        """Start ``serve`` on this directory's ports (free ones the first time)."""
        api, control, telemetry = (str(p) for p in self.ports)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    *ADMIN, "serve", "--state-dir", str(self.state_dir), "--api-port", api,
                    "--control-port", control, "--telemetry-port", telemetry,
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def leading(self) -> bool:
        """Whether it leads: its endpoints.json names its pid (all its listeners accept)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"serve exited with {self.proc.returncode}; see {self.log_path}")
        try:
            data = json.loads((self.state_dir / "endpoints.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(data.get("pid") == self.proc.pid)

    def stand_by(self) -> None:
        """Start it while another leads; returns once it logged that it stands by."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.start()
        proc = self.proc
        assert proc is not None

        def standing_by() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}; see {self.log_path}")
            return "standing by" in self.log_path.read_text(errors="replace")[offset:]

        _until(f"{self.state_dir.name} standing by", standing_by)

    def learn_addresses(self) -> None:
        """Its advertised addresses and ports, from the roll call (``status --json``)."""
        assert self.proc is not None
        done = subprocess.run(
            [*ADMIN, "status", "--json", "--state-dir", str(self.state_dir)],
            check=False, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"tuneplane-coordinator status failed: {done.stderr.strip()}")
        rows = json.loads(done.stdout)["coordinators"]
        mine = next(r for r in rows if r["pid"] == self.proc.pid)
        self.api, self.control = mine["api_address"], mine["control_address"]
        api, control, telemetry = (
            int(mine[k].rpartition(":")[2])
            for k in ("api_address", "control_address", "telemetry_address")
        )
        self.ports = (api, control, telemetry)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _until(what: str, check: Any, timeout: float = START_S) -> float:
    """Poll ``check()`` until true; the monotonic time it first was."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.005)
    return time.monotonic()


def lead_and_stand_by(first: Serve, second: Serve) -> None:
    """Start ``first`` until it leads, then ``second`` until it stands by."""
    first.start()
    _until("the first coordinator leading", first.leading)
    first.learn_addresses()
    second.stand_by()
    second.learn_addresses()


def _kill_and_time(
    killed: Serve,
    successor: Serve,
    loaders: list[subprocess.Popen[str]],
    apis: list[str],
    ca: Path,
    token: str,
) -> dict[str, float]:
    """Kill ``killed``, wait for ``successor`` to lead (it may be ``killed`` restarted), the
    admission and every Node; seconds from the kill."""
    admission = Admission(apis, ca, token)
    killed.kill()
    at = time.monotonic()
    admission.start()
    if successor is killed:
        killed.start()
    leads = _until("the successor leading", successor.leading) - at
    admission.join(WAIT_S + 15)
    if admission.said:
        print(f"    no admission within {WAIT_S:.0f} s; the last try said {admission.said}")
    reports = _ask(loaders, at)
    missing = sum(r["missing"] for r in reports)
    # A Node not back counts as never: half of them must be back for a p50.
    never = [math.inf] * missing
    back = sorted([t for r in reports for t in r["back_s"]] + never)
    through = sorted([t for r in reports for t in r["through_s"]] + never)
    failures: dict[str, int] = {}
    for r in reports:
        for kind, n in r["failures"].items():
            failures[kind] = failures.get(kind, 0) + n
    figures = {
        "leads": leads,
        "admission": admission.done_at - at,
        "nodes_p50": back[len(back) // 2],
        "nodes_all": back[-1],
        "through_p50": through[len(through) // 2],
        "dials": sum(r["dials"] for r in reports),
    }
    print(
        f"    leads {_s(leads)}, admission {_s(figures['admission'])}, Nodes back p50 "
        f"{_s(figures['nodes_p50'])} (their Connect through at p50 "
        f"{_s(figures['through_p50'])}), all {_s(figures['nodes_all'])}"
        f"{f' ({missing} not back within {WAIT_S:.0f} s)' if missing else ''}; "
        f"{figures['dials']} dials ("
        f"{', '.join(f'{k} {v}' for k, v in sorted(failures.items())) or 'none failed'})"
    )
    figures["settled"] = float(_settle(loaders, at, missing))
    return figures


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if math.isfinite(seconds) else "never"


def _ask(loaders: list[subprocess.Popen[str]], since: float) -> list[dict[str, Any]]:
    """Every load process's report on its Nodes welcomed after ``since`` (each waits until all
    are, or :data:`WAIT_S`)."""
    for p in loaders:
        assert p.stdin is not None
        p.stdin.write(f"since {since}\n")
        p.stdin.flush()
    reports = []
    for p in loaders:
        assert p.stdout is not None
        reports.append(json.loads(p.stdout.readline()))
    return reports


def _settle(loaders: list[subprocess.Popen[str]], at: float, missing: int) -> bool:
    """Whether every Node is back, waiting up to three more :data:`WAIT_S` for the last ones:
    a next kill before then would measure this storm's tail."""
    for _ in range(3):
        if not missing:
            return True
        missing = sum(r["missing"] for r in _ask(loaders, at))
        if not missing:
            print(f"    every Node was back {time.monotonic() - at:.0f} s after that kill")
    if missing:
        print(f"    {missing} Nodes were still not welcomed again {4 * WAIT_S:.0f} s after that "
              "kill: no more kills on this Fleet")  # fmt: skip
    return not missing


def _start_loaders(
    root: Path, controls: list[str], ca: Path, nodes: list[dict[str, str]], count: int
) -> list[subprocess.Popen[str]]:
    procs = []
    for k in range(count):
        mine = nodes[k::count]
        config = root / f"load-{k}.json"
        config.write_text(
            json.dumps(
                {
                    "controls": controls,
                    "ca": str(ca),
                    # grpclib's server allows 100 concurrent streams per HTTP/2 connection.
                    "channels": max(2, -(-len(mine) // 90)),
                    "nodes": mine,
                    "wait_s": WAIT_S,
                }
            )
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench._takeover_load", str(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        line = p.stdout.readline() if p.stdout else ""
        if not line.startswith("ready"):
            raise RuntimeError(f"a load process failed before it was ready: {line!r}")
    return procs


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def bench_takeover(root: Path, url: str, count: int, runs: int, loaders: int) -> bool:
    """Both series and the table; whether every kill's Nodes all came back."""
    a, b = Serve(root / "a"), Serve(root / "b")
    subprocess.run([*ADMIN, "init", "--state-dir", str(a.state_dir), "--store", url], check=True,
                   capture_output=True)  # fmt: skip
    config = a.state_dir / "coordinator.toml"
    # Admitted bench Jobs wait in a Fleet with no Nodes; every Node enrolls from one address.
    config.write_text(config.read_text() + '\n[profiles.bench]\nseries = "h200"\nfleet = "empty"\n'
                      "\n[limits]\nenroll_burst = 0\n")  # fmt: skip
    subprocess.run([*ADMIN, "fleet", "create", "empty", "--state-dir", str(a.state_dir)],
                   check=True, capture_output=True)  # fmt: skip
    b.state_dir.mkdir(mode=0o700)
    for name in SHARED:
        copy = shutil.copytree if (a.state_dir / name).is_dir() else shutil.copy2
        copy(a.state_dir / name, b.state_dir / name)
    ca = a.state_dir / "tls" / "ca.pem"
    token = (a.state_dir / "admin.token").read_text().strip()
    procs: list[subprocess.Popen[str]] = []
    try:
        lead_and_stand_by(a, b)
        started = time.monotonic()
        nodes = asyncio.run(enroll(url, a.control, ca, count))
        procs = _start_loaders(root, [a.control, b.control], ca, nodes, loaders)
        print(f"  {count} Nodes enrolled and streaming in {time.monotonic() - started:.1f} s")
        apis = [a.api, b.api]
        print(f"  takeover (kill -9 of the leader; the standby leads), {runs} kills:")
        leader, standby = a, b
        took: list[dict[str, float]] = []
        restarted: list[dict[str, float]] = []
        while len(took) < runs and all(r["settled"] for r in took):
            took.append(_kill_and_time(leader, standby, procs, apis, ca, token))
            leader.stand_by()  # on its own ports: the new standby
            leader, standby = standby, leader
        standby.stop()
        if took[-1]["settled"]:
            print(f"  restart (baseline: one coordinator, kill -9 and serve again at once), "
                  f"{runs}:")  # fmt: skip
        while (
            took[-1]["settled"] and len(restarted) < runs and all(r["settled"] for r in restarted)
        ):
            restarted.append(_kill_and_time(leader, leader, procs, apis, ca, token))
        _report(_medians(took), _medians(restarted) if restarted else None)
        return all(r["settled"] for r in took + restarted)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    p.communicate("stop\n", timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        a.stop()
        b.stop()


def _report(took: dict[str, float], restarted: dict[str, float] | None) -> None:
    """The medians side by side (the restart column "-" when the baseline was not run)."""
    ttl = LeaseSettings().ttl_s
    print("\n  medians, seconds from the kill   takeover    restart   takeover/restart")
    names = {
        "leads": "a coordinator leads",
        "admission": "an admission succeeds",
        "through_p50": "half the Nodes' Connects through",
        "nodes_p50": "half the Nodes welcomed again",
        "nodes_all": "every Node welcomed again",
    }
    for key, label in names.items():
        base = restarted[key] if restarted is not None else math.nan
        ratio = took[key] / base if base else math.nan
        print(f"  {label:<32} {took[key]:>8.2f} {base:>10.2f} {ratio:>12.2f}")
    print(f"  takeover against the lease's ttl_s ({ttl:g} s): leads at {took['leads'] / ttl:.2f} "
          f"of it, every Node back at {took['nodes_all'] / ttl:.2f}")  # fmt: skip


def main() -> int:
    count = env_int("TUNEPLANE_BENCH_TAKEOVER_NODES", 1000)
    runs = env_int("TUNEPLANE_BENCH_TAKEOVER_RUNS", 3)
    loaders = env_int("TUNEPLANE_BENCH_LOADERS", 2)
    print(f"takeover: two coordinators on an embedded PostgreSQL, {count} Nodes following:")
    with tempfile.TemporaryDirectory(prefix="tp-bench-takeover-") as tmp:
        server = embedded.start(Path(tmp))
        try:
            settled = bench_takeover(Path(tmp), server.url, count, runs, loaders)
        finally:
            server.stop()
        if not settled:
            kept = Path(tempfile.mkdtemp(prefix="tp-bench-takeover-logs-"))
            for log in Path(tmp).glob("*.log"):
                shutil.copy2(log, kept / log.name)
            print(f"  Nodes did not all come back; the coordinators' logs are kept in {kept}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
