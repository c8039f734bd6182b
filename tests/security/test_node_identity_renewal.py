"""Node identity lifecycle, pure parts: when a Node renews, what the session core does with a
renewal, how spent credentials are refused and how status/doctor judge a credential."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuneplane.agent import messages as m
from tuneplane.agent.credential_renewal import (
    credential_health,
    renewal_at_ms,
    renewal_deadline_ms,
)
from tuneplane.agent.inventory import SimulatedGpus, simulated_inventory
from tuneplane.agent.session import ControlSession, Effect, Send, StoreCredential
from tuneplane.agent.state_dir import CredentialLife as NodeLife
from tuneplane.agent.state_dir import StateDir
from tuneplane.coordinator.auth import (
    AuthError,
    CredentialLife,
    check_node_credential,
    check_user_token,
)
from tuneplane.coordinator.config import ConfigError, parse_config

INV = simulated_inventory("node-a", SimulatedGpus("h200", 1))
DAY = 86_400_000


@settings(max_examples=300, deadline=None)
@given(
    issued=st.integers(min_value=0, max_value=4_000_000_000_000),
    life=st.integers(min_value=1_000, max_value=400 * DAY),
    jitter=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_renewal_is_always_in_the_second_half_and_before_the_last_tenth(
    issued: int, life: int, jitter: float
) -> None:
    at = renewal_at_ms(issued, issued + life, jitter)
    assert at is not None
    assert issued + life // 2 <= at < issued + life
    assert at <= renewal_deadline_ms(issued, issued + life)


@settings(max_examples=100, deadline=None)
@given(
    issued=st.integers(min_value=0, max_value=4_000_000_000_000),
    life=st.integers(min_value=100_000, max_value=400 * DAY),
    a=st.floats(min_value=0.0, max_value=0.45),
    b=st.floats(min_value=0.55, max_value=0.999),
)
def test_renewal_is_jittered_a_later_draw_renews_later(
    issued: int, life: int, a: float, b: float
) -> None:
    # Different Nodes draw different jitter and so spread over the window.
    early, late = renewal_at_ms(issued, issued + life, a), renewal_at_ms(issued, issued + life, b)
    assert early is not None and late is not None and early < late


def test_renewal_without_a_stated_lifetime_never_happens_and_a_spent_one_happens_at_once() -> None:
    assert renewal_at_ms(0, 0, 0.3) is None
    assert renewal_at_ms(5_000, 4_000, 0.3) == 5_000


def welcomed(issued: int, expires: int, jitter: float = 0.0) -> ControlSession:
    s = ControlSession("node-1", "0.1.0", renewal_jitter=jitter)
    s.start(0.0, INV, [])
    s.receive(0.0, m.Welcome(500, 3000, 0, issued, expires))
    return s


def renewals(effects: Sequence[Effect]) -> list[m.CredentialRenewal]:
    sent = [e.message for e in effects if isinstance(e, Send)]
    return [message for message in sent if isinstance(message, m.CredentialRenewal)]


def test_session_asks_once_due_then_stores_before_it_confirms() -> None:
    s = welcomed(issued=1_000_000, expires=1_000_000 + 100_000, jitter=0.0)
    # Jitter 0 renews at half-life (1_050_000); before that, heartbeats only.
    assert renewals(s.tick(1.0, 1_049_999, INV)) == []
    (ask,) = renewals(s.tick(2.0, 1_050_000, INV))
    # Not asked again while the answer is awaited (timeout 3 s) ...
    s.receive(2.5, m.HeartbeatAck(1))
    assert renewals(s.tick(3.0, 1_050_500, INV)) == []
    # ... but asked again after a heartbeat timeout without an answer.
    s.receive(5.0, m.HeartbeatAck(2))
    (again,) = renewals(s.tick(5.5, 1_051_000, INV))
    assert again.request_id != ask.request_id
    # An answer to the stale request is ignored; the current one becomes StoreCredential.
    stale = m.CredentialIssued(ask.request_id, "tpn_old", 1_051_000, 1_151_000)
    assert s.receive(5.6, stale) == []
    issued = m.CredentialIssued(again.request_id, "tpn_new", 1_051_000, 1_151_000)
    assert s.receive(5.7, issued) == [StoreCredential(issued)]
    # Only after the shell stored it does the coordinator hear CredentialStored.
    assert s.credential_stored(issued) == [Send(m.CredentialStored(again.request_id))]
    assert s.credential_stored(issued) == []
    # The new lifetime moves the next renewal into its own second half.
    assert renewals(s.tick(6.0, 1_060_000, INV)) == []
    assert s.renewal_due_ms() == 1_101_000


def test_session_never_renews_when_the_coordinator_states_no_lifetime() -> None:
    s = welcomed(issued=0, expires=0)
    assert renewals(s.tick(1.0, 10**13, INV)) == []


def test_spent_credentials_are_refused_with_the_next_step() -> None:
    live = CredentialLife(1_000, 2_000, None)
    check_node_credential("node-1", live, 1_999)
    with pytest.raises(AuthError, match=r"expired .*re-enroll"):
        check_node_credential("node-1", live, 2_000)
    with pytest.raises(AuthError, match=r"revoked .*--re-enroll"):
        check_node_credential("node-1", CredentialLife(1_000, None, 1_500), 1_600)
    check_node_credential("node-1", CredentialLife(None, None, None), 10**13)
    check_user_token("ada", CredentialLife(1, None, None), 10**13)
    with pytest.raises(AuthError, match=r"user 'ada' expired.*user token ada"):
        check_user_token("ada", CredentialLife(1, 5, None), 5)
    with pytest.raises(AuthError, match=r"user 'ada' was revoked"):
        check_user_token("ada", CredentialLife(1, None, 3), 4)


def test_credential_health_for_status_and_doctor() -> None:
    issued = 20_000 * DAY
    expires = issued + 10 * DAY
    level, text = credential_health(issued, expires, issued + 2 * DAY)
    assert level == "ok" and "issued 2d 0h ago" in text and "expires in 8d 0h" in text
    level, text = credential_health(issued, expires, issued + 9 * DAY + 1)
    assert level == "warn" and "past its renewal point" in text
    level, text = credential_health(issued, expires, issued + 11 * DAY)
    assert level == "fail" and "EXPIRED" in text and "--re-enroll" in text
    assert credential_health(0, 0, 5)[0] == "warn"


def test_a_rotation_cut_short_is_finished_when_the_credential_is_read(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "node")
    state.save_credential("tpn_old", NodeLife(1, 2))
    assert state.read_credential() == "tpn_old"
    state.save_next_credential("tpn_new")
    # A crash here leaves both files; reading promotes the successor, once.
    assert state.read_credential() == "tpn_new"
    assert not state.control_token_next.exists()
    assert state.read_credential() == "tpn_new"
    assert oct(state.control_token.stat().st_mode & 0o777) == "0o600"
    assert state.load_credential_life() == NodeLife(1, 2)
    # Enrolment (or re-enrolment) drops a half-stored successor: the new credential wins.
    state.save_next_credential("tpn_stale")
    state.save_credential("tpn_enrolled")
    assert state.read_credential() == "tpn_enrolled"


def test_coordinator_toml_credential_lifetimes(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.toml"
    config = parse_config('[credentials]\nnode_lifetime = "20s"\n', path)
    assert config.node_credential_lifetime_s == 20
    assert config.user_token_lifetime_s == 90 * 86400
    assert parse_config("", path).node_credential_lifetime_s == 30 * 86400
    with pytest.raises(ConfigError, match=r"node_lifetime = '20' is not a duration"):
        parse_config('[credentials]\nnode_lifetime = "20"\n', path)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) node_ttl"):
        parse_config('[credentials]\nnode_ttl = "20s"\n', path)
