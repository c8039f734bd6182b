"""The XID book: which GPUs the driver's XID events disable, judged from the journal's rows.

Rules:
- Pure: built from ``gpu_xids`` and ``gpu_health_events`` rows, it answers questions and
  returns the rows to write as data; nothing here reads a clock, NVML or the journal.
- Application XIDs (13, 31, 43, 45, 68, 109: faults a workload causes, which NVIDIA's device
  plugin ignores too) are counted, never disabling. Every other XID disables the GPU whose UUID
  it names, and every known GPU when the driver's event named a card that could not be
  identified (uuid "").
- A disabling XID stays until a clear covers it: a clear for a UUID covers every XID row with an
  id up to its ``through_xid_id`` (the highest id when it was written). Clears come from the
  operator (``tuneplane-node gpu clear``) or from NVML's recovery action going back to "none"
  after it asked for a reset.

Theory of operation: the daemon journals each drained XID (judged by :func:`is_application`)
before the inventory that reflects it is sent, reads the book back, writes the recovery rows
:meth:`XidBook.observe` asks for, and sends :meth:`XidBook.apply` of its inventory.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping

import attrs

from .inventory import Gpu, Inventory

#: XIDs a workload causes on its own GPU; counted, never disabling (as NVIDIA's device plugin).
APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})

#: What the common XIDs mean, after NVIDIA's XID catalogue (shown in health reasons).
XID_MEANINGS: Mapping[int, str] = {
    13: "graphics engine exception (usually the application)",
    31: "GPU memory page fault (usually the application)",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    43: "GPU stopped processing (usually the application)",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    56: "display engine error",
    57: "error programming video memory interface",
    61: "internal micro-controller breakpoint or warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    68: "video decoder exception (usually the application)",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout (usually the application)",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link error",
    140: "unrecovered ECC error",
}

#: Recovery actions after which NVML saying "none" means the card was reset and is usable.
RESET_ACTIONS: frozenset[str] = frozenset({"gpu_reset", "drain_and_reset"})

#: ``gpu_health_events.kind`` values that clear a GPU's XIDs.
OPERATOR_CLEAR = "operator-clear"
RECOVERY_CLEARED = "recovery-cleared"
CLEAR_KINDS: frozenset[str] = frozenset({OPERATOR_CLEAR, RECOVERY_CLEARED})
#: ``gpu_health_events.kind`` of a change in NVML's recovery action (not a clear by itself).
RECOVERY_ACTION = "recovery-action"


def is_application(xid: int) -> bool:
    """Whether ``xid`` is an application fault: counted, never disabling."""
    return xid in APPLICATION_XIDS


def meaning(xid: int) -> str:
    return XID_MEANINGS.get(xid, "see NVIDIA's XID catalogue")


def utc_text(at_ms: int) -> str:
    """``at_ms`` as an ISO 8601 UTC time to the second (what health reasons and the CLI show)."""
    moment = datetime.datetime.fromtimestamp(at_ms / 1000, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.frozen
class XidRecord:
    """One ``gpu_xids`` row: XID ``xid`` on the card ``uuid`` ("" = could not be identified)."""

    id: int
    uuid: str
    xid: int
    at_ms: int
    application: bool


@attrs.frozen
class HealthEvent:
    """One ``gpu_health_events`` row: a clear, or a change of NVML's recovery action."""

    id: int
    uuid: str
    at_ms: int
    kind: str
    actor: str
    reason: str
    through_xid_id: int = 0
    recovery_action: str = ""


@attrs.frozen
class NewXid:
    """A ``gpu_xids`` row to write, judged by :func:`judge` (the journal gives it its id)."""

    uuid: str
    xid: int
    at_ms: int
    application: bool


def judge(uuid: str, xid: int, at_ms: int) -> NewXid:
    """The row for XID ``xid`` drained from NVML for card ``uuid`` ("" when unidentified)."""
    return NewXid(uuid, xid, at_ms, is_application(xid))


@attrs.frozen
class NewHealthEvent:
    """A ``gpu_health_events`` row to write (the journal gives it its id)."""

    uuid: str
    at_ms: int
    kind: str
    actor: str
    reason: str
    through_xid_id: int = 0
    recovery_action: str = ""


