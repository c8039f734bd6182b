"""No process the agent starts can speak to systemd as the agent.

systemd accepts notifications from the main process only (``NotifyAccess=main`` in the unit,
checked in tests/packaging), and the agent takes ``NOTIFY_SOCKET``/``WATCHDOG_*`` out of its
environment before it starts anything. Attacked here as a workload would: the agent runs with an
abstract notify socket (no file permissions guard it: anyone who knows the name can send), and
the workload looks for the name in its environment and, if it finds it, forges READY and STATUS.
The test asserts the name reached no workload, runner or collector, that every notification
came from the agent's own pid, and that the Job and the agent were not disturbed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent.jobs import journal, submit
from tests.faults.jobs import wait_state
from tests.support.agent import start_agent, wait_until
from tests.support.coordinator import start_coordinator
from tests.support.datagrams import DatagramInbox, notify_fields
from tuneplane.agent.sd_notify import NOTIFY_VARIABLES

pytestmark = pytest.mark.slow

_FORGE = """
import os, socket
name = os.environ.get("NOTIFY_SOCKET")
if name:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = "\\0" + name[1:] if name[0] == "@" else name
    s.sendto(b"READY=1\\nSTATUS=forged by a workload\\n", address)
"""


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


@pytest.mark.timeout(300)
def test_no_child_of_the_agent_learns_the_notify_socket(tmp_path: Path) -> None:
    release = tmp_path / "release"
    name = f"@tuneplane-test-notify-{tmp_path.name}"
    coordinator = start_coordinator(tmp_path)
    with DatagramInbox(name) as inbox:
        agent = start_agent(
            tmp_path, coordinator, env={"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "400000"}
        )
        try:
            agent.wait_connected()
            script = (
                'env > "$TUNEPLANE_OUT_DIR/env.txt"\n'
                f"python3 -c '{_FORGE}'\n"
                'touch "$TUNEPLANE_OUT_DIR/tried"\n'
                f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
            )
            run_id = submit(coordinator, tmp_path / "job", script)
            wait_state(coordinator, run_id, "running")
            tried = wait_until(
                "the workload's attempt", lambda: next(agent.out_root.rglob("tried"), None)
            )
            workload_env = (tried.parent / "env.txt").read_text()
            (member,) = journal(agent, "members", "--json")
            runner = json.loads((Path(member["member_dir"]) / "runner.json").read_text())

            def collector() -> int | None:
                return next(iter(agent.collector_pids()), None)

            collector_pid = wait_until("the member's collector", collector)
            # The setup is real: the agent itself was started with the variables.
            assert _environ(agent.pid)["NOTIFY_SOCKET"] == name
            for variable in NOTIFY_VARIABLES:
                assert f"{variable}=" not in workload_env, workload_env
                assert variable not in _environ(int(runner["pid"])), "the runner inherited it"
                assert variable not in _environ(collector_pid), "the collector inherited it"
            inbox.wait_for(
                "READY=1", lambda got: any("READY" in notify_fields(d.data) for d in got)
            )
            inbox.wait_for("watchdog pings", lambda got: len(got) >= 4)
            # Nothing changed: every notification is the agent's, the Job runs, the agent lives.
            assert {d.sender_pid for d in inbox.received} == {agent.pid}
            assert not any(b"forged" in d.data for d in inbox.received)
            assert agent.alive()
            wait_state(coordinator, run_id, "running")
            release.write_text("go")
            wait_state(coordinator, run_id, "succeeded", timeout=60)
        finally:
            release.write_text("go")
            if agent.alive():
                agent.stop()
            coordinator.stop()
