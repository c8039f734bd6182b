"""Jobs whose runtime is an image, end to end: a real coordinator, real agents (as root, members
as pool accounts), a real ``docker-registry`` on loopback TLS, real bubblewrap, simulated GPUs.

The agent pulls the image at Prepare (in a task of its own, journaled as it goes, its progress
shown by ``tp job show``) and answers Prepared only once the image is ready; the member then runs
in the image's root. A pull that fails refuses the Prepare with its sentence, so the Job aborts
holding no GPU. Everything a test writes is under its own temporary folders (the Debian root and
its layer tar come from the rootfs cache folder).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pwd
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from grpclib.exceptions import GRPCError

from tests.agent.jobs import job, journal, tp, wait_job
from tests.coordinator.grpc_client import api_client, jobspec
from tests.faults.jobs import held_gpus
from tests.support import rootfs
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.oci_registry import (
    LAYER_TAR,
    PushedImage,
    RegistryProcess,
    start_registry,
    tar_layer,
)
from tests.support.payloads import MEET_PY
from tuneplane.agent.image_progress import EVERY_S, STEPS

pytestmark = pytest.mark.slow

DEBIAN_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Two ranks on two Nodes: each imports the module only the image has, records what it saw, and
# they meet at the rendezvous (rank 0 listens, rank 1 connects and says its rank).
TRAIN_PY = (
    MEET_PY
    + r"""
import json, os, sys
from pathlib import Path

import tp_image_only

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
out = Path(os.environ["TUNEPLANE_OUT_DIR"])
seen = {
    "where": tp_image_only.WHERE,
    "python": sys.executable,
    "os_release": Path("/etc/os-release").read_text(),
    "uid": os.getuid(),
    "cwd": os.getcwd(),
}
(out / f"seen-{rank}.json").write_text(json.dumps(seen))
addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
met = meet(rank, world, addr)
(out / f"met-{rank}.json").write_text(json.dumps(met))
"""
)


def _registries_toml(registry: RegistryProcess) -> str:
    return f'[registries."{registry.address}"]\nca_file = "{registry.ca_file}"\n'


def _fleet_registries_toml(registry: RegistryProcess, extra: str = "") -> str:
    """The coordinator's access to ``registry`` for the default Fleet (Preview pins and checks
    images there)."""
    return (
        f'[fleet.default.registries."{registry.address}"]\nca_file = "{registry.ca_file}"\n' + extra
    )


@contextmanager
def _cluster(
    root: Path, registry: RegistryProcess, names: tuple[str, ...], **coordinator: Any
) -> Iterator[tuple[CoordinatorProcess, tuple[AgentProcess, ...]]]:
    """A coordinator and connected agents (h200:2 each) that reach ``registry`` with its CA."""
    coordinator["config"] = coordinator.get("config", "") + _fleet_registries_toml(registry)
    with start_coordinator(root, **coordinator) as coord:
        agents: list[AgentProcess] = []
        try:
            for name in names:
                agents.append(
                    start_agent(root, coord, name, "h200:2", node_toml=_registries_toml(registry))
                )
            for agent in agents:
                agent.wait_connected()
            yield coord, tuple(agents)
        finally:
            for agent in agents:
                if agent.alive():
                    agent.stop()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    with start_registry(tmp_path_factory.mktemp("registry")) as found:
        yield found


@pytest.fixture(scope="module")
def python_image(registry: RegistryProcess) -> PushedImage:
    """The Debian root with Python (and ``tp_image_only``) as one uncompressed layer."""
    layer = rootfs.layer_tar(rootfs.python_root()).read_bytes()
    return registry.push_image(
        "team/python", [layer], config={"Env": [DEBIAN_PATH], "Cmd": ["python3"]},
        layer_type=LAYER_TAR,
    )  # fmt: skip


@pytest.fixture(scope="module")
def two_nodes(
    tmp_path_factory: pytest.TempPathFactory, registry: RegistryProcess
) -> Iterator[tuple[CoordinatorProcess, AgentProcess, AgentProcess]]:
    with _cluster(tmp_path_factory.mktemp("img"), registry, ("node-a", "node-b")) as (c, agents):
        a, b = agents
        yield c, a, b


def _submit(coord: CoordinatorProcess, spec: dict[str, Any], key: str) -> str:
    async def go() -> str:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            return (await api.submit(spec, key)).run_id

    return asyncio.run(go())


def _spec(image: str, script: str, gpus: int, members: int) -> dict[str, Any]:
    spec = jobspec(gpus=gpus, method_id="pytorch/process-group", members=members)
    spec["runtime_id"] = image
    spec["entrypoint"] = ["python3", "train.py"]
    spec["source_files"] = {"train.py": base64.b64encode(script.encode()).decode()}
    return spec


def _members(agent: AgentProcess, run_id: str) -> list[dict[str, Any]]:
    return [m for m in journal(agent, "members", "--json") if m["run_id"] == run_id]


def _events(agent: AgentProcess, member: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = journal(agent, "events", "--member", member, "--json")
    return found


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


def _prepare_s(events: list[dict[str, Any]]) -> float:
    """Seconds from the member's first journal event (Prepare received) to ``prepared``."""
    done = next(e for e in events if e["kind"] == "prepare-succeeded")
    return (int(done["at_ms"]) - int(events[0]["at_ms"])) / 1000


