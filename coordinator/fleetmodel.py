"""Fleets and Nodes as ``tp`` sees them: attrs values converted from the Api's messages.

Rules: nothing here imports grpclib or betterproto (see :mod:`tuneplane.coordinator.apimodel`);
field names follow the Api messages so ``--json`` output matches the protocol's words.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class SeriesCapacity:
    series: str
    total: int
    healthy: int
    free: int
    in_use: int
    quota: int  # 0: no quota


@attrs.frozen
class Fleet:
    name: str
    kind: str
    created_at_ms: int
    nodes: int
    connected_nodes: int
    schedulable_nodes: int
    capacity: tuple[SeriesCapacity, ...]
    queued_jobs: int
    active_jobs: int


@attrs.frozen
class Gpu:
    index: int
    uuid: str
    name: str
    series: str
    memory_bytes: int
    healthy: bool
    health_reason: str
    # "run_id/attempt/member" of the member holding it; empty when free.
    held_by: str


@attrs.frozen
class NodeMember:
    run_id: str
    attempt: int
    member_index: int
    state: str
    gpu_indexes: tuple[int, ...]
    owner: str


@attrs.frozen
class Node:
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
    cpu_count: int
    memory_bytes: int
    gpu_source: str
    driver_version: str
    cuda_version: str
    gpus: tuple[Gpu, ...]
    members: tuple[NodeMember, ...]
    # The control credential's lifetime (epoch ms; 0: none recorded) and when it was revoked.
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0
    revoked_at_ms: int = 0
    # The display name chosen at enrollment; unique per Fleet (the id for an older coordinator).
    name: str = ""
    # The control address the Node dialed for its current or last stream; "" when not known.
    dialed_address: str = ""
    # Where the Node serves its ended members' outputs to other Nodes; "" when it serves none.
    outputs_address: str = ""
