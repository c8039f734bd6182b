"""The Slurm step's own decisions (agent/slurm_step.py): which GPUs Slurm gave the task, the
rendezvous port every node computes alike, the collector's command, a step that is not a
Slurm task or reads no attempt file refusing with a sentence, and each run of a requeued Slurm
job (SLURM_RESTART_COUNT) running in its own member folder (the real step and runner, no
slurmctld: only `scontrol show hostnames`, which reads a slurm.conf)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
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
    restart_count,
    visible_gpus,
)
from tuneplane.coordinator import capsule
from tuneplane.proto.contract import jobspec
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
    spool = tmp_path / "spool"
    assert collector_argv(attempt, tmp_path, 1, 0, spool) is None  # no credential file
    (here / CREDENTIAL_FILE).write_text("tpc_x\n")
    argv = collector_argv(attempt, tmp_path, 1, 0, spool, python="py")
    assert argv is not None and argv[:4] == ["py", "-m", "tuneplane.collector.cli", "run"]
    text = " ".join(argv)
    assert "--gateway 127.0.0.1:7445 --gateway 10.0.0.2:7445" in text
    assert f"--credential-file {here / CREDENTIAL_FILE}" in text
    assert f"--out-dir {here / 'out'} " in text
    assert text.endswith("--run-id run-1 --attempt 2 --member 1")  # no source prefix
    assert (here / "ca.pem").read_text() == "PEM"
    no_gateway = AttemptFile("run-1", 2, 2, 0, "{}", {})
    assert collector_argv(no_gateway, tmp_path, 1, 0, spool) is None


def test_a_requeued_runs_collector_reads_the_first_runs_credential_and_prefixes_its_sources(
    tmp_path: Path,
) -> None:
    first = tmp_path / "member-0"
    first.mkdir()
    (first / CREDENTIAL_FILE).write_text("tpc_x\n")
    again = tmp_path / "restart-2" / "member-0"
    again.mkdir(parents=True)
    attempt = AttemptFile("run-1", 1, 1, 0, "{}", {}, {}, ("127.0.0.1:7445",), "PEM")
    argv = collector_argv(attempt, tmp_path, 0, 2, tmp_path / "spool", python="py")
    assert argv is not None
    text = " ".join(argv)
    # The credential is read where the coordinator wrote it, never copied into the new run.
    assert f"--credential-file {first / CREDENTIAL_FILE}" in text
    assert not (again / CREDENTIAL_FILE).exists()
    assert f"--out-dir {again / 'out'} " in text and f"--ca {again / 'ca.pem'} " in text
    assert text.endswith("--member 0 --source-prefix restart-2/")


@pytest.mark.parametrize(("value", "count"), [(None, 0), ("", 0), ("0", 0), ("3", 3)])
def test_the_restart_count_is_slurms_and_absent_means_the_first_run(
    value: str | None, count: int
) -> None:
    env = {} if value is None else {"SLURM_RESTART_COUNT": value}
    assert restart_count(env) == count


def test_a_restart_count_that_is_not_a_count_is_refused_with_a_sentence() -> None:
    with pytest.raises(StepError, match="SLURM_RESTART_COUNT is '-1', not a count of requeues"):
        restart_count({"SLURM_RESTART_COUNT": "-1"})


def _step(folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The real step, as srun starts it, in a Slurm task's environment."""
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.slurm_step", str(folder)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's scontrol")
def test_a_requeued_run_runs_in_its_own_folder_and_leaves_the_first_runs_as_it_ended(
    tmp_path: Path,
) -> None:
    conf = tmp_path / "slurm.conf"  # enough for `scontrol show hostnames`, which reads no daemon
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=node1 CPUs=1\n")
    spec = jobspec.JobSpec(
        api_version=jobspec.API_VERSION, project="p", experiment="e", method_id="custom/custom",
        recipe_digest="sha256:0", runtime_id="host:bash", entrypoint=("bash", "train.sh"),
        resources=jobspec.Resources(profile="cpu", series="cpu", gpus=0), grace_period_s=2,
        source_files={"train.sh": base64.b64encode(b'echo "ran in $PWD"\n').decode()},
    )  # fmt: skip
    files = capsule.seal(spec, "member", "run-1", 1, 1)
    folder = tmp_path / "run-1" / "attempt-1"
    folder.mkdir(parents=True)
    attempt = AttemptFile("run-1", 1, 1, 0, jobspec.canonical_json(spec), files,
                          capsule.digests(files))  # fmt: skip
    (folder / "attempt.json").write_text(attempt.to_json())
    env = {"SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1",
           "SLURM_JOB_ID": "41", "SLURM_CONF": str(conf), "PATH": os.environ["PATH"]}  # fmt: skip
    first = _step(folder, env)
    assert first.returncode == 0, first.stderr
    # The same run started again meets its claimed launch and refuses (as before requeues).
    assert _step(folder, env).returncode != 0
    again = _step(folder, {**env, "SLURM_RESTART_COUNT": "1"})
    assert again.returncode == 0, again.stderr
    run0, run1 = folder / "member-0", folder / "restart-1" / "member-0"
    assert (run0 / "stdout.log").read_text() == f"ran in {run0 / 'work'}\n"
    assert (run1 / "stdout.log").read_text() == f"ran in {run1 / 'work'}\n"
    for here in (run0, run1):
        assert json.loads((here / "exit.json").read_text())["exit_code"] == 0
        assert (here / "work" / "train.sh").exists()
