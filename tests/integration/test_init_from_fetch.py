"""``--init-from`` between two Nodes that share no disk: the checkpoint is fetched from the Node
that holds it, over its outputs listener, and verified against the manifest.

A real coordinator with no ``shared_output_root`` and two real Nodes, each with its own output
root. Run A writes a checkpoint on node-a; run B ``--init-from A`` is placed on node-b (node-a
cordoned), which cannot read node-a's disk: it fetches the files at Prepare and its rank reads
them at ``$TUNEPLANE_INIT_FROM_DIR``. A checkpoint changed on the holder after its run ended,
or a holder that is down, refuses B's Prepare with a sentence naming the cause: nothing starts
and node-b holds no GPU for B. A Node whose outputs listener is off cannot be a source: Preview
says so before anything is admitted.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, journal, tp, wait_job
from tests.faults.jobs import project, submit
from tests.integration.test_init_from import READ, WRITE
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LISTEN = '[outputs]\nlisten = "127.0.0.1:0"\n'

Cluster = tuple[CoordinatorProcess, AgentProcess, AgentProcess]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("fetch")
    with start_coordinator(root) as coord:
        a = start_agent(root, coord, "node-a", "h200:2", node_toml=LISTEN)
        b = start_agent(root, coord, "node-b", "h200:2", node_toml=LISTEN)
        try:
            a.wait_connected()
            b.wait_connected()
            assert a.out_root != b.out_root
            yield coord, a, b
        finally:
            for agent in (a, b):
                if agent.alive():
                    agent.stop()


def _only(coord: CoordinatorProcess, use: AgentProcess, other: AgentProcess) -> None:
    """Place the next Jobs on ``use`` only."""
    tp(coord, "node", "uncordon", use.node_id)
    tp(coord, "node", "cordon", other.node_id, "--reason", "init-from fetch test")


def _member0(view: dict[str, Any]) -> dict[str, Any]:
    member: dict[str, Any] = view["attempts"][-1]["members"][0]
    return member


def _source_on_a(cluster: Cluster, root: Path) -> tuple[str, Path]:
    coord, a, b = cluster
    _only(coord, a, b)
    proj = project(coord, root, "custom/custom", {"train.sh": WRITE})
    run_a = submit(coord, proj, "h200:1")
    view = wait_job(coord, run_a, 120)
    assert view["state"] == "succeeded", view
    assert _member0(view)["node_id"] == a.node_id
    return run_a, Path(_member0(view)["out_dir"])


def _never_started(view: dict[str, Any]) -> None:
    for attempt in view["attempts"]:
        for member in attempt["members"]:
            states = [h["state"] for h in member["history"]]
            assert "running" not in states and "starting" not in states, states


def _holds_nothing_for(agent: AgentProcess, run_id: str) -> None:
    def free() -> bool:
        held = journal(agent, "reservations", "--json")
        return not [r for r in held if run_id in json.dumps(r)]

    wait_until(f"{agent.node_id} to hold no GPU for {run_id}", free, 30)


def test_a_run_on_another_node_fetches_its_source(cluster: Cluster, tmp_path: Path) -> None:
    coord, a, b = cluster
    run_a, out_a = _source_on_a(cluster, tmp_path / "a")
    checkpoint = (out_a / "ckpt" / "model.bin").read_bytes()
    assert not str(out_a).startswith(str(b.out_root))

    _only(coord, b, a)
    proj_b = project(coord, tmp_path / "b", "custom/custom", {"train.sh": READ})
    preview = " ".join(
        tp(coord, "submit", "job", "--profile", "h200:1", "--init-from", run_a, "--preview",
           cwd=proj_b).split()
    )  # fmt: skip
    assert f"Begins from run {run_a}" in preview
    assert f"fetched from Node {a.node_id}" in preview and "at Prepare" in preview, preview
    run_b = submit(coord, proj_b, "h200:1", "--init-from", run_a)
    view = wait_job(coord, run_b, 120)
    assert view["state"] == "succeeded", view
    assert _member0(view)["node_id"] == b.node_id
    out_b = Path(_member0(view)["out_dir"])
    assert str(out_b).startswith(str(b.out_root))
    seen = (out_b / "seen.txt").read_text().splitlines()
    assert seen[:2] == [hashlib.sha256(checkpoint).hexdigest(), "step 7"]
    assert seen[2].endswith("/.tuneplane/init-from")
    # The holder logged what it served, to whom it was granted: the manifest and both files.
    assert a.log_path.read_text().count(f"outputs served run_id={run_a}") >= 1
    # The source is untouched.
    assert (out_a / "ckpt" / "model.bin").read_bytes() == checkpoint


def test_a_checkpoint_changed_on_the_holder_refuses_prepare(
    cluster: Cluster, tmp_path: Path
) -> None:
    coord, a, b = cluster
    run_a, out_a = _source_on_a(cluster, tmp_path / "a")
    model = out_a / "ckpt" / "model.bin"
    data = bytearray(model.read_bytes())
    data[100] ^= 0xFF
    model.write_bytes(bytes(data))

    _only(coord, b, a)
    proj_b = project(coord, tmp_path / "b", "custom/custom", {"train.sh": READ})
    run_b = submit(coord, proj_b, "h200:1", "--init-from", run_a)
    view = wait_job(coord, run_b, 120)
    assert view["state"] in ("aborted", "failed"), view
    said = f"The file ckpt/model.bin of run {run_a}'s outputs does not match its manifest"
    assert said in json.dumps(view), view
    _never_started(view)
    _holds_nothing_for(b, run_b)
    assert not list(b.work_root.glob(f"{run_b}*/.tuneplane/init-from"))


def test_a_holder_that_is_down_refuses_prepare_naming_it(cluster: Cluster, tmp_path: Path) -> None:
    coord, a, b = cluster
    run_a, _ = _source_on_a(cluster, tmp_path / "a")
    _only(coord, b, a)
    a.stop()
    try:
        proj_b = project(coord, tmp_path / "b", "custom/custom", {"train.sh": READ})
        run_b = submit(coord, proj_b, "h200:1", "--init-from", run_a)
        view = wait_job(coord, run_b, 120)
        assert view["state"] in ("aborted", "failed"), view
        text = json.dumps(view)
        assert run_a in text and a.node_id in text, view
        _never_started(view)
        _holds_nothing_for(b, run_b)
    finally:
        a.start()
        a.wait_connected()


def test_a_node_that_serves_no_outputs_cannot_be_a_source(cluster: Cluster, tmp_path: Path) -> None:
    coord, a, b = cluster
    run_a, _ = _source_on_a(cluster, tmp_path / "a")
    config = a.config_path.read_text()
    a.config_path.write_text(config.replace(LISTEN, '[outputs]\nlisten = ""\n'))
    try:
        a.restart()
        a.wait_connected()
        _only(coord, b, a)
        proj_b = project(coord, tmp_path / "b", "custom/custom", {"train.sh": READ})
        done = subprocess_tp(coord, proj_b, "submit", "job", "--profile", "h200:1",
                             "--init-from", run_a, "--preview")  # fmt: skip
        assert done.returncode != 0
        said = " ".join(done.stderr.split())
        assert "init_from" in said and "node-a" in said and "[outputs] listen" in said, said
        # Nothing was admitted.
        jobs = json.loads(tp(coord, "job", "ls", "--json", "--limit", "1000"))
        assert not [j for j in jobs if j.get("init_from") == run_a], jobs
    finally:
        a.config_path.write_text(config)
        a.restart()
        a.wait_connected()
    assert job(coord, run_a)["state"] == "succeeded"


def subprocess_tp(
    coord: CoordinatorProcess, cwd: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """``tp`` that may fail: the test reads its exit status and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context",
         str(coord.context_path), *args],
        cwd=cwd, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
