"""The one table from a failed gRPC call to what a client says and does (agent/call_failure.py),
and the three clients that map it to their own errors: the Node's wire edge, the collector's
shipper and tp's ApiClient."""

from __future__ import annotations

import asyncio
import errno
import ssl
from pathlib import Path

import pytest
import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from tuneplane.agent import wire
from tuneplane.agent.call_failure import (
    CALL_ERRORS,
    REFUSAL_STATUSES,
    CallFailure,
    Kind,
    classify,
)
from tuneplane.collector.ship_wire import Gateway, Progress, ShipFailed, open_telemetry_client
from tuneplane.coordinator.cli.api_client import ApiClient
from tuneplane.coordinator.cli.api_errors import CoordinatorUnreachable, RequestRefused
from tuneplane.coordinator.cli.connection import Endpoint
from tuneplane.coordinator.server.tls import create_dev_ca

pytestmark = pytest.mark.timeout(30)

SAID = "The join token was already used; ask the operator for a new one."


def cert_error() -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, "certificate verify failed")
    exc.verify_message = "self-signed certificate in certificate chain"
    return exc


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (Status.INVALID_ARGUMENT, Kind.REFUSED),
        (Status.FAILED_PRECONDITION, Kind.REFUSED),
        (Status.NOT_FOUND, Kind.REFUSED),
        (Status.ALREADY_EXISTS, Kind.REFUSED),
        (Status.PERMISSION_DENIED, Kind.REFUSED),
        (Status.UNAUTHENTICATED, Kind.REFUSED),
        (Status.RESOURCE_EXHAUSTED, Kind.REFUSED),
        (Status.OUT_OF_RANGE, Kind.REFUSED),
        (Status.ABORTED, Kind.REFUSED),
        (Status.UNIMPLEMENTED, Kind.REFUSED),
        (Status.DEADLINE_EXCEEDED, Kind.TIMED_OUT),
        (Status.UNAVAILABLE, Kind.UNAVAILABLE),
        (Status.INTERNAL, Kind.UNAVAILABLE),
        (Status.UNKNOWN, Kind.UNAVAILABLE),
        (Status.CANCELLED, Kind.UNAVAILABLE),
        (Status.DATA_LOSS, Kind.UNAVAILABLE),
    ],
)
def test_every_status_has_one_kind(status: Status, kind: Kind) -> None:
    assert classify(GRPCError(status, SAID)) == CallFailure(kind, status.name, SAID)


def test_the_table_covers_every_status_but_ok() -> None:
    refusing = {s for s in Status if s is not Status.OK and s in REFUSAL_STATUSES}
    assert refusing == set(REFUSAL_STATUSES)
    for status in Status:
        if status is not Status.OK:
            assert classify(GRPCError(status)) is not None


def unverified(detail: str) -> CallFailure:
    return CallFailure(Kind.UNVERIFIED, "", detail)


def tls_failed(detail: str) -> CallFailure:
    return CallFailure(Kind.TLS_FAILED, "", detail)


def unreachable(detail: str) -> CallFailure:
    return CallFailure(Kind.UNREACHABLE, "", detail)


def broken(detail: str) -> CallFailure:
    return CallFailure(Kind.BROKEN, "", detail)


REFUSED_CONNECTION = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (cert_error(), unverified("self-signed certificate in certificate chain")),
        (ssl.SSLError(1, "wrong version number"), tls_failed("wrong version number")),
        (TimeoutError(), CallFailure(Kind.TIMED_OUT)),
        (trio.TooSlowError(), CallFailure(Kind.TIMED_OUT)),
        (REFUSED_CONNECTION, unreachable("Connection refused")),
        (OSError(), unreachable("OSError")),
        (
            StreamTerminatedError("Connection lost"),
            broken("StreamTerminatedError: Connection lost"),
        ),
        (ProtocolError("bad frame"), broken("ProtocolError: bad frame")),
        (EOFError(), broken("EOFError")),
    ],
)
def test_transport_failures_have_one_kind(exc: BaseException, expected: CallFailure) -> None:
    assert isinstance(exc, CALL_ERRORS)
    assert classify(exc) == expected


@pytest.mark.parametrize("exc", [ValueError("a bug"), KeyError("x"), RuntimeError()])
def test_what_is_not_a_call_failure_is_no_kind(exc: BaseException) -> None:
    assert not isinstance(exc, CALL_ERRORS)
    with pytest.raises(TypeError, match="is not a failed call; catch only CALL_ERRORS"):
        classify(exc)


def test_only_a_refusal_and_a_foreign_certificate_are_not_worth_retrying() -> None:
    assert {k for k in Kind if not CallFailure(k).retry_helps} == {Kind.REFUSED, Kind.UNVERIFIED}


def sentence(failure: CallFailure) -> str:
    return failure.sentence(
        "the coordinator at 10.0.0.5:7444",
        "Enroll",
        10.0,
        Path("/etc/tuneplane/ca.pem"),
        "pass the coordinator's tls/ca.pem",
        "that node.json names its control listener",
    )