@pytest.mark.timeout(rootfs.BUILD_TIMEOUT_S + 300)  # a cold rootfs cache runs debootstrap first
def test_a_process_group_runs_in_the_python_image_and_a_second_job_finds_it_cached(
    two_nodes: tuple[CoordinatorProcess, AgentProcess, AgentProcess],
    python_image: PushedImage,
    registry: RegistryProcess,
) -> None:
    coord, a, b = two_nodes
    image = python_image.ref_text(registry.address)
    run_id = _submit(coord, _spec(image, TRAIN_PY, gpus=2, members=2), "image-pg")
    done = wait_job(coord, run_id, 240)
    assert done["state"] == "succeeded", done
    by_index = {m["member_index"]: (agent, m) for agent in (a, b) for m in _members(agent, run_id)}
    assert sorted(by_index) == [0, 1] and {by_index[0][0], by_index[1][0]} == {a, b}
    cold: list[float] = []
    for index, (agent, member) in by_index.items():
        out = Path(member["out_dir"])
        seen = json.loads((out / f"seen-{index}.json").read_text())
        # The rank imported the module only the image has, with the image's Python, and saw
        # the image's /etc (Debian), not the host's, as the pool account, in its work dir.
        assert seen["where"] == "inside the test image"
        assert seen["python"] == "/usr/bin/python3"
        assert "VERSION_CODENAME=bookworm" in seen["os_release"]
        assert pwd.getpwuid(seen["uid"]).pw_name in agent.pool
        assert seen["cwd"] == str(agent.work_root / member["member"])
        assert json.loads((out / f"met-{index}.json").read_text()) == [0, 1]
        assert member["state"] == "exited" and member["exit_code"] == 0
        events = _events(agent, member["member"])
        kinds = _kinds(events)
        # Pulled at Prepare, journaled, and only then prepared.
        assert kinds.index("image-pull-started") < kinds.index("image-ready")
        assert kinds.index("image-ready") < kinds.index("prepare-succeeded")
        assert "image-pull-progress" in kinds
        ready = next(e for e in events if e["kind"] == "image-ready")
        assert ready["details"]["image"] == image and ready["details"]["layers"] == 1
        cold.append(_prepare_s(events))
        # The image's root is in the cache beside the state dir, whole, and members can pass
        # through to it but not list which images this Node holds.
        root = agent.image_root / "roots" / python_image.digest_hex
        assert (root / "usr/lib/python3/dist-packages/tp_image_only.py").is_file()
        assert oct(os.stat(agent.image_root / "roots").st_mode & 0o777) == "0o711"
        assert oct(os.stat(agent.image_root / "blobs").st_mode & 0o777) == "0o700"
    gets = registry.blob_gets(RegistryProcess.sha256(python_image.layers[0]))

    # A second Job of the same image pulls nothing: each Node finds it ready in its cache.
    again = _submit(coord, _spec(image, TRAIN_PY, gpus=2, members=2), "image-pg-again")
    assert wait_job(coord, again, 120)["state"] == "succeeded"
    warm = []
    for agent in (a, b):
        (member,) = _members(agent, again)
        events = _events(agent, member["member"])
        assert "image-pull-started" not in _kinds(events)
        warm.append(_prepare_s(events))
    assert registry.blob_gets(RegistryProcess.sha256(python_image.layers[0])) == gets
    print(f"\nPrepare of a 2-member Job on a {len(python_image.layers[0]) >> 20} MiB image: "
          f"cold {max(cold):.2f} s, warm {max(warm):.2f} s")  # fmt: skip


