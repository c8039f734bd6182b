"""A rolling upgrade from the previous tagged release, as docs/operator.md ("Upgrades and
version skew") tells an operator to do it: two coordinators of the previous release lead and
stand by on one PostgreSQL store, with a Node of the previous release running a member. The
standby is upgraded, the leader stopped (the upgraded standby takes over, and welcomes the old
agent: within the policy), the old leader upgraded as a standby, then the agent upgraded in
place. The member keeps running throughout, is started once, and its Job succeeds."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.agent.jobs import job
from tests.faults.coordinator_crashes import members_on, spawns
from tests.faults.jobs import project, submit, wait_state
from tests.support.agent import start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, admin_argv, start_coordinator
from tests.support.ha import copy_state_dir, free_ports, wait_listed
from tests.support.release import current_version, previous_release
from tests.support.store_backend import current
from tuneplane.proto.contract import control_protocol as protocol

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: The member runs until the test lets it end: through every step of the upgrade.
UNTIL_FLAG = 'while [ ! -e "{flag}" ]; do sleep 0.2; done\necho finished\n'


@pytest.mark.usefixtures("pg_backend")
def test_a_rolling_upgrade_from_the_previous_release_keeps_its_member_running_once(
    tmp_path: Path,
) -> None:
    old = previous_release()
    ports = free_ports(6)
    ports_a, ports_b = (ports[0], ports[1], ports[2]), (ports[3], ports[4], ports[5])
    dir_a, dir_b = tmp_path / "a" / "coordinator", tmp_path / "b" / "coordinator"
    subprocess.run(
        [*old.prefix, *admin_argv("init", "--state-dir", str(dir_a), *current().init_args())],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    running: list[CoordinatorProcess] = []
    agent = None
    try:
        a = start_coordinator(tmp_path / "a", prefix_argv=old.prefix, ports=ports_a)
        running.append(a)
        copy_state_dir(dir_a, dir_b)
        b = CoordinatorProcess(dir_b, list(a.serve_args), old.prefix)
        b.start(ports_b, standby=True)
        running.append(b)
        wait_listed(a, 2)
        agent = start_agent(tmp_path, a, "node-a", prefix_argv=old.prefix)
        agent.wait_connected()
        # The Welcome named both; node.json is stored right after the status says connected.
        wait_until(
            "the Node to keep both coordinators",
            lambda: (
                json.loads((agent.state_dir / "node.json").read_text())["coordinators"]
                == [a.control, f"127.0.0.1:{ports_b[1]}"]
            ),
        )
        assert f"control stream opened node={agent.node_id} agent={old.version}" in a.read_log()
        flag = tmp_path / "finish"
        root = project(a, tmp_path / "proj", "custom/custom",
                       {"train.sh": UNTIL_FLAG.format(flag=flag)})  # fmt: skip
        run_id = submit(a, root, "h200:1")
        wait_state(a, run_id, "running", timeout=60)
        (member,) = members_on(agent)

        # 1. The standby: stopped, and the new release serves its state directory and ports.
        b.stop()
        running.remove(b)
        b = CoordinatorProcess(dir_b, list(a.serve_args))
        b.start(ports_b, standby=True)
        running.append(b)
        # 2. The leader stops (resigning its lease): the upgraded standby takes over and
        #    welcomes the old agent, one protocol older: within the policy.
        a.stop()
        running.remove(a)
        b.wait_leading(timeout=60)
        b.wait_log(f"control stream opened node={agent.node_id} agent={old.version} "
                   f"protocol={protocol.UNVERSIONED}", timeout=60)  # fmt: skip
        # 3. The old leader, upgraded, stands by.
        a = CoordinatorProcess(dir_a, list(b.serve_args))
        a.start(ports_a, standby=True)
        running.append(a)
        assert job(b, run_id)["state"] == "running"
        # 4. The agent, upgraded in place: its member is not touched.
        agent.prefix_argv = ()
        agent.restart()
        status = agent.wait_connected(timeout=60)
        assert (status["agent_version"], status["protocol"]) == (
            current_version(),
            protocol.PROTOCOL,
        )
        assert status["coordinator_protocol"] == protocol.PROTOCOL
        assert status["coordinator_version"] == current_version()
        b.wait_log(f"control stream opened node={agent.node_id} agent={current_version()} "
                   f"protocol={protocol.PROTOCOL}", timeout=60)  # fmt: skip
        (still,) = members_on(agent)
        assert still["state"] == "running", still
        shown = agent.cli("status")
        assert shown.returncode == 0, shown.stderr
        assert (
            f"versions: agent {current_version()} (control protocol {protocol.PROTOCOL}), "
            f"coordinator {current_version()} (control protocol {protocol.PROTOCOL})"
        ) in shown.stdout

        flag.write_text("")
        done = wait_until(
            "the Job to end",
            lambda: (j := job(b, run_id))["state"] in ("succeeded", "failed") and j,
            timeout=90,
        )
        assert done["state"] == "succeeded" and len(done["attempts"]) == 1, done
        assert spawns(agent, str(member["member"])) == 1
    finally:
        if agent is not None and agent.alive():
            agent.stop()
        for coord in running:
            coord.kill()
