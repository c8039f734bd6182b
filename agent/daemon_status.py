"""What the daemon tells about itself: ``status.json`` (for ``tuneplane-node status`` and
``doctor``) and the one status line systemd shows.

Rules: plain values and pure functions; the daemon writes the file atomically
(:meth:`~tuneplane.agent.daemon_base.DaemonBase.write_status`). A credential's lifetime is
shown, never its value.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from .inventory import Inventory

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class Status:
    """What ``tuneplane-node status`` shows; written atomically to status.json."""

    pid: int
    node_id: str
    coordinator: str
    started_at_ms: int
    connected: bool = False
    last_connected_ms: int | None = None
    last_heartbeat_ack_ms: int | None = None
    last_error: str = ""
    reconnects: int = 0
    safe_mode: bool = False
    safe_mode_reason: str = ""
    inventory: dict[str, Any] = attrs.field(factory=dict)
    # The control credential's lifetime as the coordinator last stated it (never its value).
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0
    credential_renewal_at_ms: int = 0
    # The coordinator's clock minus this host's at the last Welcome (for doctor), and when.
    clock_skew_ms: int | None = None
    clock_skew_at_ms: int | None = None
    # Where members' work directories, outputs and runtime images go (doctor measures free
    # space there and checks the image cache).
    work_root: str = ""
    out_root: str = ""
    image_root: str = ""
    # Where the Prometheus listener ([metrics] in node.toml) serves; "" when it is off.
    metrics_address: str = ""
    # Where the outputs listener ([outputs] in node.toml) is bound and what Hello advertises;
    # "" when it is off.
    outputs_listen: str = ""
    outputs_address: str = ""
    # This agent's release and control protocol, and the coordinator's as its last Welcome said
    # (proto/contract/control_protocol.py); "" and 0 before the first Welcome.
    agent_version: str = ""
    protocol: int = 0
    coordinator_version: str = ""
    coordinator_protocol: int = 0
    coordinator_capabilities: list[str] = attrs.field(factory=list)


def inventory_summary(inv: Inventory) -> dict[str, Any]:
    return {
        "hostname": inv.hostname,
        "gpu_source": inv.gpu_source,
        "note": inv.note,
        "problem": inv.problem,
        "xid_events": inv.xid_events,
        "released_until_ms": inv.released_until_ms,
        "driver_version": inv.driver_version,
        "cuda_version": inv.cuda_version,
        "cpu_count": inv.cpu_count,
        "memory_bytes": inv.memory_bytes,
        "gpus": [attrs.asdict(g) for g in inv.gpus],
    }


def service_status(status: Status) -> str:
    """The one-line status ``systemctl status tuneplane-node`` shows (pure)."""
    if status.safe_mode:
        return "SAFE MODE: refusing new members, touching no workload (tuneplane-node status)"
    if status.connected:
        return f"connected to {status.coordinator}"
    return f"not connected to {status.coordinator}, retrying ({status.reconnects} reconnects)"
