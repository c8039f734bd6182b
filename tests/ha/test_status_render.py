"""``tuneplane-coordinator status``'s lines and JSON, from facts (pure)."""

from __future__ import annotations

from tuneplane.coordinator.cli.admin_status import ClusterView, as_json, render
from tuneplane.coordinator.leadership import LeaseRow, LeaseSettings
from tuneplane.coordinator.store.lease import CoordinatorFacts, CoordinatorRow

NOW = 1_800_000_000_000


def _row(name: str, seen_ago_ms: int, alive: bool = True) -> CoordinatorRow:
    facts = CoordinatorFacts(name, f"host-{name}", 7, "1.2.0", f"{name}:7443", f"{name}:7444",
                             f"{name}:7445")  # fmt: skip
    return CoordinatorRow(facts, NOW - 60_000, NOW - seen_ago_ms, alive)


def test_the_leader_its_lease_and_each_standby_are_shown() -> None:
    lease = LeaseRow(4, "a", NOW - 30_000, expires_ms=NOW + 4200, now_ms=NOW, holder_alive=True)
    view = ClusterView("postgresql://db/tp", lease, (_row("a", 300), _row("b", 400)), NOW,
                       LeaseSettings())  # fmt: skip
    lines = render(view)
    assert (
        lines[1].startswith("Leader: a since ") and "(term 4), lease expires in 4.2 s" in lines[1]
    )
    assert " leader " in lines[2] and "seen 0.3 s ago" in lines[2]
    assert " standby " in lines[4] and "b:7444" in lines[5]
    facts = as_json(view)
    assert (facts["leader"], facts["term"], facts["lease_expires_in_s"]) == ("a", 4, 4.2)
    assert [c["role"] for c in facts["coordinators"]] == ["leader", "standby"]


def test_an_expired_lease_a_dead_session_and_a_gone_coordinator_are_said() -> None:
    lease = LeaseRow(4, "a", NOW - 30_000, expires_ms=NOW - 1500, now_ms=NOW, holder_alive=False)
    view = ClusterView("postgresql://db/tp", lease, (_row("a", 9000, alive=False),), NOW,
                       LeaseSettings())  # fmt: skip
    lines = render(view)
    assert "lease EXPIRED 1.5 s ago" in lines[1] and "session is gone" in lines[1]
    assert " gone " in lines[2]
    assert as_json(view)["coordinators"][0]["gone"] is True


def test_a_store_no_coordinator_served_on_says_so() -> None:
    view = ClusterView("postgresql://db/tp", None, (), NOW, LeaseSettings())
    assert render(view)[1:] == [
        "Leader: none yet (no coordinator has served on this store).",
        "Coordinators: none registered.",
    ]
    assert as_json(view)["leader"] == ""
