"""Only the Node's operator can make the agent let go of NVML.

`tuneplane-node gpu release` marks every GPU of the Node unhealthy for minutes: a workload that
could trigger it could stop the Node taking work. The request is a file in the state directory
(0700, root), so a workload's account is refused by the kernel whether it runs the command or
writes the file itself. The test runs a real coordinator and agent (scripted NVML) and checks,
after each refusal, that nothing changed: no request file, NVML still held (the scripted NVML's
call log shows no shutdown), and both GPUs still healthy in the agent's status.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

from tests.support import accounts
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import start_coordinator
from tuneplane.agent.inventory_source import RELEASE_REQUEST
from tuneplane.agent.scripted_nvml import write_script

UUIDS = ("GPU-0a0a0a0a-1111-2222-3333-444444444444", "GPU-1b1b1b1b-1111-2222-3333-444444444444")
# The test interpreter lives under /root, which an account cannot enter: the account runs the
# system's python of the same version with this environment's packages (read-only to it).
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
AS_ACCOUNT = (
    "import runpy, site, sys; site.addsitedir(sys.argv.pop(1)); "
    "runpy.run_module('tuneplane.agent.cli', run_name='__main__')"
)
WRITE_REQUEST = "import sys; open(sys.argv[1], 'w').write('{\"until_ms\": 99999999999999}')"


def as_account(name: str, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The system's python run as the account ``name`` (no groups, a bare environment)."""
    return subprocess.run(
        [str(SYSTEM_PYTHON), *args],
        user=name, group=name, extra_groups=[], capture_output=True, text=True, timeout=60,
        check=False, cwd=root, env={"PATH": os.environ["PATH"], "HOME": str(root)},
    )  # fmt: skip


def healthy(agent: AgentProcess) -> bool:
    gpus = agent.status().get("inventory", {}).get("gpus", [])
    return len(gpus) == 2 and all(g["healthy"] for g in gpus)


def test_a_workload_account_cannot_release_nvml(tmp_path: Path) -> None:
    accounts.require_root()
    accounts.require(SYSTEM_PYTHON.exists(), f"{SYSTEM_PYTHON} to run the CLI as an account")
    (name,) = accounts.make_pool(1)
    # Like /var/lib: a folder accounts can pass through, holding the 0700 state directory.
    root = accounts.traversable_root("nvml-release")
    script = tmp_path / "nvml.json"
    calls = tmp_path / "calls.log"
    write_script(script, {"calls_log": str(calls), "gpus": [{"uuid": u} for u in UUIDS]})
    with start_coordinator(tmp_path / "coord") as coord:
        agent = start_agent(
            root, coord, "node-a", simulate_gpus=None,
            run_args=("--scripted-nvml", str(script), "--inventory-interval", "0.3"),
        )  # fmt: skip
        try:
            agent.wait_connected()
            wait_until("both GPUs healthy", lambda: healthy(agent))
            request = agent.state_dir / RELEASE_REQUEST
            before = len(calls.read_text().splitlines())  # (enroll's own read is in it too)
            done = as_account(
                name, root,
                "-c", AS_ACCOUNT, site.getsitepackages()[0], "gpu", "release", "--minutes",
                "240", "--state-dir", str(agent.state_dir),
            )  # fmt: skip
            assert done.returncode == 2, (done.stdout, done.stderr)
            assert f"Directory '{agent.state_dir}' is not readable" in done.stderr
            assert "Traceback" not in done.stderr
            wrote = as_account(name, root, "-c", WRITE_REQUEST, str(request))
            assert wrote.returncode == 1 and "PermissionError" in wrote.stderr
            # Nothing changed: no request, NVML still held, the GPUs still offered.
            assert not request.exists()
            # A harmless change the agent can only see by probing again after the attempts.
            renamed = [{"uuid": u, "name": "NVIDIA H200 NVL"} for u in UUIDS]
            write_script(script, {"calls_log": str(calls), "gpus": renamed})
            wait_until(
                "the agent to probe again",
                lambda: (
                    [g["name"] for g in agent.status()["inventory"]["gpus"]]
                    == ["NVIDIA H200 NVL"] * 2
                ),
            )
            log = [ln.split()[0] for ln in calls.read_text().splitlines()[before:]]
            assert log == []  # no shutdown, no event set freed, no init again
            assert healthy(agent)
        finally:
            agent.stop()
