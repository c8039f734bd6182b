"""The NVML read against a plain model, over random sequences of what a machine's GPUs do.

A Hypothesis state machine rewrites the scripted NVML's file (cards lost and back, reordered,
XIDs, driver reloads, a failing count) and reads through the real :class:`InventorySource` after
each step. The model says what must come out: the cards in NVML order by UUID, healthy exactly
when not lost, every XID handed out once with its card's UUID ("" when the card had no handle in
that read), XIDs raised before a driver reload gone with the old event set, and a failed count
marking every card of the last read without losing the XIDs still waiting.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tuneplane.agent.inventory_source import InventorySource
from tuneplane.agent.scripted_nvml import write_script

UUIDS = ("GPU-a", "GPU-b", "GPU-c")


class NvmlMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.path = Path(self.dir.name) / "nvml.json"
        self.order = list(UUIDS)
        self.lost: set[str] = set()
        self.epoch = 0
        self.count_fails = False
        self.xids: list[dict[str, Any]] = []
        self.write()
        self.source = InventorySource("node", None, self.path)
        # The model: the cards the last good read saw, the XIDs not yet handed out (by card),
        # whether the agent's event set is alive and which cards it registered there.
        self.known: list[str] = []
        self.waiting: list[tuple[str, int]] = []
        self.set_alive = False
        self.registered: set[str] = set()
        self.read()

    def teardown(self) -> None:
        self.dir.cleanup()

    def write(self) -> None:
        cards = [{"uuid": u, "lost": u in self.lost} for u in self.order]
        write_script(self.path, {"gpus": cards, "xids": self.xids, "epoch": self.epoch,
                                 "errors": {"nvmlDeviceGetCount": "UNKNOWN"}
                                 if self.count_fails else {}})  # fmt: skip

    @rule(order=st.permutations(UUIDS))
    def reorder(self, order: list[str]) -> None:
        self.order = list(order)
        self.write()

    @rule(uuid=st.sampled_from(UUIDS))
    def lose_or_find(self, uuid: str) -> None:
        self.lost ^= {uuid}
        self.write()

    @rule(uuid=st.sampled_from(UUIDS), xid=st.sampled_from([13, 48, 79, 94]))
    def xid(self, uuid: str, xid: int) -> None:
        self.xids.append({"gpu": uuid, "xid": xid, "id": str(len(self.xids))})
        self.waiting.append((uuid, xid))
        self.write()

    @rule()
    def driver_reload(self) -> None:
        self.epoch += 1
        self.set_alive = False  # the agent's event set died with the old driver
        self.write()

    @rule()
    def count_fails_or_recovers(self) -> None:
        self.count_fails = not self.count_fails
        self.write()

    @invariant()
    def read(self) -> None:
        inv = self.source.collect()
        events = [(e.uuid, e.xid) for e in self.source.take_xid_events()]
        if self.count_fails:
            assert inv.problem.startswith("NVML could not count the GPUs"), inv.problem
            assert [g.uuid for g in inv.gpus] == self.known
            assert not any(g.healthy for g in inv.gpus)
            assert events == []
            return
        assert inv.problem == ""
        if not self.set_alive:
            # A new event set hears only of what happens after it exists.
            self.set_alive, self.registered, self.waiting = True, set(), []
        self.registered |= set(self.order) - self.lost
        # A lost card has no handle in this read: its event names no card.
        due = [(u, x) for u, x in self.waiting if u in self.registered]
        expected = [("" if u in self.lost else u, x) for u, x in due]
        assert [g.uuid for g in inv.gpus] == [u if u not in self.lost else self._at(i)
                                             for i, u in enumerate(self.order)]  # fmt: skip
        assert [g.healthy for g in inv.gpus] == [u not in self.lost for u in self.order]
        assert events == expected
        self.waiting = [(u, x) for u, x in self.waiting if u not in self.registered]
        self.known = [g.uuid for g in inv.gpus]

    def _at(self, index: int) -> str:
        """A lost card has no handle: it is named as the last good read named its index."""
        return self.known[index] if index < len(self.known) else ""


NvmlMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=15, deadline=None)
test_the_nvml_read_follows_the_model = NvmlMachine.TestCase
