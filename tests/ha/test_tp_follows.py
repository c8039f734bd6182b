"""kill -9 the leading coordinator while ``tp`` holds both API addresses: the next ``tp`` call
passes the dead leader (its port refuses) and the standby while it takes over, and is answered
by the new leader within the ride-out. The time from the kill to that answer is printed (``-s``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.cli.tp_process import run_tp
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.ha import copy_state_dir, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.usefixtures("pg_backend")
def test_tp_follows_the_leader_through_a_kill_9(tmp_path: Path) -> None:
    leader = start_coordinator(tmp_path / "a")
    # The standby on ports chosen now, so tp can be told its API address before it leads.
    second = tmp_path / "b" / "coordinator"
    copy_state_dir(leader.state_dir, second)
    standby = CoordinatorProcess(second, list(leader.serve_args))
    api_port, control_port, telemetry_port = free_ports(3)
    standby.start((api_port, control_port, telemetry_port), standby=True)
    context = tmp_path / "tp-context.json"
    context.write_text(
        json.dumps(
            {
                "coordinator": leader.api,
                "api_addresses": [leader.api, f"127.0.0.1:{api_port}"],
                "ca": str(leader.ca_path),
                "token_file": str(leader.state_dir / "admin.token"),
            }
        )
    )
    env = {"TUNEPLANE_CONTEXT": str(context)}
    try:
        before = run_tp("job", "ls", "--json", cwd=tmp_path, env=env)
        assert before.returncode == 0, before.stderr
        leader.kill()
        killed = time.monotonic()
        after = run_tp("-v", "job", "ls", "--json", cwd=tmp_path, env=env)
        took = time.monotonic() - killed
        assert after.returncode == 0, after.stderr
        assert json.loads(after.stdout) == []
        assert f"address={leader.api} kind=unreachable" in after.stderr
        print(f"\ntp answered by the new leader {took:.2f} s after kill -9 of the old one")
        standby.wait_leading(timeout=30)
        assert standby.api == f"127.0.0.1:{api_port}"
    finally:
        standby.stop()
        leader.kill()
