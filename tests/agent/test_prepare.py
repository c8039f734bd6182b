"""Prepare steps on real files: GPU checks, capsule materialisation and digests, ports."""

from __future__ import annotations

import base64
import hashlib
import socket
from pathlib import Path

import pytest

from tuneplane.agent.inventory import Gpu, Inventory, SimulatedGpus, simulated_inventory
from tuneplane.agent.journal_records import MemberKey
from tuneplane.agent.prepare import (
    CAPSULE_DIR,
    PrepareRefused,
    check_gpus,
    materialise,
    node_address,
    pick_port,
)

KEY = MemberKey("run-1", 1, 0)
INV = simulated_inventory("node-a", SimulatedGpus("h200", 2))


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_free_healthy_gpus_pass() -> None:
    uuids = tuple(g.uuid for g in INV.gpus)
    assert check_gpus(KEY, (0, 1), (), INV, {}) == uuids
    assert check_gpus(KEY, (1, 0), uuids[::-1], INV, {}) == uuids[::-1]
    check_gpus(KEY, (0,), (), INV, {uuids[0]: KEY})  # its own, after a repeated Prepare


@pytest.mark.parametrize(
    ("gpus", "owners", "why"),
    [
        ((0, 0), {}, "more than once"),
        ((2,), {}, "GPU 2 does not exist on this Node"),
        (
            (1,),
            {INV.gpus[1].uuid: MemberKey("run-0", 1, 0)},
            r"GPU 1 is busy: member run-0.1.0 owns it \(GPU-sim-node-a-1\)",
        ),
    ],
)
def test_gpu_refusals_are_sentences(
    gpus: tuple[int, ...], owners: dict[str, MemberKey], why: str
) -> None:
    with pytest.raises(PrepareRefused, match=why):
        check_gpus(KEY, gpus, (), INV, owners)


def test_an_unhealthy_gpu_is_never_assigned() -> None:
    sick = Gpu(0, "GPU-x", "H200", "h200", 1, False, False, "XID 79 event reported by the driver")
    inv = Inventory("h", 1, 1, (sick,), "nvml")
    with pytest.raises(PrepareRefused, match="unhealthy: XID 79"):
        check_gpus(KEY, (0,), (), inv, {})


def test_materialise_writes_capsule_and_experiment(tmp_path: Path) -> None:
    capsule = {"capsule.json": b'{"a": 1}', "bootstrap.sh": b"#!/bin/sh\n"}
    digests = {name: sha(data) for name, data in capsule.items()}
    sources = {"train.sh": base64.b64encode(b"echo hi\n").decode(), "conf/c.yaml": "eDogMQo="}
    member = tmp_path / "m"
    work = materialise(member, "{}", capsule, digests, sources)
    assert (work / "train.sh").read_bytes() == b"echo hi\n"
    assert (work / "conf" / "c.yaml").read_text() == "x: 1\n"
    assert (work / CAPSULE_DIR / "capsule.json").read_bytes() == b'{"a": 1}'
    assert (member / "jobspec.json").read_text() == "{}"
    # Idempotent: the same Prepare again gives the same files.
    assert materialise(member, "{}", capsule, digests, sources) == work


def test_a_digest_mismatch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PrepareRefused, match="does not match its digest"):
        materialise(tmp_path, "{}", {"a": b"x"}, {"a": sha(b"y")}, {})
    with pytest.raises(PrepareRefused, match="do not name the same files"):
        materialise(tmp_path, "{}", {"a": b"x"}, {"b": sha(b"x")}, {})


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", ""])
def test_paths_outside_the_member_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(PrepareRefused, match="not a plain relative path"):
        materialise(tmp_path / "m", "{}", {}, {}, {name: "eA=="})
    assert not (tmp_path / "escape").exists()


def test_pick_port_returns_a_bindable_port() -> None:
    port = pick_port("127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert node_address("127.0.0.1", 443) == "127.0.0.1"
