"""Fleets and Nodes as the store reports them and the Api returns them.

Rules: frozen attrs values only (see :mod:`..values`). A Node's scheduling state and its control
connectivity are separate fields and never merged. Field names follow the Api messages.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from .jobs import MemberKey
from .orders import Inventory


@attrs.frozen
class SeriesCapacity:
    series: str
    total: int
    healthy: int
    free: int
    in_use: int
    quota: int  # 0: no quota


@attrs.frozen
class SlurmSeries:
    """How a Fleet of kind slurm asks Slurm for one Series: its GPUs as a typed ``gpu`` GRES
    (``gpu:<gres_type>:<n>``) and/or its nodes by a node feature (Slurm's ``--constraint``)."""

    series: str
    gres_type: str = ""  # "": GPUs of any type
    constraint: str = ""  # "": any node of the partition


@attrs.frozen
class SlurmPartitionNode:
    """One node of a Slurm partition, in Slurm's own words (``state`` as slurmrestd writes it)."""

    name: str
    state: str
    cpus: int
    gpus: int
    gpus_used: int
    gres: str


@attrs.frozen
class SlurmPartition:
    """A Fleet of kind slurm's partition as slurmrestd reported it when it was asked; ``error``
    is the sentence saying why it could not be read ("" when it was)."""

    slurmrestd: str
    partition: str
    nodes: tuple[SlurmPartitionNode, ...]
    error: str = ""
    # How the Fleet asks Slurm for each Series it maps (its settings, not slurmrestd's answer).
    series: tuple[SlurmSeries, ...] = ()
    # Where its Slurm step caches runtime images and the registries file its nodes read (its
    # settings; "" when not set: the Fleet runs no images, or reaches registries with the
    # system's CAs).
    image_root: str = ""
    registries_file: str = ""


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
    # Kind slurm, when one Fleet was asked for (GetFleet, `tp fleet show`); None otherwise.
    slurm: SlurmPartition | None = None


@attrs.frozen
class NodeMember:
    """A live member a Node holds."""

    member: MemberKey
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
    inventory: Inventory
    # GPU index -> the member whose reservation holds it (only GPUs of the inventory).
    held_by: Mapping[int, MemberKey]
    members: tuple[NodeMember, ...]
    # The control credential's lifetime (epoch ms; 0: none recorded) and when it was revoked.
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0
    revoked_at_ms: int = 0
    # The display name chosen at enrollment (store.enrollment.free_node_name); unique per Fleet.
    name: str = ""
    # The control address the Node dialed for its current or last stream; "" before it said.
    dialed_address: str = ""
    # Where the Node serves its ended members' outputs to other Nodes (its last Hello); "" when
    # it serves none.
    outputs_address: str = ""


@attrs.frozen
class NodeRecord:
    """A Node as the control gateway needs it when a credential or a join token names it."""

    id: str
    fleet: str
    hostname: str
    connected: bool


@attrs.frozen
class SlurmSettings:
    """Where a Fleet of kind ``slurm`` reaches its cluster: slurmrestd's URL, the file holding
    the JWT (read at each use, so the operator can replace the token), and the partition its
    Jobs run in."""

    slurmrestd: str
    token_file: str  # an absolute path on the coordinator's machine
    partition: str
    # The folder every Slurm node and the coordinator see at the same path, where each
    # attempt's capsule, member folders, exit records and logs live; "" when not set (Jobs are
    # refused at Preview then).
    shared_dir: str = ""
    # The interpreter, with TunePlane installed, that runs the Slurm step on the nodes.
    python: str = "python3"
    # A folder on each node's own storage for the collectors' spools ("": the node's temporary
    # folder).
    spool_dir: str = ""
    # The Series the Fleet maps, by name; none: every Series is asked as GPUs of any type.
    series: tuple[SlurmSeries, ...] = ()
    # For image runtimes: a folder on each node's own storage where the Slurm step caches
    # images ("": the Fleet runs no images; Preview refuses them), and a TOML file on every
    # node with node.toml's [registries."host:port"] tables ("": the system's CAs).
    image_root: str = ""
    registries_file: str = ""
