"""A GPU lost or hit by an XID while a member runs on it, with real processes end to end.

A real coordinator and a real agent on loopback TLS; the agent reads its GPUs through the
scripted NVML (``--scripted-nvml FILE``, agent/scripted_nvml.py), which this test rewrites while
the agent runs. A card is lost under a running member: the member is not killed, the next Job
lands on the other card, the Fleet shows the GPU unhealthy and why, and a Job submitted once
the member ended stays queued rather than get the sick card. Then an XID 79 arrives for the
card: it is journaled, survives an agent restart, and `tuneplane-node gpu clear` brings the
card back (recorded in the journal), where the queued Job then runs. Finally NVML's recovery
action going from gpu_reset back to none clears a second XID by itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, journal, submit, wait_job
from tests.faults.jobs import node, runner_alive
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.agent.scripted_nvml import write_script

pytestmark = pytest.mark.slow

UUIDS = ("GPU-0a0a0a0a-1111-2222-3333-444444444444", "GPU-1b1b1b1b-1111-2222-3333-444444444444")
# Each Job writes the GPUs it was given, then runs until the test drops a file in its out dir.
HOLD = (
    'echo "$CUDA_VISIBLE_DEVICES" > "$TUNEPLANE_OUT_DIR/gpus"\n'
    'while [ ! -e "$TUNEPLANE_OUT_DIR/release" ]; do sleep 0.1; done\n'
)


def card(uuid: str, **extra: Any) -> dict[str, Any]:
    return {
        "uuid": uuid, "name": "NVIDIA H200", "memory": 150_754_820_096,
        "architecture": "hopper", "ecc_uncorrected": 0, "remapped_rows": [0, 0, 0, 0],
        "recovery_action": "none", **extra,
    }  # fmt: skip


class Script:
    """The scripted NVML's file: what the agent's GPUs say, rewritten atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cards = {u: card(u) for u in UUIDS}
        self.xids: list[dict[str, Any]] = []

    def write(self) -> None:
        write_script(self.path, {"driver_version": "550.54.15", "cuda_version": 12040,
                                 "gpus": list(self.cards.values()), "xids": self.xids})  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[CoordinatorProcess, AgentProcess, Script]]:
    script = Script(tmp_path / "nvml.json")
    script.write()
    with start_coordinator(tmp_path / "coord") as coord:
        agent = start_agent(
            tmp_path, coord, "node-a", simulate_gpus=None,
            run_args=("--scripted-nvml", str(script.path), "--inventory-interval", "0.3"),
        )  # fmt: skip
        try:
            agent.wait_connected()
            yield coord, agent, script
        finally:
            agent.stop()


def gpus_shown(coord: CoordinatorProcess, agent: AgentProcess) -> dict[int, dict[str, Any]]:
    """The Node's GPUs as `tp node show` has them, by index (a lost card has no UUID)."""
    return {int(g.get("index", 0)): g for g in node(coord, agent.node_id)["gpus"]}


def wait_shown(
    coord: CoordinatorProcess, agent: AgentProcess, index: int, what: str, check: Any
) -> dict[str, Any]:
    result: dict[str, Any] = wait_until(
        what, lambda: (g := gpus_shown(coord, agent).get(index)) is not None and check(g) and g
    )
    return result


def out_dir(agent: AgentProcess, run_id: str, attempt: int = 1) -> Path:
    return agent.out_root / run_id / f"attempt-{attempt}" / "member-0"


def started_on(agent: AgentProcess, run_id: str) -> str:
    """The GPU UUID the member was given (its CUDA_VISIBLE_DEVICES), once it wrote it."""
    path = out_dir(agent, run_id) / "gpus"
    found: str = wait_until(
        f"job {run_id} to start", lambda: path.exists() and path.read_text().strip()
    )
    return found


def release(agent: AgentProcess, run_id: str) -> None:
    (out_dir(agent, run_id) / "release").write_text("")


def heartbeats_pass(agent: AgentProcess, count: int) -> None:
    """Wait until the coordinator has acknowledged ``count`` more heartbeats of the Node."""
    first = agent.status().get("last_heartbeat_ack_ms") or 0
    seen = [first]

    def advanced() -> bool:
        now = agent.status().get("last_heartbeat_ack_ms") or 0
        if now > seen[-1]:
            seen.append(now)
        return len(seen) > count

    wait_until(f"{count} heartbeats to be acknowledged", advanced)


