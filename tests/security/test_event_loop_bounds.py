"""Large requests are worked on off the coordinator's event loop (issue 8, must have 7), against a
real coordinator over loopback TLS.

A JobSpec of megabytes is read, resolved and digested in a bounded pool of worker processes: what
comes back is exactly what the inline path gives (same canonical JSON, same digest), a refusal
still names its field in a sentence and stores nothing, and eight at once never make more worker
processes than the pool allows. How long the loop is held is measured by ``nox -s bench --
loop_lag`` (docs/security.md), not asserted here.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sqlite3
import sys
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import anyio
import psutil
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.coordinator.grpc_client import api_client, enroll, jobspec, node_stream
from tests.security.raw_calls import call, frame
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.coordinator.gateways.bounded_decode import (
    LARGE_FIELDS,
    MAX_FIELD_BYTES,
    FieldTooLarge,
    check_field_sizes,
)
from tuneplane.coordinator.gateways.message_limits import (
    MAX_STATUS_MESSAGE_CHARS,
    encode_with,
    pre_encoded,
)
from tuneplane.coordinator.offload import (
    HEAVY_PROCESSES,
    HEAVY_SWITCH_INTERVAL_S,
    PROCESS_TEXT_CHARS,
    in_thread,
)
from tuneplane.proto import v1
from tuneplane.proto.contract import jobspec as jobspec_module

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("loop")) as c:
        yield c


def _rows(coord: CoordinatorProcess, table: str) -> int:
    path = coord.state_dir / "coordinator.db"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def _big_spec(experiment: str, megabytes: int = 2) -> dict[str, object]:
    spec = jobspec(gpus=1)
    spec["experiment"] = experiment
    spec["source_files"] = {
        "train.sh": base64.b64encode(b"echo hello\n").decode(),
        "data/blob.bin": base64.b64encode(os.urandom(megabytes * 1024 * 1024)).decode(),
    }
    return spec


def _workers(coord: CoordinatorProcess) -> list[str]:
    """The coordinator's child processes that are running, as "pid status command"."""
    found = []
    for child in psutil.Process(coord.pid).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{child.pid} {child.status()} {' '.join(child.cmdline())}")
        except psutil.NoSuchProcess:
            continue  # ended between the listing and the look
    return found


def test_a_jobspec_of_megabytes_is_admitted_as_the_inline_path_would(
    coord: CoordinatorProcess,
) -> None:
    spec = _big_spec("big")
    assert len(json.dumps(spec)) > PROCESS_TEXT_CHARS  # the worker-process path

    async def go() -> tuple[v1.PreviewReply, v1.Receipt, v1.Job]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            preview = await api.preview(spec)
            receipt = await api.commit(preview, "big-1")
            return preview, receipt, await api.job(receipt.run_id)

    preview, receipt, job = asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
    resolved = jobspec_module.loads(preview.resolved_jobspec_json)
    assert jobspec_module.canonical_json(resolved) == preview.resolved_jobspec_json
    assert jobspec_module.digest(resolved) == preview.digest == receipt.digest
    assert dict(resolved.source_files) == spec["source_files"]
    assert preview.summary.fleet and preview.summary.series == "h200"
    assert job.state == "queued" and job.run_id == receipt.run_id
    assert "Traceback" not in coord.read_log()


def test_a_refused_jobspec_of_megabytes_names_its_field_and_stores_nothing(
    coord: CoordinatorProcess,
) -> None:
    spec = jobspec(gpus=1)
    spec["experiment"] = "numbers"
    spec["parameters"] = {"x": [0.5] * (2 * 1024 * 1024)}  # 10 MiB of JSON numbers
    previews, jobs = _rows(coord, "previews"), _rows(coord, "jobs")

    async def go() -> GRPCError:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            with pytest.raises(GRPCError) as refused:
                await api.preview(spec)
            await api.stub.list_jobs(v1.ListJobsRequest())  # still serving
            return refused.value

    refusal = asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
    assert refusal.status is Status.INVALID_ARGUMENT
    message = refusal.message or ""
    assert message.startswith("JobSpec field 'parameters.x' = [0.5, 0.5"), message
    assert "is not a parameter of the recipe custom/custom" in message
    assert len(message) < 400, "the refused value is shown shortened, not whole"
    assert (_rows(coord, "previews"), _rows(coord, "jobs")) == (previews, jobs)
    assert "Traceback" not in coord.read_log()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # Not UTF-8, in a worker thread's decoding.
        (frame(1, b"\xff" * 400_000), "The PreviewRequest message cannot be decoded"),
        # A NUL deep in a JobSpec of megabytes is named by its field.
        (bytes(v1.PreviewRequest(jobspec_json="{" + " " * 400_000 + "\x00}")), "jobspec_json"),
    ],
    ids=["not-utf8", "nul"],
)
def test_a_bad_preview_body_of_megabytes_is_refused_and_stores_nothing(
    coord: CoordinatorProcess, body: bytes, expected: str
) -> None:
    assert len(body) > PROCESS_TEXT_CHARS
    previews = _rows(coord, "previews")
    refused = asyncio.run(
        call(coord.api, coord.ca_path, "/tuneplane.v1.Api/Preview", body, coord.admin_token)
    )
    assert refused.status == Status.INVALID_ARGUMENT, refused
    assert expected in refused.message
    assert _rows(coord, "previews") == previews
    assert "Traceback" not in coord.read_log()