@pytest.mark.parametrize(
    ("failure", "text"),
    [
        (CallFailure(Kind.REFUSED, "UNAUTHENTICATED", SAID),
         f"The coordinator at 10.0.0.5:7444 refused Enroll (UNAUTHENTICATED): {SAID}"),
        (CallFailure(Kind.REFUSED, "NOT_FOUND"),
         "The coordinator at 10.0.0.5:7444 refused Enroll (NOT_FOUND): gRPC status NOT_FOUND."),
        (CallFailure(Kind.UNAVAILABLE, "UNAVAILABLE", "shutting down"),
         "The coordinator at 10.0.0.5:7444 could not serve Enroll now (UNAVAILABLE: shutting "
         "down)."),
        (CallFailure(Kind.TIMED_OUT),
         "The coordinator at 10.0.0.5:7444 did not answer Enroll within 10 s; check that it is "
         "running and reachable."),
        (CallFailure(Kind.UNVERIFIED, "", "self-signed certificate"),
         "TLS verification of the coordinator at 10.0.0.5:7444 failed (self-signed certificate): "
         "its certificate does not verify against the CA; it is not signed by the CA in "
         "/etc/tuneplane/ca.pem. Pass the coordinator's tls/ca.pem."),
        (CallFailure(Kind.TLS_FAILED, "", "wrong version number"),
         "TLS with the coordinator at 10.0.0.5:7444 failed (wrong version number); check that "
         "node.json names its control listener."),
        (CallFailure(Kind.UNREACHABLE, "", "Connection refused"),
         "Cannot reach the coordinator at 10.0.0.5:7444 (Connection refused); check that it is "
         "running and that node.json names its control listener."),
        (CallFailure(Kind.BROKEN, "", "EOFError"),
         "The connection to the coordinator at 10.0.0.5:7444 broke during Enroll (EOFError); "
         "check that node.json names its control listener."),
    ],
)  # fmt: skip
def test_each_kind_is_one_sentence(failure: CallFailure, text: str) -> None:
    assert sentence(failure) == text


# -- the three clients ------------------------------------------------------------------------


def agent_error(exc: BaseException) -> wire.WireError:
    endpoint = wire.Endpoint.parse("10.0.0.5:7444")
    with pytest.raises(wire.WireError) as caught, wire.translated(endpoint, Path("ca.pem"), "X"):
        raise exc
    return caught.value


def test_the_node_maps_each_kind_to_its_wire_error() -> None:
    refused = agent_error(GRPCError(Status.UNAUTHENTICATED, SAID))
    assert isinstance(refused, wire.Refused) and refused.status == "UNAUTHENTICATED"
    assert str(refused).endswith(SAID)
    unverified = agent_error(cert_error())
    assert isinstance(unverified, wire.TlsVerificationFailed)
    assert "it is not signed by the CA in ca.pem" in str(unverified)
    for exc in (
        GRPCError(Status.UNAVAILABLE, "down"),
        GRPCError(Status.INTERNAL, "bug"),
        trio.TooSlowError(),
        REFUSED_CONNECTION,
        StreamTerminatedError("Connection lost"),
    ):
        assert type(agent_error(exc)) is wire.CoordinatorUnreachable, exc


def test_the_node_lets_a_bug_through() -> None:
    endpoint = wire.Endpoint.parse("10.0.0.5:7444")
    with pytest.raises(ValueError), wire.translated(endpoint, Path("ca.pem"), "X"):
        raise ValueError("a bug")


def tp_error(exc: BaseException, ca: Path) -> Exception:
    async def fail(_timeout: float) -> None:
        raise exc

    async def call() -> None:
        # Made inside the loop, as tp makes it: its channel belongs to the running loop.
        client = ApiClient(Endpoint("127.0.0.1", 7443, ca, "token"))
        await client._call("ListJobs", fail)

    # tp runs its client on asyncio, as here (a trio.run here left trio named as this thread's
    # library for every later test that asks sniffio).
    with pytest.raises(Exception) as caught:
        asyncio.run(call())
    return caught.value


def test_tp_shows_a_refusal_as_the_coordinator_wrote_it(tmp_path: Path) -> None:
    ca = create_dev_ca(tmp_path, ["127.0.0.1"]).ca_cert
    refused = tp_error(GRPCError(Status.NOT_FOUND, "There is no Job run-1."), ca)
    assert isinstance(refused, RequestRefused)
    assert (refused.status, str(refused)) == ("NOT_FOUND", "There is no Job run-1.")
    down = tp_error(REFUSED_CONNECTION, ca)
    assert isinstance(down, CoordinatorUnreachable)
    assert str(down).startswith("Cannot reach the coordinator at 127.0.0.1:7443")
    assert isinstance(tp_error(ValueError("a bug"), ca), ValueError)


async def test_the_collector_marks_only_a_refusal_as_refused(tmp_path: Path) -> None:
    """A real Ship against a port nothing listens on: unreachable, worded by the table, and not
    refused (the shell retries either way; a refusal is logged as one)."""
    credential = tmp_path / "credential"
    credential.write_text("token\n")
    ca = create_dev_ca(tmp_path, ["127.0.0.1"]).ca_cert
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nothing = Progress(0, False, False, False, 0, 0)
    async with open_telemetry_client(Gateway("127.0.0.1", port), ca, credential) as client:
        with pytest.raises(ShipFailed) as caught:
            await client.ship(("run-1", 1, 0), [], nothing, [])
    assert not caught.value.refused
    assert str(caught.value).startswith(f"Cannot reach the telemetry gateway at 127.0.0.1:{port}")