def test_a_card_lost_under_a_member_then_an_xid_that_survives_restart_and_a_clear(
    cluster: tuple[CoordinatorProcess, AgentProcess, Script], tmp_path: Path
) -> None:
    coord, agent, script = cluster
    shown = gpus_shown(coord, agent)
    assert [shown[i]["uuid"] for i in (0, 1)] == list(UUIDS), shown
    assert all(g["healthy"] for g in shown.values()), shown
    assert node(coord, agent.node_id)["gpu_source"] == "scripted-nvml"

    first = submit(coord, tmp_path / "first", HOLD)
    lost = started_on(agent, first)
    assert lost in UUIDS
    other = next(u for u in UUIDS if u != lost)
    at, other_at = UUIDS.index(lost), UUIDS.index(other)
    member_dir = agent.state_dir / "members" / f"{first}.1.0"

    # The card falls off the bus under the running member.
    script.cards[lost]["lost"] = True
    script.write()
    sick = wait_shown(coord, agent, at, "the lost GPU to show unhealthy",
                      lambda g: not g.get("healthy"))  # fmt: skip
    assert "GPU is lost" in sick["health_reason"], sick
    assert runner_alive(member_dir), "the member on the lost card was killed"
    assert job(coord, first)["state"] == "running"

    # The next Job gets the other card, never the lost one.
    second = submit(coord, tmp_path / "second", HOLD)
    assert started_on(agent, second) == other

    # The member on the lost card ends on its own; its card is free but unhealthy, the other
    # busy: a third Job waits.
    release(agent, first)
    assert wait_job(coord, first)["state"] == "succeeded"
    third = submit(coord, tmp_path / "third", HOLD)
    heartbeats_pass(agent, 3)
    assert job(coord, third)["state"] == "queued"

    # The card comes back, with an XID 79 the driver reported for it.
    script.cards[lost]["lost"] = False
    script.xids = [{"gpu": lost, "xid": 79}]
    script.write()
    gpus = wait_until(
        "the XID to be journaled",
        lambda: (j := journal(agent, "gpus", "--json"))["disabled"] and j,
    )
    (disabled,) = gpus["disabled"]
    assert disabled["gpu_uuid"] == lost and disabled["why"].startswith("XID 79 at ")
    assert disabled["why"].endswith(": GPU has fallen off the bus")
    xid_shown = wait_shown(coord, agent, at, "the XID to reach the Fleet",
                           lambda g: "XID 79 at " in g["health_reason"])  # fmt: skip
    assert not xid_shown.get("healthy") and xid_shown["uuid"] == lost, xid_shown
    assert job(coord, third)["state"] == "queued"

    # The driver does not replay old XIDs to a new process: the script stops delivering it.
    script.xids = []
    script.write()
    agent.restart()
    agent.wait_connected()
    after = gpus_shown(coord, agent)[at]
    assert not after.get("healthy") and "XID 79 at " in after["health_reason"], after
    heartbeats_pass(agent, 2)
    assert job(coord, third)["state"] == "queued"

    cleared = agent.cli("gpu", "clear", lost, "--reason", "reset with nvidia-smi -r, checks pass")
    assert cleared.returncode == 0, cleared.stderr
    assert started_on(agent, third) == lost
    back = gpus_shown(coord, agent)[at]
    assert back["healthy"], back
    history = journal(agent, "gpus", "--json")["history"]
    assert [h["what"] for h in history] == ["xid 79", "operator-clear"], history
    assert "reset with nvidia-smi -r, checks pass" in history[1]["detail"]
    assert history[1]["detail"].startswith("by operator ")
    for run_id in (second, third):
        release(agent, run_id)
        assert wait_job(coord, run_id)["state"] == "succeeded"

    # A second XID, then NVML asks for a reset and, once the card was reset, says none again:
    # the agent clears the XID itself and journals why.
    script.xids = [{"gpu": other, "xid": 48, "id": "second"}]
    script.cards[other]["recovery_action"] = "gpu_reset"
    script.write()
    wait_shown(coord, agent, other_at, "XID 48 to reach the Fleet",
               lambda g: "XID 48 at " in g["health_reason"])  # fmt: skip
    script.xids = []
    script.cards[other]["recovery_action"] = "none"
    script.write()
    wait_shown(coord, agent, other_at, "the reset card to be healthy", lambda g: g.get("healthy"))
    kinds = [(h["gpu_uuid"], h["what"]) for h in journal(agent, "gpus", "--json")["history"]]
    assert kinds[-3:] == [
        (other, "xid 48"), (other, "recovery-action"), (other, "recovery-cleared"),
    ] or kinds[-3:] == [
        (other, "recovery-action"), (other, "xid 48"), (other, "recovery-cleared"),
    ], kinds  # fmt: skip


def test_an_xid_journaled_just_before_a_crash_disables_the_gpu_after_the_restart(
    cluster: tuple[CoordinatorProcess, AgentProcess, Script],
) -> None:
    """The XID is committed before any inventory shows it: an agent killed right after the
    commit (crash point ``after-xid-journaled``) never told the coordinator, and the restarted
    one, whose NVML does not deliver the XID again, shows the GPU disabled from the journal."""
    coord, agent, script = cluster
    agent.restart(env={"TUNEPLANE_CRASHPOINT": "after-xid-journaled"})
    agent.wait_connected()
    script.xids = [{"gpu": UUIDS[1], "xid": 94}]
    script.write()
    assert agent.wait_exit() == 137
    assert "crash point reached, exiting point=after-xid-journaled" in agent.read_log()
    (disabled,) = journal(agent, "gpus", "--json")["disabled"]
    assert disabled["gpu_uuid"] == UUIDS[1] and disabled["why"].startswith("XID 94 at ")
    # The coordinator never heard of it.
    assert gpus_shown(coord, agent)[1].get("healthy"), gpus_shown(coord, agent)
    script.xids = []
    script.write()
    agent.start()
    agent.wait_connected()
    shown = gpus_shown(coord, agent)[1]
    assert not shown.get("healthy") and "XID 94 at " in shown["health_reason"], shown
    assert "contained ECC error" in shown["health_reason"]