def test_eight_megabyte_previews_at_once_share_a_bounded_pool(coord: CoordinatorProcess) -> None:
    specs = [_big_spec(f"many{n}", megabytes=1) for n in range(8)]
    seen: list[list[str]] = []

    async def go() -> list[v1.PreviewReply]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            calls = asyncio.gather(*(api.preview(s) for s in specs))
            while not calls.done():
                seen.append(_workers(coord))
                await asyncio.wait([calls], timeout=0.05)
            return await calls

    replies = asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
    assert len({r.preview_id for r in replies}) == 8
    for spec, reply in zip(specs, replies, strict=True):
        resolved = jobspec_module.loads(reply.resolved_jobspec_json)
        assert resolved.experiment == spec["experiment"]
        assert jobspec_module.digest(resolved) == reply.digest
    assert seen and max(len(s) for s in seen) <= HEAVY_PROCESSES, seen
    assert len(_workers(coord)) <= HEAVY_PROCESSES


def test_a_reply_encoded_off_the_loop_is_the_reply() -> None:
    reply = v1.PreviewReply(preview_id="pv-1", digest="sha256:00", created_at_ms=7)
    text = '{"api_version":"tuneplane/v1","x":"\u00e9' + "a" * 300 + '"}'
    encoded = encode_with(reply, "resolved_jobspec_json", text.encode("utf-8"))
    decoded = v1.PreviewReply().parse(encoded)
    assert decoded.resolved_jobspec_json == text
    assert (decoded.preview_id, decoded.digest, decoded.created_at_ms) == ("pv-1", "sha256:00", 7)
    assert pre_encoded(reply, encoded).SerializeToString() == encoded


def test_a_job_of_megabytes_is_prepared_with_its_admitted_jobspec_and_digest(
    tmp_path: Path,
) -> None:
    spec = _big_spec("launch")
    with start_coordinator(tmp_path, heartbeat_interval=0.5, heartbeat_timeout=5) as coord:
        token = coord.create_join_token()
        node = asyncio.run(enroll(coord.control, coord.ca_path, token, "node-big", 2))

        async def go() -> tuple[v1.PreviewReply, v1.Receipt, v1.Prepare]:
            async with (
                api_client(coord.api, coord.ca_path, coord.admin_token) as api,
                node_stream(
                    coord.control, coord.ca_path, node.node_credential, node.node_id
                ) as stream,
            ):
                preview = await api.preview(spec)
                receipt = await api.commit(preview, "launch-1")
                prepare: v1.Prepare = await stream.expect("prepare")
                return preview, receipt, prepare

        preview, receipt, prepare = asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
        assert prepare.member.run_id == receipt.run_id
        assert prepare.jobspec_json == preview.resolved_jobspec_json
        sealed = json.loads(prepare.capsule_files["capsule.json"])
        assert sealed["jobspec_digest"] == receipt.digest
        assert sealed["jobspec_digest"] == jobspec_module.digest(
            jobspec_module.loads(prepare.jobspec_json)
        )
        assert "Traceback" not in coord.read_log()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_the_worker_processes_end_with_the_coordinator(tmp_path: Path, how: str) -> None:
    coord = start_coordinator(tmp_path)
    with coord:

        async def go() -> v1.PreviewReply:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                return await api.preview(_big_spec("ends"))

        asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
        workers = psutil.Process(coord.pid).children(recursive=True)
        assert workers, "a JobSpec of megabytes is read in a worker process"
        if how == "SIGKILL":
            coord.kill()  # no shutdown code runs: each worker sees its pipe close
    # Otherwise leaving the block stopped the coordinator with SIGTERM (and checked exit 0).
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, [w.pid for w in alive]
    assert "Traceback" not in coord.read_log()


