"""The Api's Job calls (coordinator/wire/jobs.py): a Job with its attempts, members, histories and
first failure, a preview and a receipt each come back equal from the wire, as ``tp`` reads what
the handlers wrote."""

from __future__ import annotations

from typing import TypeVar

import attrs
import betterproto
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support import value_strategies as vs
from tuneplane.coordinator.values.jobs import Job, Preview, PreviewSummary, Receipt
from tuneplane.coordinator.wire.jobs import (
    job_from_wire,
    job_to_wire,
    jobs_from_wire,
    jobs_to_wire,
    preview_from_wire,
    preview_to_wire,
    receipt_from_wire,
    receipt_to_wire,
)
from tuneplane.proto import v1
from tuneplane.proto.contract.derivation_source import ManifestSummary

pytestmark = pytest.mark.timeout(120)

M = TypeVar("M", bound=betterproto.Message)


def through_bytes(msg: M) -> M:
    return type(msg)().parse(bytes(msg))


@given(vs.jobs)
def test_a_job_comes_back_equal(job: Job) -> None:
    assert job_from_wire(through_bytes(job_to_wire(job))) == job


@given(st.lists(vs.jobs, max_size=3))
def test_a_job_list_comes_back_equal(jobs: list[Job]) -> None:
    assert jobs_from_wire(through_bytes(jobs_to_wire(jobs))) == jobs


@given(vs.previews)
def test_a_preview_comes_back_equal(preview: Preview) -> None:
    assert preview_from_wire(through_bytes(preview_to_wire(preview))) == preview


@given(vs.receipts)
def test_a_receipt_comes_back_equal(receipt: Receipt) -> None:
    assert receipt_from_wire(through_bytes(receipt_to_wire(receipt))) == receipt


def test_a_preview_s_owner_stays_on_the_server() -> None:
    summary = PreviewSummary("default", "node", "h200", 8, 2, "h200:16")
    stored = Preview("pv-1", "sha256:ab", "{}", summary, 1_700_000_000_000, owner="ada")
    reply = through_bytes(preview_to_wire(stored))
    assert "ada" not in str(reply)
    assert preview_from_wire(reply) == attrs.evolve(stored, owner="")


def test_a_job_without_a_first_failure_or_a_rendezvous_reads_as_none_and_empty() -> None:
    msg = v1.Job(run_id="run-1", attempts=[v1.Attempt(number=1, state="preparing")])
    job = job_from_wire(through_bytes(msg))
    assert job.first_failure is None
    (attempt,) = job.attempts
    assert (attempt.master_addr, attempt.master_port) == ("", 0)


def test_a_member_without_a_manifest_has_none_and_one_with_a_problem_keeps_it() -> None:
    problem = ManifestSummary(problem="The output directory holds more than 100000 files.")
    msg = v1.Job(
        run_id="run-1",
        attempts=[
            v1.Attempt(
                number=1,
                members=[
                    v1.Member(index=0),
                    v1.Member(index=1, output_manifest=v1.OutputManifest(problem=problem.problem)),
                ],
            )
        ],
    )
    (attempt,) = job_from_wire(through_bytes(msg)).attempts
    assert [m.output_manifest for m in attempt.members] == [None, problem]
