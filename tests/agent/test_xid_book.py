"""The XID book against a plain model: which GPUs XIDs disable, what clears them."""

from __future__ import annotations

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tuneplane.agent.inventory import Gpu, Inventory
from tuneplane.agent.xid_book import (
    APPLICATION_XIDS,
    OPERATOR_CLEAR,
    RECOVERY_ACTION,
    RECOVERY_CLEARED,
    HealthEvent,
    XidBook,
    XidRecord,
    is_application,
    judge,
    utc_text,
)

UUIDS = ("GPU-a", "GPU-b", "GPU-c")
XIDS = st.sampled_from(sorted(APPLICATION_XIDS | {48, 63, 74, 79, 94, 95, 119, 999}))


def gpu(index: int, uuid: str, recovery_action: str = "", reason: str = "") -> Gpu:
    return Gpu(
        index, uuid, "NVIDIA H200", "h200", 2**30, False, not reason, reason,
        recovery_action=recovery_action,
    )  # fmt: skip


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory("node", 4, 2**34, gpus, "scripted-nvml")


class BookMachine(RuleBasedStateMachine):
    """Rows are appended as the journal would; the book is rebuilt from them at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.xids: list[XidRecord] = []
        self.events: list[HealthEvent] = []
        self.next_id = 1
        self.clock = 1_700_000_000_000
        # The model: the disabling XIDs not yet cleared, per GPU, in order.
        self.active: dict[str, list[int]] = {u: [] for u in UUIDS}
        self.application: dict[str, int] = dict.fromkeys(UUIDS, 0)

    def book(self) -> XidBook:
        # Shuffled order in, sorted order out: the book never depends on how rows were read.
        return XidBook.of(reversed(self.xids), reversed(self.events))

    def _tick(self) -> int:
        self.clock += 1000
        self.next_id += 1
        return self.next_id - 1

    @rule(uuid=st.sampled_from(("", *UUIDS)), xid=XIDS)
    def xid_arrives(self, uuid: str, xid: int) -> None:
        row = judge(uuid, xid, self.clock)
        self.xids.append(XidRecord(self._tick(), row.uuid, row.xid, row.at_ms, row.application))
        if is_application(xid):
            if uuid:
                self.application[uuid] += 1
            return
        for target in [uuid] if uuid else UUIDS:
            self.active[target].append(xid)

    @rule(uuid=st.sampled_from(UUIDS))
    def operator_clears(self, uuid: str) -> None:
        row, lifted = self.book().clear(uuid, self.clock, "operator root", "reset")
        assert (lifted is None) == (not self.active[uuid])
        if lifted is not None:
            assert lifted.xid == self.active[uuid][-1]
        self.events.append(HealthEvent(self._tick(), **attrs.asdict(row)))
        self.active[uuid] = []

    @rule(uuid=st.sampled_from(UUIDS), action=st.sampled_from(("none", "gpu_reset", "")))
    def recovery_action_reported(self, uuid: str, action: str) -> None:
        book = self.book()
        before = book.recovery_action(uuid)
        gpus = [gpu(i, u, action if u == uuid else "") for i, u in enumerate(UUIDS)]
        rows = book.observe(inventory(*gpus), self.clock)
        if not action or action == before or (action, before) == ("none", ""):
            assert rows == []
            return
        assert [r.uuid for r in rows] == [uuid]
        (row,) = rows
        if action == "none" and before == "gpu_reset":
            assert row.kind == RECOVERY_CLEARED and row.through_xid_id == book.last_xid_id
            self.active[uuid] = []
        else:
            assert row.kind == RECOVERY_ACTION
        self.events.append(HealthEvent(self._tick(), **attrs.asdict(row)))

    @invariant()
    def book_agrees_with_the_model(self) -> None:
        book = self.book()
        applied = book.apply(inventory(*(gpu(i, u) for i, u in enumerate(UUIDS))))
        for g in applied.gpus:
            active = self.active[g.uuid]
            found = book.disabling(g.uuid)
            assert (found.xid if found else None) == (active[-1] if active else None)
            assert g.healthy == (not active)
            if active:
                assert g.health_reason.startswith(f"XID {active[-1]} at ")
            assert book.application_count(g.uuid) == self.application[g.uuid]


TestBook = BookMachine.TestCase
TestBook.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_reason_names_the_xid_time_and_meaning_and_keeps_the_probe_reason() -> None:
    book = XidBook.of([XidRecord(1, "GPU-a", 79, 1_767_225_600_000, False)], [])
    sick = book.apply(inventory(gpu(0, "GPU-a", reason="2 uncorrected ECC errors")))
    assert sick.gpus[0].health_reason == (
        "2 uncorrected ECC errors; XID 79 at 2026-01-01T00:00:00Z: GPU has fallen off the bus"
    )
    assert utc_text(0) == "1970-01-01T00:00:00Z"


def test_an_unidentified_xid_disables_every_gpu_and_a_clear_lifts_it_for_one() -> None:
    book = XidBook.of([XidRecord(1, "", 48, 0, False)], [])
    both = book.apply(inventory(gpu(0, "GPU-a"), gpu(1, "GPU-b")))
    assert [g.healthy for g in both.gpus] == [False, False]
    assert "could not say which card" in both.gpus[1].health_reason
    row, lifted = book.clear("GPU-a", 5, "operator root", "checked")
    assert lifted is not None and row.kind == OPERATOR_CLEAR and row.through_xid_id == 1
    book = XidBook.of(book.xids, [HealthEvent(2, **attrs.asdict(row))])
    after = book.apply(inventory(gpu(0, "GPU-a"), gpu(1, "GPU-b")))
    assert [g.healthy for g in after.gpus] == [True, False]


def test_application_xids_count_but_never_disable() -> None:
    book = XidBook.of([XidRecord(i, "GPU-a", x, 0, True) for i, x in enumerate((13, 31, 43))], [])
    assert book.disabling("GPU-a") is None and book.application_count("GPU-a") == 3
    assert book.apply(inventory(gpu(0, "GPU-a"))).gpus[0].healthy
