"""tp's list of coordinator API addresses and the order it asks them in (pure: no sockets, no
clock): parsing the list from --coordinator and tp-context.json, and :mod:`failover`'s steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent.call_failure import CallFailure, Kind
from tuneplane.coordinator.cli import failover
from tuneplane.coordinator.cli.connection import (
    ConnectionConfigError,
    parse_addresses,
    resolve_connection,
)
from tuneplane.coordinator.cli.failover import Attempts, GiveUp, Next, Stop
from tuneplane.coordinator.server.state_dir import Endpoints, publish

pytestmark = pytest.mark.timeout(60)

A, B, C = "10.0.0.5:7443", "10.0.0.6:7443", "[fd00::7]:7443"
REFUSED_CONN = CallFailure(Kind.UNREACHABLE, detail="Connection refused")
NOT_LEADER = CallFailure(Kind.UNAVAILABLE, "UNAVAILABLE", "This coordinator does not lead.")
NO_JOB = CallFailure(Kind.REFUSED, "NOT_FOUND", "There is no Job run-1.")


# -- the list -----------------------------------------------------------------------------------


def test_a_comma_list_is_read_in_order_written_one_way_and_without_repeats() -> None:
    assert parse_addresses([A], "--coordinator") == (A,)
    text = f" {A},{B} ,{C},{A}"
    assert parse_addresses(text.split(","), "--coordinator") == (A, B, C)


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ([A, "nocolon"], r"^--coordinator entry 'nocolon' is not HOST:PORT; write e\.g\."),
        ([A, ""], r"^--coordinator has an empty entry; separate the addresses with single commas"),
        (["h:0"], r"^--coordinator 'h:0' is not HOST:PORT"),
        ([], r"^--coordinator names no address"),
    ],
)
def test_a_bad_entry_refuses_the_list_naming_it(entries: list[str], says: str) -> None:
    with pytest.raises(ConnectionConfigError, match=says):
        parse_addresses(entries, "--coordinator")


@pytest.fixture
def secrets(tmp_path: Path) -> tuple[Path, Path]:
    ca = tmp_path / "ca.pem"
    ca.write_text("a CA\n")
    token = tmp_path / "token"
    token.write_text("tok\n")
    return ca, token


def _context(tmp_path: Path, **keys: object) -> Path:
    path = tmp_path / "tp-context.json"
    path.write_text(json.dumps({"ca": "ca.pem", "token_file": "token", **keys}))
    return path


def test_the_context_file_names_its_writer_first_then_the_others(
    tmp_path: Path, secrets: tuple[Path, Path]
) -> None:
    path = _context(tmp_path, coordinator=B, api_addresses=[A, B, C])
    endpoint = resolve_connection(path, None, None, None)
    assert endpoint.addresses == (B, A, C)
    assert (endpoint.host, endpoint.port, endpoint.others) == ("10.0.0.6", 7443, (A, C))
    # An older file: one address. A newer one without "coordinator": the list alone.
    assert resolve_connection(_context(tmp_path, coordinator=A), None, None, None).addresses == (A,)
    only = _context(tmp_path, api_addresses=[C, A])
    assert resolve_connection(only, None, None, None).addresses == (C, A)
    # --coordinator replaces the whole list.
    flagged = resolve_connection(path, f"{C},{A}", None, None, ride_out_s=3)
    assert (flagged.addresses, flagged.ride_out_s) == ((C, A), 3)


def test_the_address_that_last_answered_is_read_from_beside_the_context_file(
    tmp_path: Path, secrets: tuple[Path, Path]
) -> None:
    path = _context(tmp_path, coordinator=A, api_addresses=[A, B])
    kept = tmp_path / "tp-context.json.leader"
    assert resolve_connection(path, None, None, None).leader_file == kept
    assert resolve_connection(path, None, None, None).last_leader == ""
    for text, read in ((f"{B}\n", B), ("10.0.0.6:07443", B), (C, ""), ("junk", ""), ("", "")):
        kept.write_text(text)
        assert resolve_connection(path, None, None, None).last_leader == read, text
    # Not for a list from --coordinator, nor for a single address.
    kept.write_text(B)
    assert resolve_connection(path, f"{A},{B}", None, None).leader_file is None
    alone = resolve_connection(_context(tmp_path, coordinator=B), None, None, None)
    assert (alone.leader_file, alone.last_leader) == (None, "")


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        (
            {"api_addresses": [A, "10.0.0.9"]},
            r"key 'api_addresses' entry '10\.0\.0\.9' is not HOST",
        ),
        ({"api_addresses": A}, r"key 'api_addresses' must be a list of HOST:PORT strings\.$"),
        ({"api_addresses": [A, 7443]}, r"key 'api_addresses' must be a list of HOST:PORT"),
        ({"coordinator": "x", "api_addresses": [A]}, r"key 'coordinator' 'x' is not HOST:PORT"),
        ({"api_addresses": []}, r"^No coordinator configured"),
    ],
)
def test_a_malformed_context_list_names_the_file_and_the_entry(
    tmp_path: Path, secrets: tuple[Path, Path], keys: dict[str, object], says: str
) -> None:
    path = _context(tmp_path, **keys)
    with pytest.raises(ConnectionConfigError, match=says) as caught:
        resolve_connection(path, None, None, None)
    if "No coordinator" not in says:
        assert str(caught.value).startswith(f"The context file {path} key")


def test_serve_publishes_the_list_beside_the_one_address(tmp_path: Path) -> None:
    alone = Endpoints(api=A, control="c:1", telemetry="t:1", ca="ca.pem", pid=7)
    assert alone.api_addresses == (A,)
    publish(tmp_path, alone)
    context = json.loads((tmp_path / "tp-context.json").read_text())
    assert (context["coordinator"], context["api_addresses"]) == (A, [A])
    endpoints = json.loads((tmp_path / "endpoints.json").read_text())
    assert endpoints["api_addresses"] == [A]
    # The others from the coordinators table: this one is put first, once.
    group = Endpoints(A, "c:1", "t:1", "ca.pem", 7, api_addresses=[C, A, B])
    publish(tmp_path, group)
    context = json.loads((tmp_path / "tp-context.json").read_text())
    assert (context["coordinator"], context["api_addresses"]) == (A, [A, C, B])


# -- the order ----------------------------------------------------------------------------------


def test_a_call_starts_with_the_address_that_last_answered() -> None:
    assert failover.starting_with((A, B, C), None) == (A, B, C)
    assert failover.starting_with((A, B, C), B) == (B, C, A)
    assert failover.starting_with((A, B, C), "10.9.9.9:1") == (A, B, C)


@given(st.integers(min_value=1, max_value=40), st.floats(min_value=0, max_value=1))
def test_a_pause_grows_from_a_quarter_second_to_two_and_is_jittered(
    rounds: int, jitter: float
) -> None:
    pause = failover.pause_s(rounds, jitter)
    ceiling = min(failover.MAX_PAUSE_S, failover.FIRST_PAUSE_S * 2 ** (rounds - 1))
    assert ceiling / 2 <= pause <= ceiling
    assert failover.pause_s(0, jitter) == 0


def test_the_connection_gets_a_deadline_of_its_own_only_among_several() -> None:
    assert failover.connect_deadline_s(1, 10) == 10
    assert failover.connect_deadline_s(2, 10) == failover.CONNECT_WITHIN_S
    assert failover.connect_deadline_s(3, 1) == 1


def _walk(safe: bool = True, order: tuple[str, ...] = (A, B, C)) -> Attempts:
    return Attempts(order, safe, started_s=100.0, ride_out_s=15.0)


def test_refusing_addresses_are_passed_at_once_then_each_round_pauses_until_the_ride_out() -> None:
    walk = _walk()
    assert walk.address == A
    assert walk.failed(REFUSED_CONN, False, 100.0, 0.0) == Next(B)
    assert walk.failed(NOT_LEADER, True, 100.1, 0.0) == Next(C)
    assert walk.failed(REFUSED_CONN, False, 100.2, 0.0) == Next(A, 0.125)
    assert walk.failed(REFUSED_CONN, False, 100.4, 1.0) == Next(B)
    assert walk.failed(REFUSED_CONN, False, 100.5, 1.0) == Next(C)
    assert walk.failed(REFUSED_CONN, False, 100.6, 1.0) == Next(A, 0.5)
    # The ride-out ends within a round as well as between rounds.
    given_up = walk.failed(NOT_LEADER, True, 115.0, 0.0)
    assert isinstance(given_up, GiveUp)
    assert given_up.tries == 7 and given_up.elapsed_s == 15.0
    assert given_up.tried == ((A, NOT_LEADER), (B, REFUSED_CONN), (C, REFUSED_CONN))
    last = _walk(order=(A, B))
    last.failed(REFUSED_CONN, False, 100.0, 0.0)
    assert isinstance(last.failed(REFUSED_CONN, False, 114.9, 0.5), GiveUp)


def test_a_call_not_safe_to_repeat_goes_on_only_when_it_never_reached_a_coordinator() -> None:
    walk = _walk(safe=False)
    assert walk.failed(REFUSED_CONN, False, 100.0, 0.0) == Next(B)
    timed_out = CallFailure(Kind.TIMED_OUT)
    assert walk.failed(timed_out, False, 100.1, 0.0) == Next(C)
    assert walk.failed(NOT_LEADER, True, 100.2, 0.0) == Stop(C, NOT_LEADER)
    assert "RetryJob" not in failover.RETRY_SAFE and "Commit" in failover.RETRY_SAFE


@pytest.mark.parametrize(
    "failure", [NO_JOB, CallFailure(Kind.UNVERIFIED, detail="self-signed certificate")]
)
def test_a_refusal_or_a_foreign_certificate_ends_the_call_at_once(failure: CallFailure) -> None:
    walk = _walk()
    assert walk.failed(REFUSED_CONN, False, 100.0, 0.0) == Next(B)
    assert walk.failed(failure, True, 100.1, 0.0) == Stop(B, failure)


def test_one_address_has_no_one_to_take_over() -> None:
    assert _walk(order=(A,)).failed(REFUSED_CONN, False, 100.0, 0.0) == Stop(A, REFUSED_CONN)
    with pytest.raises(ValueError, match="at least one address"):
        Attempts((), True, 0.0, 1.0)


def test_giving_up_is_one_sentence_naming_every_address_and_what_it_said() -> None:
    tried = (
        (A, REFUSED_CONN),
        (B, NOT_LEADER),
        (C, CallFailure(Kind.TIMED_OUT)),
        ("10.0.0.8:7443", CallFailure(Kind.TLS_FAILED, detail="WRONG_VERSION_NUMBER")),
        ("10.0.0.9:7443", CallFailure(Kind.BROKEN, detail="StreamTerminatedError")),
    )
    text = GiveUp(tried, 12, 15.04).sentence("ListJobs", "that --coordinator names them")
    assert text == (
        "No coordinator answered ListJobs in 15.0 s (12 tries): "
        "10.0.0.5:7443 could not be reached (Connection refused); "
        "10.0.0.6:7443 could not serve it (UNAVAILABLE: This coordinator does not lead.); "
        "[fd00::7]:7443 did not answer in time; "
        "10.0.0.8:7443 failed the TLS handshake (WRONG_VERSION_NUMBER); "
        "10.0.0.9:7443 broke the connection (StreamTerminatedError). "
        "Check that one of them is running and leads, and that --coordinator names them."
    )
