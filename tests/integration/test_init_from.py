"""``--init-from`` end to end with a real coordinator and a real Node whose output root is the
Fleet's shared output root: run A writes a checkpoint; its Node writes a manifest when it ends,
and ``tp job show --json`` shows it; run B ``--init-from A`` reads the checkpoint at
``$TUNEPLANE_INIT_FROM_DIR`` and writes back its sha256, which must be A's. A checkpoint changed
after its run ended makes B's Prepare fail naming the file: nothing starts and the GPUs are free.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, journal, tp, wait_job
from tests.faults.jobs import project, submit
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto.contract.derivation_source import manifest_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Run A: a checkpoint of random bytes (more than one copy chunk) and a note in a subfolder.
WRITE = """set -eu
mkdir -p "$TUNEPLANE_OUT_DIR/ckpt"
head -c 2500000 /dev/urandom > "$TUNEPLANE_OUT_DIR/ckpt/model.bin"
echo "step 7" > "$TUNEPLANE_OUT_DIR/ckpt/notes.txt"
"""
# Run B: what it finds where the Derivation's source is documented to be.
READ = """set -eu
test -n "$TUNEPLANE_INIT_FROM_DIR"
sha256sum "$TUNEPLANE_INIT_FROM_DIR/ckpt/model.bin" | cut -d' ' -f1 > "$TUNEPLANE_OUT_DIR/seen.txt"
cat "$TUNEPLANE_INIT_FROM_DIR/ckpt/notes.txt" >> "$TUNEPLANE_OUT_DIR/seen.txt"
echo "$TUNEPLANE_INIT_FROM_DIR" >> "$TUNEPLANE_OUT_DIR/seen.txt"
"""


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, AgentProcess]]:
    root = tmp_path_factory.mktemp("initfrom")
    with start_coordinator(root) as coord:
        agent = start_agent(root, coord, "node-a", "h200:2")
        try:
            # The Fleet's shared output root is where this Node writes outputs; the coordinator
            # reads coordinator.toml when it starts.
            with open(coord.state_dir / "coordinator.toml", "a", encoding="utf-8") as toml:
                toml.write(f'\n[fleet.default]\nshared_output_root = "{agent.out_root}"\n')
            coord.restart()
            agent.wait_connected()
            yield coord, agent
        finally:
            agent.stop()


def _member0(view: dict[str, Any]) -> dict[str, Any]:
    member: dict[str, Any] = view["attempts"][-1]["members"][0]
    return member


def _source(coord: CoordinatorProcess, root: Path) -> tuple[str, Path]:
    """A succeeded run A and its member 0's output directory."""
    proj = project(coord, root, "custom/custom", {"train.sh": WRITE})
    run_a = submit(coord, proj, "h200:1")
    view = wait_job(coord, run_a, 120)
    assert view["state"] == "succeeded", view
    return run_a, Path(_member0(view)["out_dir"])


def test_a_run_begins_from_the_checkpoint_of_another(
    node: tuple[CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, agent = node
    run_a, out_a = _source(coord, tmp_path / "a")
    checkpoint = (out_a / "ckpt" / "model.bin").read_bytes()
    manifest_file = Path(manifest_path(str(out_a)))
    manifest = json.loads(manifest_file.read_text())
    listed = {f["path"]: f for f in manifest["files"]}
    assert listed["ckpt/model.bin"] == {
        "path": "ckpt/model.bin",
        "size": len(checkpoint),
        "sha256": hashlib.sha256(checkpoint).hexdigest(),
    }
    # tp job show --json: the summary, with the digest of the manifest file itself.
    summary = _member0(job(coord, run_a))["output_manifest"]
    assert summary == {
        "files": len(manifest["files"]),
        "bytes": manifest["bytes"],
        "sha256": hashlib.sha256(manifest_file.read_bytes()).hexdigest(),
        "problem": "",
    }
    # The Node's journal recorded it with the exit.
    events = journal(agent, "events", "--json")
    exits = [e for e in events if e.get("kind") == "exit-observed" and run_a in e.get("member", "")]
    assert exits and exits[0]["details"]["output_manifest"] == summary, exits

    proj_b = project(coord, tmp_path / "b", "custom/custom", {"train.sh": READ})
    # The preview names the source and its manifest digest before anything is admitted.
    preview = " ".join(
        tp(coord, "submit", "job", "--profile", "h200:1", "--init-from", run_a, "--preview",
           cwd=proj_b).split()
    )  # fmt: skip
    assert f"Begins from run {run_a} (attempt 1, member 0): {summary['files']} files" in preview
    assert f"manifest sha256 {summary['sha256']}" in preview
    run_b = submit(coord, proj_b, "h200:1", "--init-from", run_a)
    view = wait_job(coord, run_b, 120)
    assert view["state"] == "succeeded", view
    assert view["init_from"] == run_a
    seen = (Path(_member0(view)["out_dir"]) / "seen.txt").read_text().splitlines()
    assert seen[0] == hashlib.sha256(checkpoint).hexdigest()
    assert seen[1] == "step 7"
    assert seen[2].endswith("/.tuneplane/init-from")
    # The source is untouched.
    assert (out_a / "ckpt" / "model.bin").read_bytes() == checkpoint


def test_a_checkpoint_changed_after_its_run_ended_fails_prepare_and_starts_nothing(
    node: tuple[CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, agent = node
    run_a, out_a = _source(coord, tmp_path / "a")
    model = out_a / "ckpt" / "model.bin"
    data = bytearray(model.read_bytes())
    data[100] ^= 0xFF
    model.write_bytes(bytes(data))

    proj_b = project(coord, tmp_path / "b", "custom/custom", {"train.sh": READ})
    run_b = submit(coord, proj_b, "h200:1", "--init-from", run_a)
    view = wait_job(coord, run_b, 120)
    said = f"The file ckpt/model.bin of run {run_a}'s outputs does not match its manifest"
    assert view["state"] in ("aborted", "failed"), view
    assert said in json.dumps(view), view
    # Nothing started: no member of B ever ran, and the Node holds no GPU for it.
    for attempt in view["attempts"]:
        for member in attempt["members"]:
            states = [h["state"] for h in member["history"]]
            assert "running" not in states and "starting" not in states, states
    members = journal(agent, "members", "--json")
    mine = [m for m in members if m["run_id"] == run_b]
    assert mine and all(m["state"] == "aborted" for m in mine), mine
    assert "does not match its manifest" in mine[0]["reason"]

    def free() -> bool:
        held = journal(agent, "reservations", "--json")
        return not [r for r in held if run_b in json.dumps(r)]

    wait_until("the Node to hold no GPU for the refused run", free, 30)
    # No half-copied directory is left where the workload would look.
    work = [p for p in agent.work_root.glob(f"{run_b}*")]
    for folder in work:
        assert not (folder / ".tuneplane" / "init-from").exists()
