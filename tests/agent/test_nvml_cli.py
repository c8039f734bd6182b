"""What `doctor` and `status` say about NVML, and `gpu release`, with real processes.

Each command is the real ``tuneplane-node`` in its own process reading the scripted NVML
(``--scripted-nvml FILE``); the release test runs a real coordinator and agent on loopback TLS
and checks, through the scripted NVML's call log, that the agent let go of NVML and took it back.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import AgentProcess, node_cli, start_agent, wait_until
from tests.support.coordinator import start_coordinator
from tuneplane.agent.scripted_nvml import write_script

A, B = "GPU-aaaa-0000", "GPU-bbbb-1111"


def cards() -> list[dict[str, Any]]:
    return [{"uuid": u, "name": "NVIDIA H200", "memory": 141 * 2**30} for u in (A, B)]


def doctor(tmp_path: Path, script: dict[str, Any]) -> list[str]:
    """doctor's NVML, GPU and XID lines for a state dir that is not enrolled."""
    path = tmp_path / "nvml.json"
    write_script(path, script)
    done = subprocess.run(
        node_cli("doctor", "--state-dir", str(tmp_path / "state"), "--scripted-nvml", str(path)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1  # not enrolled: the state dir lines fail whatever NVML says
    keep = ("NVML", "GPU ", "XID", "MIG")
    return [ln for ln in done.stdout.splitlines() if ln[6:].startswith(keep) or "MIG device" in ln]


def test_doctor_reports_each_gpu_and_the_xid_registration(tmp_path: Path) -> None:
    gpus = cards()
    gpus[1]["ecc_uncorrected"] = 2
    assert doctor(tmp_path, {"gpus": gpus}) == [
        "ok    NVML (scripted-nvml): 2 GPUs, driver 550.54.15, CUDA 12.4",
        f"ok    GPU 0 {A} NVIDIA H200: healthy",
        f"FAIL  GPU 1 {B} NVIDIA H200: UNHEALTHY: 2 uncorrected ECC errors since the driver loaded",
        "ok    XID events: registered on all 2 GPUs",
    ]


def test_doctor_shows_mig_state_and_a_failed_event_registration(tmp_path: Path) -> None:
    gpus = cards()
    gpus[0]["mig"] = {"current": 1, "devices": [{"uuid": "MIG-1", "memory": 2**34,
                                                  "profile": "2g.20gb"}]}  # fmt: skip
    gpus[1]["errors"] = {"nvmlDeviceRegisterEvents": "NO_PERMISSION"}
    lines = doctor(tmp_path, {"gpus": gpus})
    assert lines[1] == (
        f"FAIL  GPU 0 {A} NVIDIA H200, MIG enabled: UNHEALTHY: MIG is enabled; TunePlane "
        f"assigns whole GPUs only: disable it with `nvidia-smi -i {A} -mig 0` and reset the GPU"
    )
    assert lines[2] == "        MIG device MIG-1 2g.20gb 16.0 GiB"
    assert lines[-1] == (
        "FAIL  XID events: registered on 1 of 2 GPUs (Insufficient Permissions "
        "(NVML_ERROR_NO_PERMISSION))"
    )


def test_doctor_tells_a_missing_library_from_a_broken_driver(tmp_path: Path) -> None:
    missing = doctor(tmp_path, {"init_error": "LIBRARY_NOT_FOUND", "gpus": cards()})
    assert missing == [
        "ok    NVML library not found: this Node reports 0 GPUs (right for a machine without "
        "NVIDIA GPUs)"
    ]
    for code, advice in [
        ("DRIVER_NOT_LOADED", "load it (`modprobe nvidia`)"),
        ("LIB_RM_VERSION_MISMATCH", "reload the nvidia modules or reboot"),
        ("NO_PERMISSION", "run it as root or fix the device permissions"),
    ]:
        (line,) = doctor(tmp_path, {"init_error": code, "gpus": cards()})
        assert line.startswith("FAIL  NVML (scripted-nvml): NVML could not start: ")
        assert f"(NVML_ERROR_{code})" in line and advice in line


def test_doctor_names_a_lost_card_and_still_reads_the_other(tmp_path: Path) -> None:
    gpus = cards()
    gpus[0]["lost"] = True
    lines = doctor(tmp_path, {"gpus": gpus})
    assert lines[1] == (
        "FAIL  GPU 0  unknown: UNHEALTHY: NVML could not read its handle: GPU is lost "
        "(NVML_ERROR_GPU_IS_LOST)"
    )
    assert lines[2] == f"ok    GPU 1 {B} NVIDIA H200: healthy"


def test_a_bad_script_or_two_gpu_sources_is_a_sentence(tmp_path: Path) -> None:
    (tmp_path / "nvml.json").write_text("{not json")
    done = subprocess.run(
        node_cli("doctor", "--state-dir", str(tmp_path / "s"), "--scripted-nvml",
                 str(tmp_path / "nvml.json")),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert f"FAIL  The scripted NVML file {tmp_path / 'nvml.json'} is not valid JSON" in (
        done.stdout
    )
    both = subprocess.run(
        node_cli("run", "--state-dir", str(tmp_path / "s"), "--simulate-gpus", "h200:1",
                 "--scripted-nvml", str(tmp_path / "nvml.json")),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert both.returncode == 2
    assert "--simulate-gpus and --scripted-nvml cannot be used together" in both.stderr


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[AgentProcess, Path]]:
    script = tmp_path / "nvml.json"
    calls = tmp_path / "calls.log"
    write_script(script, {"calls_log": str(calls), "gpus": cards()})
    with start_coordinator(tmp_path / "coord") as coord:
        node = start_agent(
            tmp_path, coord, "node-a", simulate_gpus=None,
            run_args=("--scripted-nvml", str(script), "--inventory-interval", "0.3",
                      "--probe-limit", "2"),
        )  # fmt: skip
        try:
            node.wait_connected()
            yield node, calls
        finally:
            node.stop()


def reasons(node: AgentProcess) -> list[str]:
    return [g["health_reason"] for g in node.status().get("inventory", {}).get("gpus", [])]


def test_gpu_release_lets_go_of_nvml_and_takes_it_back(
    agent: tuple[AgentProcess, Path],
) -> None:
    node, calls = agent
    wait_until("both GPUs healthy", lambda: reasons(node) == ["", ""])
    status = node.cli("status")
    assert status.returncode == 0, status.stderr
    assert "GPUs (scripted-nvml): 2" in status.stdout
    assert "XID events: registered on all 2 GPUs" in status.stdout
    before = len(calls.read_text().splitlines())  # (enroll's own read is in the log too)
    done = node.cli("gpu", "release", "--minutes", "5", "--wait", "30")
    assert done.returncode == 0, done.stderr
    assert "The agent let go of NVML until" in done.stdout
    log = [ln.split()[0] for ln in calls.read_text().splitlines()[before:]]
    assert log == ["nvmlEventSetFree", "nvmlShutdown"]  # no NVML held now
    assert all(r.startswith("NVML released for a GPU reset by the operator") for r in reasons(node))
    request = json.loads((node.state_dir / "gpu-release.json").read_text())
    assert request["until_ms"] > 0
    shown = node.cli("status").stdout
    assert "UNHEALTHY (NVML released for a GPU reset by the operator until" in shown
    back = node.cli("gpu", "release", "--end", "--wait", "30")
    assert back.returncode == 0, back.stderr
    wait_until("both GPUs healthy again", lambda: reasons(node) == ["", ""])
    log = [ln.split()[0] for ln in calls.read_text().splitlines()[before:]]
    assert log[:4] == ["nvmlEventSetFree", "nvmlShutdown", "nvmlInit", "nvmlEventSetCreate"]


def test_a_hung_nvml_call_marks_the_gpus_and_never_blocks_shutdown(
    agent: tuple[AgentProcess, Path], tmp_path: Path
) -> None:
    node, _calls = agent
    wait_until("both GPUs healthy", lambda: reasons(node) == ["", ""])
    gpus = cards()
    gpus[1]["hang"] = ["nvmlDeviceGetTotalEccErrors"]
    write_script(tmp_path / "nvml.json", {"gpus": gpus})
    unresponsive = "NVML unresponsive: a read did not finish within 2 s"
    wait_until(
        "the GPUs to read NVML unresponsive",
        lambda: all(r.startswith(unresponsive) for r in reasons(node)) and reasons(node),
    )
    assert node.status()["inventory"]["problem"].startswith(unresponsive)
    started = time.monotonic()
    node.stop()  # SIGTERM, exit status 0: the agent closed its journal, the thread is left
    assert time.monotonic() - started < 10
    assert "agent stopped node_id=" in node.read_log()


def test_a_broken_read_at_start_up_does_not_stop_the_agent(tmp_path: Path) -> None:
    script = tmp_path / "nvml.json"
    gpus = cards()
    gpus[1]["lost"] = True
    write_script(script, {"gpus": gpus, "errors": {"nvmlDeviceGetCount": "UNKNOWN"}})
    with start_coordinator(tmp_path / "coord") as coord:
        node = start_agent(
            tmp_path, coord, "node-a", simulate_gpus=None,
            run_args=("--scripted-nvml", str(script), "--inventory-interval", "0.3"),
        )  # fmt: skip
        try:
            # The whole read fails at start: the agent runs, connects and says why.
            status = node.wait_connected()
            assert status["inventory"]["problem"] == (
                "NVML could not count the GPUs: Unknown Error (NVML_ERROR_UNKNOWN)"
            )
            # One lost card: the other is offered, the lost one is named with the error.
            write_script(script, {"gpus": gpus})
            lost = "NVML could not read its handle: GPU is lost (NVML_ERROR_GPU_IS_LOST)"
            wait_until("the cards to be read", lambda: reasons(node) == ["", lost])
            assert node.alive()
        finally:
            node.stop()


def test_the_node_unit_starts_after_nvidia_persistenced() -> None:
    unit = Path(__file__).resolve().parents[2] / "packaging/systemd/tuneplane-node.service"
    after = [ln for ln in unit.read_text().splitlines() if ln.startswith("After=")]
    assert any("nvidia-persistenced.service" in ln[len("After=") :].split() for ln in after)
    # Ordering only: a Node without the service (a CPU machine) must still start the agent.
    assert "nvidia-persistenced" not in " ".join(
        ln for ln in unit.read_text().splitlines() if ln.startswith(("Requires=", "BindsTo="))
    )


def test_doctor_leaves_nvml_alone_while_it_is_released(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    until = int(time.time() * 1000) + 600_000
    write_script(state / "gpu-release.json", {"until_ms": until})
    calls = tmp_path / "calls.log"
    lines = doctor(tmp_path, {"calls_log": str(calls), "gpus": cards()})
    assert len(lines) == 1 and lines[0].startswith("ok    NVML is released for a GPU reset until")
    assert not calls.exists()  # doctor did not initialise NVML
