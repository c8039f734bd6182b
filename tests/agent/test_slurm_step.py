"""The Slurm step's own decisions (agent/slurm_step.py): which GPUs Slurm gave the task, the
rendezvous port every node computes alike, the collector's command, and a step that is not a
Slurm task or reads no attempt file refusing with a sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuneplane.agent.slurm_step import (
    PORT_BASE,
    PORT_SPAN,
    StepError,
    collector_argv,
    main,
    master_port,
    prepare_member,
    visible_gpus,
)
from tuneplane.proto.contract.slurm_attempt import CREDENTIAL_FILE, AttemptFile

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("env", "wanted", "gpus"),
    [
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, 2, ("2", "3")),
        ({"SLURM_STEP_GPUS": "5"}, 1, ("5",)),
        ({"SLURM_JOB_GPUS": "0,1"}, 2, ("0", "1")),
        ({"SLURM_GPUS_ON_NODE": "2"}, 2, ("0", "1")),  # counted, not named
        ({}, 0, ()),
    ],
)
def test_the_gpus_are_the_ones_slurm_names(
    env: dict[str, str], wanted: int, gpus: tuple[str, ...]
) -> None:
    assert visible_gpus(env, wanted) == gpus


def test_gpus_slurm_did_not_give_are_refused_with_a_sentence() -> None:
    with pytest.raises(
        StepError, match=r"gave this task the GPUs \('0',\), and the member wants 2"
    ):
        visible_gpus({"CUDA_VISIBLE_DEVICES": "0"}, 2)
    with pytest.raises(StepError, match=r"gres\.conf"):
        visible_gpus({"SLURM_GPUS_ON_NODE": "1"}, 2)


def test_every_node_computes_the_same_port_from_the_job_id() -> None:
    ports = {master_port(job_id) for job_id in range(0, 3 * PORT_SPAN, 997)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert master_port(41) == master_port(41) == PORT_BASE + 41


def test_a_step_outside_slurm_says_so(tmp_path: Path) -> None:
    attempt = AttemptFile("run-1", 1, 1, 0, "{}", {})
    (tmp_path / "attempt.json").write_text(attempt.to_json())
    with pytest.raises(StepError, match="SLURM_NODEID is not set"):
        prepare_member(tmp_path, {})
    with pytest.raises(StepError, match="the allocation has 2 nodes and the attempt 1 members"):
        prepare_member(tmp_path, {"SLURM_NODEID": "0", "SLURM_NNODES": "2"})


def test_a_missing_attempt_file_is_a_sentence_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "attempt.json cannot be read" in err and "shared folder" in err
    assert main([]) == 64


def test_the_collector_ships_with_the_members_own_credential(tmp_path: Path) -> None:
    here = tmp_path / "member-1"
    here.mkdir()
    gateways = ("127.0.0.1:7445", "10.0.0.2:7445")
    attempt = AttemptFile("run-1", 2, 2, 0, "{}", {}, {}, gateways, "PEM")
    assert collector_argv(attempt, here, here / "out", tmp_path / "spool") is None  # no file
    (here / CREDENTIAL_FILE).write_text("tpc_x\n")
    argv = collector_argv(attempt, here, here / "out", tmp_path / "spool", python="py")
    assert argv is not None and argv[:4] == ["py", "-m", "tuneplane.collector.cli", "run"]
    text = " ".join(argv)
    assert "--gateway 127.0.0.1:7445 --gateway 10.0.0.2:7445" in text
    assert f"--credential-file {here / CREDENTIAL_FILE}" in text
    assert "--run-id run-1 --attempt 2 --member 1" in text
    assert (here / "ca.pem").read_text() == "PEM"
    no_gateway = AttemptFile("run-1", 2, 2, 0, "{}", {})
    assert collector_argv(no_gateway, here, here / "out", tmp_path / "spool") is None
