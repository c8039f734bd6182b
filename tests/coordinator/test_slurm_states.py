"""Slurm's job states read as TunePlane Job states, wait statuses, GRES text, tokens and the
choice of OpenAPI version: the pure parts of tuneplane.coordinator.executors.slurm."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.coordinator.executors.slurm import (
    FAILURE_REASONS,
    SLURM_TO_JOB_STATE,
    ExitStatus,
    SlurmAuthRefused,
    SlurmJob,
    SlurmProtocolError,
    SlurmVersionUnsupported,
    choose_version,
    exit_status,
    failure_reason,
    gpu_count,
    job_state,
    observed_state,
    offered_versions,
    read_token_file,
    token_user,
)
from tuneplane.coordinator.lifecycle.states import JOB_TRANSITIONS, TERMINAL_JOB_STATES

# Every word Slurm 22.05's job_state_string() can return, and what each must read as.
EXPECTED = {
    "PENDING": "queued",
    "REQUEUED": "queued",
    "REQUEUE_FED": "queued",
    "CONFIGURING": "starting",
    "RUNNING": "running",
    "COMPLETING": "running",
    "SUSPENDED": "running",
    "SIGNALING": "running",
    "STAGE_OUT": "running",
    "RESIZING": "running",
    "COMPLETED": "succeeded",
    "CANCELLED": "cancelled",
    "FAILED": "failed",
    "TIMEOUT": "failed",
    "NODE_FAIL": "failed",
    "PREEMPTED": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
    "REQUEUE_HOLD": "failed",
    "RESV_DEL_HOLD": "failed",
    "SPECIAL_EXIT": "failed",
    "REVOKED": "failed",
    "STOPPED": "failed",
}


def test_every_slurm_state_has_its_tuneplane_state() -> None:
    assert SLURM_TO_JOB_STATE == EXPECTED
    for slurm, ours in EXPECTED.items():
        assert job_state(slurm) == ours
        assert job_state(slurm.lower()) == ours
        assert job_state(f" {slurm}\n") == ours


def test_mapped_states_are_tuneplane_job_states() -> None:
    assert set(SLURM_TO_JOB_STATE.values()) <= set(JOB_TRANSITIONS)


def test_every_failure_says_why_and_nothing_else_does() -> None:
    failed = {slurm for slurm, ours in EXPECTED.items() if ours == "failed"}
    assert set(FAILURE_REASONS) == failed
    for slurm in EXPECTED:
        reason = failure_reason(slurm)
        if slurm in failed:
            assert reason is not None and reason.endswith(".") and reason[0].isupper()
        else:
            assert reason is None


def test_unreachable_slurm_is_unknown_never_failed() -> None:
    assert job_state(None) == "unknown"
    assert observed_state(None) == "unknown"
    job = SlurmJob(job_id=1, name="x", slurm_state="RUNNING", reason="", exit=None, nodes="n1")
    assert observed_state(job) == "running"


@given(st.text())
def test_a_word_slurm_22_05_never_reports_is_unknown(word: str) -> None:
    if word.strip().upper() in EXPECTED:
        return
    assert job_state(word) == "unknown"
    assert job_state(word) not in TERMINAL_JOB_STATES


@given(st.integers(0, 255))
def test_an_exit_code_is_read_from_the_wait_status(code: int) -> None:
    assert exit_status(code << 8) == ExitStatus(code=code, signal=None)


@given(st.integers(1, 127), st.booleans())
def test_a_signal_is_read_from_the_wait_status(signal: int, core: bool) -> None:
    status = signal | (0x80 if core else 0)
    assert exit_status(status) == ExitStatus(code=128 + signal, signal=signal)


def test_wait_statuses_slurmrestd_reported() -> None:
    # Seen from slurmrestd v0.0.38: `exit 3` reported 768, scancel's SIGTERM 15.
    assert exit_status(768) == ExitStatus(code=3)
    assert exit_status(15) == ExitStatus(code=143, signal=15)
    assert exit_status(0) == ExitStatus(code=0)
    with pytest.raises(ValueError, match="never negative"):
        exit_status(-1)


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [
        (None, 0),
        ("", 0),
        ("(null)", 0),
        ("N/A", 0),
        ("gpu:2", 2),
        ("gpu:0", 0),
        ("gpu:h100:8(S:0-1)", 8),
        ("gpu:a100:4,gpu:v100:2", 6),
        ("gpu:h100:2(IDX:0,2),nic:1", 2),
        ("nic:4", 0),
        ("gpu", 1),
        ("gpu:h100", 1),
    ],
)
def test_gpus_in_gres_text(gres: str | None, gpus: int) -> None:
    assert gpu_count(gres) == gpus


@pytest.mark.parametrize("gres", ["gpu::2", ":2", "gpu 2"])
def test_unreadable_gres_text_is_an_error_not_zero(gres: str) -> None:
    with pytest.raises(ValueError, match="cannot read the GRES entry"):
        gpu_count(gres)


def _jwt(claims: object) -> str:
    def part(value: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'HS256', 'typ': 'JWT'})}.{part(claims)}.c2ln"


def test_the_token_names_its_user() -> None:
    token = _jwt({"exp": 2, "iat": 1, "sun": "alice"})
    assert token_user(token) == "alice"
    assert read_token_file(f"\nSLURM_JWT={token}\n") == token
    assert read_token_file(f"{token}\n") == token


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("not-a-jwt", "not a JWT"),
        ("a.!!!.c", "cannot be read"),
        (_jwt({"exp": 2}), "names no user"),
        (_jwt(["sun"]), "names no user"),
    ],
)
def test_a_token_that_is_not_a_slurm_jwt_is_refused_with_a_sentence(token: str, why: str) -> None:
    with pytest.raises(SlurmAuthRefused, match=why) as caught:
        token_user(token)
    assert "scontrol token" in str(caught.value)


def test_an_empty_token_file_is_refused() -> None:
    with pytest.raises(SlurmAuthRefused, match="token file is empty"):
        read_token_file("\n \n")


def _openapi(*versions: str) -> dict[str, object]:
    paths: dict[str, object] = {"/openapi/v3": {}}
    for v in versions:
        paths[f"/slurm/{v}/ping"] = {}
        paths[f"/slurm/{v}/jobs"] = {}
        paths[f"/slurmdb/{v}/jobs"] = {}
    return {"paths": paths}


def test_the_newest_common_version_is_chosen() -> None:
    offered = offered_versions(_openapi("v0.0.38", "v0.0.36", "v0.0.37"))
    assert offered == ["v0.0.36", "v0.0.37", "v0.0.38"]
    assert choose_version(offered) == "v0.0.38"


def test_no_common_version_is_refused_naming_both_lists() -> None:
    offered = offered_versions(_openapi("v0.0.39", "v0.0.40"))
    with pytest.raises(SlurmVersionUnsupported) as caught:
        choose_version(offered, "http://slurm:6820")
    message = str(caught.value)
    assert "v0.0.39, v0.0.40" in message and "v0.0.38" in message and "http://slurm:6820" in message
    with pytest.raises(SlurmVersionUnsupported, match="versions none"):
        choose_version(offered_versions(_openapi()))


def test_an_openapi_document_without_paths_is_a_protocol_error() -> None:
    with pytest.raises(SlurmProtocolError, match="no 'paths'"):
        offered_versions({"openapi": "3.0.2"})
