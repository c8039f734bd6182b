"""The Api's lifecycle replies (coordinator/wire/lifecycle.py): a cancel's outcome, a retry's new
attempt, a page of logs and what declaring a Node lost did come back equal from the wire."""

from __future__ import annotations

from typing import TypeVar

import betterproto
import pytest
from hypothesis import given

from tests.support import value_strategies as vs
from tuneplane.coordinator.values.lifecycle import (
    CancelOutcome,
    LogPage,
    NodeLossOutcome,
    RetryOutcome,
)
from tuneplane.coordinator.wire.lifecycle import (
    cancel_from_wire,
    cancel_to_wire,
    logs_from_wire,
    logs_to_wire,
    node_loss_from_wire,
    node_loss_to_wire,
    retry_from_wire,
    retry_to_wire,
)
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(120)

M = TypeVar("M", bound=betterproto.Message)


def through_bytes(msg: M) -> M:
    return type(msg)().parse(bytes(msg))


@given(vs.cancel_outcomes)
def test_a_cancel_outcome_comes_back_equal(done: CancelOutcome) -> None:
    assert cancel_from_wire(through_bytes(cancel_to_wire(done))) == done


@given(vs.retry_outcomes)
def test_a_retry_outcome_comes_back_equal(done: RetryOutcome) -> None:
    assert retry_from_wire(through_bytes(retry_to_wire(done))) == done


@given(vs.log_pages)
def test_a_log_page_comes_back_equal(page: LogPage) -> None:
    assert logs_from_wire(through_bytes(logs_to_wire(page))) == page


@given(vs.node_losses)
def test_a_node_loss_comes_back_equal(loss: NodeLossOutcome) -> None:
    assert node_loss_from_wire(through_bytes(node_loss_to_wire(loss))) == loss


def test_a_reply_without_its_job_reads_as_an_empty_job() -> None:
    done = cancel_from_wire(through_bytes(v1.CancelJobReply(outcome="already_ended")))
    assert (done.outcome, done.job.run_id, done.job.attempts) == ("already_ended", "", ())