@attrs.frozen
class XidBook:
    """Every XID and health event this Node's journal holds, oldest first."""

    xids: tuple[XidRecord, ...] = ()
    events: tuple[HealthEvent, ...] = ()

    @classmethod
    def of(cls, xids: Iterable[XidRecord], events: Iterable[HealthEvent]) -> XidBook:
        return cls(
            tuple(sorted(xids, key=lambda r: r.id)), tuple(sorted(events, key=lambda e: e.id))
        )

    @property
    def last_xid_id(self) -> int:
        return self.xids[-1].id if self.xids else 0

    def cleared_through(self, uuid: str) -> int:
        """The highest XID row id a clear for ``uuid`` covers (0: never cleared)."""
        return max(
            (e.through_xid_id for e in self.events if e.uuid == uuid and e.kind in CLEAR_KINDS),
            default=0,
        )

    def disabling(self, uuid: str) -> XidRecord | None:
        """The latest XID that disables ``uuid`` and no clear covers; None when it is usable."""
        through = self.cleared_through(uuid)
        found = None
        for record in self.xids:
            if record.id > through and not record.application and record.uuid in (uuid, ""):
                found = record
        return found

    def why_disabled(self, uuid: str) -> str | None:
        """A sentence for why XIDs disable ``uuid``, or None when they do not."""
        record = self.disabling(uuid)
        if record is None:
            return None
        where = "" if record.uuid else " (the driver could not say which card, so every GPU)"
        return f"XID {record.xid} at {utc_text(record.at_ms)}: {meaning(record.xid)}{where}"

    def application_count(self, uuid: str) -> int:
        """How many application XIDs ``uuid`` has had (counted, never disabling)."""
        return sum(1 for r in self.xids if r.application and r.uuid == uuid)

    def recovery_action(self, uuid: str) -> str:
        """NVML's recovery action for ``uuid`` as last journaled ("" when never)."""
        last = ""
        for event in self.events:
            if event.uuid == uuid and event.kind in (RECOVERY_ACTION, RECOVERY_CLEARED):
                last = event.recovery_action
        return last

    def observe(self, inventory: Inventory, at_ms: int) -> list[NewHealthEvent]:
        """The rows to write for recovery actions that changed since the journal last saw them.

        A change is journaled as ``recovery-action``; a change to "none" right after
        "gpu_reset" or "drain_and_reset" means the card was reset: it is journaled as
        ``recovery-cleared``, which clears the XIDs written so far. An empty recovery action
        (NVML could not say) changes nothing, and neither does "none" on a card the journal
        never saw ask for anything (every healthy card, at every first start).
        """
        rows = []
        for gpu in inventory.gpus:
            action = gpu.recovery_action
            before = self.recovery_action(gpu.uuid)
            if not gpu.uuid or not action or action == before or (action, before) == ("none", ""):
                continue
            if action == "none" and before in RESET_ACTIONS:
                rows.append(
                    NewHealthEvent(
                        gpu.uuid, at_ms, RECOVERY_CLEARED, "nvml",
                        f"NVML's recovery action went from {before} back to none",
                        self.last_xid_id, action,
                    )
                )  # fmt: skip
            else:
                rows.append(
                    NewHealthEvent(
                        gpu.uuid, at_ms, RECOVERY_ACTION, "nvml",
                        f"NVML's recovery action is {action}", 0, action,
                    )
                )  # fmt: skip
        return rows

    def apply(self, inventory: Inventory) -> Inventory:
        """``inventory`` with every GPU an XID disables marked unhealthy, saying why."""
        return attrs.evolve(inventory, gpus=tuple(self._apply(g) for g in inventory.gpus))

    def _apply(self, gpu: Gpu) -> Gpu:
        why = self.why_disabled(gpu.uuid)
        if why is None:
            return gpu
        reason = f"{gpu.health_reason}; {why}" if gpu.health_reason else why
        return attrs.evolve(gpu, healthy=False, health_reason=reason)

    def clear(
        self, uuid: str, at_ms: int, actor: str, reason: str
    ) -> tuple[NewHealthEvent, XidRecord | None]:
        """The operator clear row for ``uuid`` and the XID it lifts (None: nothing to lift)."""
        lifted = self.disabling(uuid)
        row = NewHealthEvent(uuid, at_ms, OPERATOR_CLEAR, actor, reason, self.last_xid_id)
        return row, lifted