def test_a_missing_image_is_refused_at_preview_and_a_lost_layer_aborts_at_prepare(
    two_nodes: tuple[CoordinatorProcess, AgentProcess, AgentProcess], registry: RegistryProcess
) -> None:
    """An image the registry does not have never becomes a Job (Preview checks the digest); a
    layer the registry loses after Preview aborts the attempt at Prepare with a sentence naming
    the image, holding no GPU and making nothing of the member."""
    coord, a, b = two_nodes
    image = f"image:{registry.address}/team/never-pushed@sha256:{'ab' * 32}"
    with pytest.raises(GRPCError) as refused:
        _submit(coord, _spec(image, TRAIN_PY, gpus=1, members=1), "image-missing")
    assert f"{registry.address}/team/never-pushed" in str(refused.value.message), refused.value
    assert "404" in str(refused.value.message), refused.value

    layer = tar_layer([("etc/lost", os.urandom(4096))], gzipped=False)
    pushed = registry.push_image("team/lost", [layer], layer_type=LAYER_TAR)
    registry.blob_data(RegistryProcess.sha256(layer)).unlink()
    run_id = _submit(coord, _spec(pushed.ref_text(registry.address), TRAIN_PY, 1, 1), "lost")
    done = wait_job(coord, run_id, 90)
    assert done["state"] == "aborted", done
    assert "refused Prepare" in done["state_reason"], done
    assert f"{registry.address}/team/lost" in done["state_reason"], done
    (agent, member), = [(x, m) for x in (a, b) for m in _members(x, run_id)]  # fmt: skip
    assert member["state"] == "aborted"
    assert _kinds(_events(agent, member["member"]))[-2:] == ["image-pull-failed", "prepare-failed"]
    # No GPU held, nothing of the member made.
    assert held_gpus(a) == [] and held_gpus(b) == []
    assert not (agent.work_root / member["member"]).exists()


def test_a_corrupt_blob_aborts_the_job_with_the_digest_sentence(
    two_nodes: tuple[CoordinatorProcess, AgentProcess, AgentProcess], registry: RegistryProcess
) -> None:
    coord, a, b = two_nodes
    layer = tar_layer([("etc/data", os.urandom(4096))], gzipped=False)
    pushed = registry.push_image("team/corrupt", [layer], layer_type=LAYER_TAR)
    layer_hex = RegistryProcess.sha256(layer)
    # The registry's own storage serves other bytes of the same length for the layer.
    registry.blob_data(layer_hex).write_bytes(bytes(len(layer)))
    image = pushed.ref_text(registry.address)
    run_id = _submit(coord, _spec(image, TRAIN_PY, gpus=1, members=1), "image-corrupt")
    done = wait_job(coord, run_id, 90)
    assert done["state"] == "aborted", done
    assert f"The blob sha256:{layer_hex} the registry served hashes to" in done["state_reason"]
    assert "push the image again" in done["state_reason"]
    assert held_gpus(a) == [] and held_gpus(b) == []
    (agent,) = [x for x in (a, b) if _members(x, run_id)]
    assert not (agent.image_root / "blobs" / "sha256" / layer_hex).exists()


