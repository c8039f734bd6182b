"""Coordinators and a Node on hosts of their own; the leader's cable is pulled.

Hosts (network namespaces, tests/support/netns.py): ``db`` (PostgreSQL, reached over TCP: a
real proxy process there forwards port 5432 to the test server's Unix socket), ``coord-a``,
``coord-b`` and ``node-a``. Cutting coord-a's link cuts it from the database and the Node at
once, as a pulled cable does: its database session stays open on the far side, so the standby
takes over only when the lease expires; the old leader, unable to renew, steps down by itself
before that (it stops acting once its lease may be gone), and when the cable is back it stands by
under the new leader. The Node, whose stream went silent, finds the new leader; the Job running
meanwhile succeeds, once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from tests.support.agent import start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess
from tests.support.ha import copy_state_dir, wait_listed
from tests.support.netns import Host, open_network, require_netns
from tests.support.postgres import PostgresServer
from tests.support.store_backend import StoreBackend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROXY = r"""
import asyncio, sys
port, path = int(sys.argv[1]), sys.argv[2]

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()

async def serve(reader, writer):
    up_reader, up_writer = await asyncio.open_unix_connection(path)
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

async def main():
    server = await asyncio.start_server(serve, "0.0.0.0", port)
    print("listening", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""
LEASE = "\n[leader]\nttl_s = 5\nrenew_s = 1\npoll_s = 0.5\n"
SERVE = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "3", "--host", "0.0.0.0"]


def _socket_path(server: PostgresServer) -> str:
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(server.admin_url).query)
    port = urllib.parse.urlsplit(server.admin_url).port or 5432
    return f"{query['host'][0]}/.s.PGSQL.{port}"


def _admin(host: Host, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        host.argv(sys.executable, "-m", "tuneplane.coordinator.cli.admin", *args),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _tp(host: Host, coord: CoordinatorProcess, *args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(
        host.argv(sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context",
                  str(coord.context_path), *args),
        cwd=cwd, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_leaders_cable_pulled_the_standby_leads_and_the_healed_leader_stands_by(
    tmp_path: Path, pg_backend: StoreBackend, postgres_server: PostgresServer
) -> None:
    require_netns("to put the database, each coordinator and the Node on hosts of their own")
    database = urllib.parse.urlsplit(pg_backend.url()).path.lstrip("/")
    with open_network(["db", "coord-a", "coord-b", "node-a"]) as net:
        db, host_a, host_b = net.host("db"), net.host("coord-a"), net.host("coord-b")
        proxy = subprocess.Popen(
            db.argv(sys.executable, "-c", PROXY, "5432", _socket_path(postgres_server)),
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        coords: list[CoordinatorProcess] = []
        agent = None
        try:
            assert proxy.stdout is not None and proxy.stdout.readline().strip() == "listening"
            url = f"postgresql://postgres@db:5432/{database}"
            dir_a = tmp_path / "a" / "coordinator"
            init = _admin(host_a, "init", "--state-dir", str(dir_a), "--store", url)
            assert init.returncode == 0, init.stderr
            with open(dir_a / "coordinator.toml", "a", encoding="utf-8") as toml:
                toml.write(LEASE)
            old = CoordinatorProcess(dir_a, [*SERVE, "--advertise", "coord-a"], host_a.prefix())
            coords.append(old)
            old.start()
            dir_b = tmp_path / "b" / "coordinator"
            copy_state_dir(dir_a, dir_b)
            new = CoordinatorProcess(dir_b, [*SERVE, "--advertise", "coord-b"], host_b.prefix())
            coords.append(new)
            new.start(standby=True)
            wait_listed(old, 2)
            assert old.control.startswith("coord-a:")

            node_host = net.host("node-a")
            agent = start_agent(tmp_path, old, "node-a", "h200:1", prefix_argv=node_host.prefix())
            agent.wait_connected()
            wait_until(
                "the Node to learn both coordinators",
                lambda: (
                    len(json.loads((agent.state_dir / "node.json").read_text())["coordinators"])
                    == 2
                ),
            )
            project = tmp_path / "proj"
            project.mkdir()
            _tp(host_a, old, "init", str(project), "--name", "cable", cwd=project)
            _tp(host_a, old, "new", "job", "--method", "custom/custom", cwd=project)
            (project / "experiments" / "job" / "train.sh").write_text("sleep 12\n")
            out = _tp(host_a, old, "submit", "job", "--profile", "h200:1", "--yes", "--json",
                      cwd=project)  # fmt: skip
            run_id = json.loads(out.strip().splitlines()[-1])["run_id"]
            wait_until(
                "the member to run",
                lambda: (
                    json.loads(_tp(host_a, old, "job", "show", run_id, "--json"))["state"]
                    == "running"
                ),
            )
            logged = len(old.read_log())

            host_a.cut()
            try:
                old.wait_log("stepped down", timeout=30, after=logged)
                new.wait_leading(timeout=30)
                wait_until(
                    "the Node to reach the new leader",
                    lambda: (
                        (s := agent.status()).get("connected")
                        and s.get("coordinator") == new.control
                    ),
                    timeout=60,
                )
                job = wait_until(
                    "the Job to end",
                    lambda: (
                        (j := json.loads(_tp(host_b, new, "job", "show", run_id, "--json")))[
                            "state"
                        ]
                        in ("succeeded", "failed", "cancelled")
                        and j
                    ),
                    timeout=90,
                )
                assert job["state"] == "succeeded" and len(job["attempts"]) == 1, job
            finally:
                host_a.heal()
            old.wait_log("standing by leader=", timeout=60, after=logged)
            status = _admin(host_b, "status", "--state-dir", str(dir_b), "--json")
            assert status.returncode == 0, status.stderr
            facts = json.loads(status.stdout)
            roles = sorted(c["role"] for c in facts["coordinators"] if not c["gone"])
            assert roles == ["leader", "standby"] and facts["term"] == 2, facts
            decided = _admin(host_b, "decisions", "--state-dir", str(dir_b), "--json")
            rows = [json.loads(line) for line in decided.stdout.splitlines() if line.strip()]
            takeovers = [r["detail"] for r in rows if r["kind"] == "coordinator took over"]
            assert [t["term"] for t in takeovers] == [1, 2]
            assert "did not renew" in takeovers[1]["why"], takeovers[1]
        finally:
            if agent is not None and agent.alive():
                agent.stop()
            for coord in coords:
                coord.kill()
            proxy.kill()
            proxy.wait()
