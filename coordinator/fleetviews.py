"""Fleets, Nodes, users and decisions as the store reports them to the API and the admin CLI.

Rules: frozen attrs values only, no betterproto types (the Api handlers convert at the wire edge).
A Node's scheduling state and its control connectivity are separate fields and never merged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from tuneplane.coordinator.records import InventoryInfo, MemberKey


@attrs.frozen
class SeriesCapacityView:
    series: str
    total: int
    healthy: int
    free: int
    in_use: int
    quota: int  # 0: no quota


@attrs.frozen
class FleetView:
    name: str
    kind: str
    created_at_ms: int
    nodes: int
    connected_nodes: int
    schedulable_nodes: int
    capacity: tuple[SeriesCapacityView, ...]
    queued_jobs: int
    active_jobs: int


@attrs.frozen
class NodeMemberView:
    member: MemberKey
    state: str
    gpu_indexes: tuple[int, ...]
    owner: str


@attrs.frozen
class NodeView:
    id: str
    fleet: str
    hostname: str
    scheduling: str
    scheduling_reason: str
    scheduling_changed_at_ms: int
    scheduling_changed_by: str
    connected: bool
    disconnected_since_ms: int
    last_heartbeat_ms: int
    enrolled_at_ms: int
    inventory: InventoryInfo
    # GPU index -> the member whose reservation holds it.
    held_by: Mapping[int, MemberKey]
    members: tuple[NodeMemberView, ...]
    # The control credential's lifetime (epoch ms; 0: none recorded) and when it was revoked.
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0
    revoked_at_ms: int = 0
    # The display name chosen at enrollment (store_fleet.free_node_name); unique per Fleet.
    name: str = ""
    # The control address the Node dialed for its current or last stream; "" before it said.
    dialed_address: str = ""
    # Where the Node serves its ended members' outputs to other Nodes (its last Hello); "" when
    # it serves none.
    outputs_address: str = ""


@attrs.frozen
class UserView:
    name: str
    role: str
    created_at_ms: int


@attrs.frozen
class DecisionRow:
    """One row of the append-only decision log."""

    id: int
    at_ms: int
    kind: str
    run_id: str | None
    attempt: int | None
    member_index: int | None
    node_id: str | None
    detail: Mapping[str, Any]