def _big_image(registry: RegistryProcess, name: str) -> PushedImage:
    """The busybox root and a 24 MiB layer of random bytes (nothing compresses it)."""
    busybox = rootfs.layer_tar(rootfs.busybox_root()).read_bytes()
    big = tar_layer([("data/big.bin", os.urandom(24 << 20))], gzipped=False)
    return registry.push_image(
        name, [busybox, big], config={"Env": ["PATH=/bin"]}, layer_type=LAYER_TAR
    )


def _busybox_spec(image: str) -> dict[str, Any]:
    script = 'test -s /data/big.bin && echo "$(wc -c < /data/big.bin)" > "$TUNEPLANE_OUT_DIR/size"'
    spec = jobspec(gpus=1)
    spec["runtime_id"] = image
    spec["entrypoint"] = ["sh", "train.sh"]
    spec["source_files"] = {"train.sh": base64.b64encode(script.encode()).decode()}
    return spec


def test_progress_shows_in_tp_job_show_and_the_journal_while_the_image_is_pulled(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    pushed = _big_image(registry, "team/progress")
    image = pushed.ref_text(registry.address)
    total = len(pushed.config) + sum(len(layer) for layer in pushed.layers)
    with _cluster(tmp_path, registry, ("node-p",)) as (coord, (agent,)):
        # The pull's first chunk holds its worker thread for 10 s (the loop goes on), so the
        # Job is seen preparing mid-pull.
        agent.restart({"TUNEPLANE_HANGPOINT": "mid-image-blob:10"})
        agent.wait_connected()
        run_id = _submit(coord, _busybox_spec(image), "image-progress")

        def shown() -> dict[str, Any] | None:
            found = job(coord, run_id)
            members = [m for a in found["attempts"] for m in a["members"]]
            return members[0] if members and members[0]["preparation"] else None

        member = wait_until("tp job show to show the pull", shown, 60)
        assert member["state"] == "preparing"
        preparation = member["preparation"]
        assert preparation["image"] == image and preparation["phase"] == "pulling"
        assert preparation["bytes_total"] == total and preparation["layers_total"] == 2
        assert preparation["bytes_done"] < total and preparation["layers_done"] < 2
        # tp job show's table gives the member's STATE as "preparing (pulling <image>: <done>
        # MiB of <total> MiB, <n> of 2 layers)", folded in its column.
        table = tp(coord, "job", "show", run_id)
        assert "preparing (pulling" in table and image in table
        assert f"{total / (1 << 20):.1f} MiB" in table and "of 2 layers)" in table

        # The pull holds up nothing else: a host-runtime Job on the Node's other GPU is
        # prepared, runs and ends while the image Job is still preparing.
        other = _submit(coord, jobspec(gpus=1), "host-beside-the-pull")
        assert wait_job(coord, other, 60)["state"] == "succeeded"
        assert job(coord, run_id)["state"] == "preparing"

        done = wait_job(coord, run_id, 120)
        assert done["state"] == "succeeded", done
        # The Job's view forgets the pull once the member is past preparing.
        assert all(m["preparation"] is None for a in done["attempts"] for m in a["members"])
        (record,) = _members(agent, run_id)
        # The member ran in the image: its layer's file is there, whole.
        assert (Path(record["out_dir"]) / "size").read_text().strip() == str(24 << 20)
        events = _events(agent, record["member"])
        progress = [e["details"] for e in events if e["kind"] == "image-pull-progress"]
        ready = next(e for e in events if e["kind"] == "image-ready")
        assert ready["details"]["bytes"] == total and ready["details"]["seconds"] >= 10
        # Journaled at the pace's bound (agent/image_progress.py), whatever the machine's speed:
        # the start, each tenth of the bytes, a phase change, and one per EVERY_S of the pull;
        # never one per 1 MiB chunk.
        bound = 1 + STEPS + 1 + int(ready["details"]["seconds"] // EVERY_S) + 1
        assert 1 <= len(progress) <= bound
        assert all(p["bytes_total"] == total and p["layers_total"] == 2 for p in progress)
        assert [p["bytes_done"] for p in progress] == sorted(p["bytes_done"] for p in progress)


def test_an_agent_killed_mid_pull_fails_the_member_resumes_the_pull_and_the_retry_runs(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    pushed = _big_image(registry, "team/crash")
    image = pushed.ref_text(registry.address)
    big_hex = RegistryProcess.sha256(pushed.layers[1])
    with _cluster(tmp_path, registry, ("node-k",)) as (coord, (agent,)):
        agent.restart({"TUNEPLANE_CRASHPOINT": "mid-image-blob"})
        agent.wait_connected()
        run_id = _submit(coord, _busybox_spec(image), "image-crash")
        assert agent.wait_exit(60) == 137  # died with the first chunk of a blob on disk
        partial = agent.image_root / "partial"
        assert any(p.stat().st_size for p in partial.iterdir())
        agent.restart()
        agent.wait_connected()

        # The cut-short Prepare is refused on replay, naming the image; the attempt aborts
        # holding no GPU.
        done = wait_job(coord, run_id, 60)
        assert done["state"] == "aborted", done
        assert f"the agent stopped while pulling the image {image}" in done["state_reason"]
        assert held_gpus(agent) == []
        # Meanwhile the agent finished the pull from what was verified before the kill.
        (member,) = _members(agent, run_id)
        wait_until(
            "the pull to finish after the restart",
            lambda: "image-ready" in _kinds(_events(agent, member["member"])),
            60,
        )
        assert (agent.image_root / "blobs" / "sha256" / big_hex).is_file()
        assert not any(partial.iterdir())

        # The retry finds the image ready and runs.
        tp(coord, "job", "retry", run_id)
        retried = wait_until(
            "the retried attempt to end",
            lambda: (
                len((j := job(coord, run_id))["attempts"]) == 2
                and j["state"] in ("succeeded", "failed", "aborted")
                and j
            ),
            90,
        )
        assert retried["state"] == "succeeded", retried
        (second,) = [m for m in _members(agent, run_id) if m["attempt"] == 2]
        assert "image-pull-started" not in _kinds(_events(agent, second["member"]))


def test_the_prepare_deadline_cancels_the_pull_and_frees_the_gpus(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    pushed = _big_image(registry, "team/deadline")
    image = pushed.ref_text(registry.address)
    with _cluster(tmp_path, registry, ("node-d",), prepare_timeout=3) as (coord, (agent,)):
        # The pull's first chunk holds its worker thread for 8 s: longer than the deadline.
        agent.restart({"TUNEPLANE_HANGPOINT": "mid-image-blob:8"})
        agent.wait_connected()
        run_id = _submit(coord, _busybox_spec(image), "image-deadline")
        done = wait_job(coord, run_id, 60)
        assert done["state"] == "aborted", done
        assert "were not prepared before the prepare deadline" in done["state_reason"], done
        (member,) = _members(agent, run_id)
        # The Abort cancelled the pull, waited for its task, then journaled the member aborted.
        wait_until("the member to be aborted", lambda: _members(agent, run_id)[0]["state"]
                   == "aborted", 30)  # fmt: skip
        kinds = _kinds(_events(agent, member["member"]))
        assert kinds[-2:] == ["image-pull-cancelled", "abort-received"], kinds
        assert "image-ready" not in kinds and "prepare-succeeded" not in kinds
        assert held_gpus(agent) == []
        assert not (agent.image_root / "roots" / pushed.digest_hex).exists()


def test_a_registry_with_credentials_is_pulled_from_with_the_nodes_and_the_job_never_sees_them(
    tmp_path: Path,
) -> None:
    secret = "node-only-secret-9f3c"
    with start_registry(tmp_path / "registry", users={"puller": secret}) as private:
        busybox = rootfs.layer_tar(rootfs.busybox_root()).read_bytes()
        pushed = private.push_image(
            "team/private", [busybox], config={"Env": ["PATH=/bin"]}, layer_type=LAYER_TAR
        )
        password = tmp_path / "registry.password"
        password.write_text(f"{secret}\n")
        os.chmod(password, 0o600)
        node_toml = (
            f'[registries."{private.address}"]\nca_file = "{private.ca_file}"\n'
            f'username = "puller"\npassword_file = "{password}"\n'
        )
        login = f'username = "puller"\npassword_file = "{password}"\n'
        with start_coordinator(tmp_path, config=_fleet_registries_toml(private, login)) as coord:
            agent = start_agent(tmp_path, coord, "node-c", "h200:2", node_toml=node_toml)
            try:
                agent.wait_connected()
                spec = _busybox_spec(pushed.ref_text(private.address))
                script = (
                    f'env > "$TUNEPLANE_OUT_DIR/env"; cat {password} 2> "$TUNEPLANE_OUT_DIR/cat"'
                )
                spec["source_files"] = {"train.sh": base64.b64encode(script.encode()).decode()}
                run_id = _submit(coord, spec, "image-private")
                done = wait_job(coord, run_id, 90)
                # The member's command fails (the password file is not even in its sandbox):
                # that is the point.
                assert done["state"] == "failed", done
                (member,) = _members(agent, run_id)
                out = Path(member["out_dir"])
                assert secret not in (out / "env").read_text()
                assert "TUNEPLANE_RUN_ID" in (out / "env").read_text()
                assert secret not in (out / "cat").read_text() and (out / "cat").read_text()
                assert "image-ready" in _kinds(_events(agent, member["member"]))
                assert secret not in agent.read_log()
            finally:
                agent.stop()


def test_a_member_in_an_image_survives_an_agent_killed_while_it_runs(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    """As a host member does: the agent SIGKILLed while the member runs in its image, and
    started again, adopts it; the workload is neither stopped nor started twice, and its exit
    reaches the coordinator."""
    busybox = rootfs.layer_tar(rootfs.busybox_root()).read_bytes()
    pushed = registry.push_image(
        "team/survivor", [busybox], config={"Env": ["PATH=/bin"]}, layer_type=LAYER_TAR
    )
    script = (
        'echo "$$" >> "$TUNEPLANE_OUT_DIR/starts"\n'
        'while [ ! -e "$TUNEPLANE_OUT_DIR/go" ]; do sleep 0.1; done\n'
        'echo done > "$TUNEPLANE_OUT_DIR/finished"\n'
    )
    spec = jobspec(gpus=1)
    spec["runtime_id"] = pushed.ref_text(registry.address)
    spec["entrypoint"] = ["sh", "train.sh"]
    spec["source_files"] = {"train.sh": base64.b64encode(script.encode()).decode()}
    with _cluster(tmp_path, registry, ("node-s",)) as (coord, (agent,)):
        run_id = _submit(coord, spec, "image-survivor")

        def started() -> Path | None:
            found = _members(agent, run_id)
            if found and (Path(found[0]["out_dir"]) / "starts").exists():
                return Path(found[0]["out_dir"])
            return None

        out_dir = wait_until("the member to start in its image", started, 120)
        agent.kill()
        # A Node gone quiet makes its members unknown, never failed.
        assert job(coord, run_id)["state"] in ("running", "unknown")
        agent.restart()
        agent.wait_connected()
        (out_dir / "go").write_text("")
        done = wait_job(coord, run_id, 120)
        assert done["state"] == "succeeded", done
        # One start, before the kill: the restarted agent adopted the running workload.
        assert len((out_dir / "starts").read_text().split()) == 1
        assert (out_dir / "finished").read_text().strip() == "done"
        assert held_gpus(agent) == []