def _get_job_refused(coord: CoordinatorProcess, run_id: str) -> GRPCError:
    """The refusal of a GetJob of ``run_id``, after which the coordinator still answers."""

    async def go() -> GRPCError:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            with pytest.raises(GRPCError) as refused:
                await api.stub.get_job(v1.GetJobRequest(run_id=run_id))
            await api.stub.list_jobs(v1.ListJobsRequest())  # still serving
            return refused.value

    return asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))


def test_a_refusal_quoting_a_long_value_is_sent_shortened(coord: CoordinatorProcess) -> None:
    # GetJob quotes the run id it did not find: 200 KB of it (under MAX_FIELD_BYTES, so it is
    # decoded and looked up) as an HTTP/2 trailer would be HPACK-encoded on the event loop for
    # seconds (300 KB took 4.7 s).
    run_id = "r" * (200 * 1024)
    assert len(run_id) < MAX_FIELD_BYTES
    jobs = _rows(coord, "jobs")

    refusal = _get_job_refused(coord, run_id)
    assert refusal.status is Status.NOT_FOUND
    message = refusal.message or ""
    assert len(message) <= MAX_STATUS_MESSAGE_CHARS, len(message)
    assert message.endswith("characters; shortened)"), message[-120:]
    assert _rows(coord, "jobs") == jobs
    assert "Traceback" not in coord.read_log()


def test_a_field_of_megabytes_is_refused_before_it_is_decoded(coord: CoordinatorProcess) -> None:
    # An 11 MB run id used to be decoded into a string in a worker thread, which holds the
    # interpreter lock (and so the event loop) for about 10 ms; now its length is read from the
    # raw bytes and the call refused before any decoding.
    run_id = "r" * (11 * 1024 * 1024)
    jobs = _rows(coord, "jobs")

    refusal = _get_job_refused(coord, run_id)
    assert refusal.status is Status.RESOURCE_EXHAUSTED, refusal
    assert refusal.message == (
        f"GetJobRequest.run_id is {len(run_id)} bytes, more than the {MAX_FIELD_BYTES} bytes "
        "TunePlane accepts in that field. Send a shorter value."
    )
    assert _rows(coord, "jobs") == jobs
    assert "Traceback" not in coord.read_log()


def test_field_sizes_are_checked_on_the_raw_bytes_at_every_depth() -> None:
    long = "x" * (MAX_FIELD_BYTES + 1)
    # A nested string is named by its whole path; a field the message does not declare is
    # bounded too (protobuf would skip it, after it cost a copy).
    report = bytes(v1.NodeMessage(report=v1.MemberReport(reason=long)))
    with pytest.raises(FieldTooLarge, match=r"^NodeMessage\.report\.reason is "):
        check_field_sizes(report, v1.NodeMessage)
    unknown = bytes(v1.ListJobsRequest()) + frame(31, long.encode())
    with pytest.raises(FieldTooLarge, match=r"^ListJobsRequest\.<field 31> is "):
        check_field_sizes(unknown, v1.ListJobsRequest)
    # What may be long: a Preview's JobSpec, and a message whose fields are each small.
    check_field_sizes(
        bytes(v1.PreviewRequest(jobspec_json=long)),
        v1.PreviewRequest,
        LARGE_FIELDS[v1.PreviewRequest],
    )
    held = v1.Hello(
        held=[v1.HeldMember(state=v1.MemberState(v1.MemberState.RUNNING)) for _ in range(10_000)]
    )
    check_field_sizes(bytes(v1.NodeMessage(hello=held)), v1.NodeMessage)
    # Exactly at the bound is accepted.
    check_field_sizes(bytes(v1.GetJobRequest(run_id="r" * MAX_FIELD_BYTES)), v1.GetJobRequest)


def test_threads_switch_fast_only_while_work_on_a_large_body_is_in_flight() -> None:
    before = sys.getswitchinterval()

    async def go() -> list[float]:
        seen: list[float] = []
        release = threading.Event()

        def work(fail: bool) -> None:
            seen.append(sys.getswitchinterval())
            release.wait(TIMEOUT_S)
            if fail:
                raise ValueError("refused")

        async def failing() -> None:
            with pytest.raises(ValueError):
                await in_thread(work, True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(in_thread, work, False)
            tg.start_soon(failing)
            while len(seen) < 2:
                await anyio.sleep(0.001)
            release.set()
        seen.append(sys.getswitchinterval())
        return seen

    during_a, during_b, after = anyio.run(go)
    assert during_a == during_b == pytest.approx(HEAVY_SWITCH_INTERVAL_S)
    assert after == before == sys.getswitchinterval()
