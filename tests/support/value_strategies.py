"""Hypothesis strategies for :mod:`tuneplane.coordinator.values`: values as the coordinator makes
them, for the wire round-trip tests (tests/coordinator/test_wire_*.py).

Rules: every number fits the protocol field it travels in (uint32, int64...), and a value has
the shape its producer gives it wherever the wire cannot say otherwise: a member reference names
a run, a capsule file has a name, a first failure names its attempt (1 or more), an output
manifest has a digest or a problem, a Node has a display name, each GPU index appears once,
and a GPU is held only if the inventory lists it. Text a Node or the coordinator sends to
``tp`` is printable (``tp`` escapes anything else before showing it); floats are never NaN,
which equals nothing (a test of its own checks that NaN travels).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tuneplane.coordinator.downsample import Bucket
from tuneplane.coordinator.values.fleet import (
    Fleet,
    Node,
    NodeMember,
    SeriesCapacity,
    SlurmPartition,
    SlurmPartitionNode,
)
from tuneplane.coordinator.values.jobs import (
    Attempt,
    FirstFailure,
    ImagePreparation,
    Job,
    Member,
    MemberKey,
    Preview,
    PreviewSummary,
    Receipt,
    StateChange,
)
from tuneplane.coordinator.values.lifecycle import (
    CancelOutcome,
    LogPage,
    LogPiece,
    NodeLossOutcome,
    RetryOutcome,
)
from tuneplane.coordinator.values.metrics import (
    Delivery,
    MetricSelector,
    RunHParams,
    SeriesResult,
    TagSummary,
)
from tuneplane.coordinator.values.orders import (
    AbortOrder,
    CancelOrder,
    CommitOrder,
    Gpu,
    HeldMember,
    InitFromFetch,
    Inventory,
    OutputsService,
    PrepareOrder,
    Report,
)
from tuneplane.coordinator.values.telemetry import (
    CollectorReport,
    RefusedPoint,
    ShippedHParams,
    ShippedPoint,
    ShippedRestart,
    ShipResult,
)
from tuneplane.coordinator.wire.control import REPORTED_STATES
from tuneplane.proto.contract.derivation_source import ManifestSummary

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
doubles = st.floats(allow_nan=False)
# Any text a protobuf string carries (valid UTF-8: no lone surrogates).
text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)
# Text tp shows as it is: no control characters either.
printable = st.text(st.characters(blacklist_categories=["Cs", "Cc"]), max_size=12)
name = st.text(st.characters(blacklist_categories=["Cs", "Cc"]), min_size=1, max_size=12)
small = st.integers(0, 5)


def tuples(strategy: st.SearchStrategy[Any], max_size: int = 3) -> st.SearchStrategy[Any]:
    return st.lists(strategy, max_size=max_size).map(tuple)


member_keys = st.builds(MemberKey, run_id=name, attempt=u32, member_index=u32)
manifests = st.one_of(
    st.none(),
    st.builds(ManifestSummary, files=u32, bytes=u64, sha256=name, problem=text),
    st.builds(ManifestSummary, files=u32, bytes=u64, sha256=text, problem=name),
)
member_states = st.sampled_from(REPORTED_STATES)
# A preparing member's image pull; the wire reads an empty image as none.
preparations = st.one_of(
    st.none(),
    st.builds(
        ImagePreparation, image=name, bytes_done=u64, bytes_total=u64, layers_done=u32,
        layers_total=u32, phase=text, reported_at_ms=i64,
    ),
)  # fmt: skip

# -- jobs ---------------------------------------------------------------------------------------

state_changes = st.builds(StateChange, state=text, at_ms=i64, reason=text)
members = st.builds(
    Member,
    index=u32,
    node_id=text,
    state=text,
    has_exit=st.booleans(),
    exit_code=i32,
    signal=i32,
    out_dir=text,
    gpu_indexes=tuples(u32),
    history=tuples(state_changes),
    ended_at_ms=i64,
    node_name=text,
    output_manifest=manifests,
    preparation=preparations,
)
attempts = st.builds(
    Attempt,
    number=u32,
    state=text,
    members=tuples(members, 2),
    master_addr=text,
    master_port=u32,
    created_at_ms=i64,
)
first_failures = st.builds(
    FirstFailure,
    attempt=st.integers(1, 2**32 - 1),
    member_index=u32,
    node_id=text,
    state=text,
    has_exit=st.booleans(),
    exit_code=i32,
    signal=i32,
    at_ms=i64,
    what=text,
    stderr_tail=text,
    stderr_cut=st.booleans(),
)
jobs = st.builds(
    Job,
    run_id=text,
    project=text,
    experiment=text,
    owner=text,
    state=text,
    fleet=text,
    profile=text,
    method_id=text,
    preview_id=text,
    digest=text,
    init_from=text,
    created_at_ms=i64,
    history=tuples(state_changes),
    attempts=tuples(attempts, 2),
    state_reason=text,
    first_failure=st.none() | first_failures,
)
summaries = st.builds(
    PreviewSummary,
    fleet=text,
    backend=text,
    series=text,
    gpus_per_member=u32,
    members=u32,
    profile=text,
)
# The Api never sends a preview's owner: what crosses has none.
previews = st.builds(
    Preview,
    preview_id=text,
    digest=text,
    resolved_jobspec_json=text,
    summary=summaries,
    created_at_ms=i64,
    owner=st.just(""),
)
receipts = st.builds(
    Receipt,
    run_id=text,
    preview_id=text,
    digest=text,
    retry_key=text,
    admitted_at_ms=i64,
    created=st.booleans(),
)

# -- the Node boundary --------------------------------------------------------------------------

gpus = st.builds(
    Gpu,
    index=u32,
    series=printable,
    healthy=st.booleans(),
    uuid=printable,
    name=printable,
    memory_bytes=u64,
    mig_enabled=st.booleans(),
    health_reason=printable,
)
inventories = st.builds(
    Inventory,
    hostname=name,
    gpus=st.lists(gpus, max_size=4, unique_by=lambda g: g.index).map(tuple),
    gpu_source=name,
    cpu_count=u32,
    memory_bytes=u64,
    driver_version=printable,
    cuda_version=printable,
)
held_members = st.builds(HeldMember, member=member_keys, state=member_states)
outputs_services = st.builds(OutputsService, address=name, cert_sha256=text, grant_key=st.binary())
reports = st.builds(
    Report,
    report_seq=u64,
    member=member_keys,
    state=member_states,
    at_ms=i64,
    reason=text,
    has_exit=st.booleans(),
    exit_code=i32,
    signal=i32,
    out_dir=text,
    journal_id=text,
    manifest=manifests,
)
init_from_fetches = st.builds(
    InitFromFetch, address=name, cert_sha256=text, grant=text, grant_expires_at_ms=i64
)


@st.composite
def prepare_orders(draw: st.DrawFn) -> PrepareOrder:
    # A rendezvous travels only with its port: member 0 picks it, the others are told it.
    port = draw(st.integers(0, 2**32 - 1))
    return PrepareOrder(
        node_id=draw(text),
        member=draw(member_keys),
        jobspec_json=draw(text),
        member_count=draw(u32),
        gpu_indexes=draw(tuples(u32)),
        pick_rendezvous=draw(st.booleans()),
        capsule_files=draw(st.dictionaries(name, text, max_size=3)),
        owner=draw(text),
        gpu_uuids=draw(tuples(text)),
        rendezvous_nonce=draw(text),
        master_addr=draw(text) if port else "",
        master_port=port,
        init_from_fetch=draw(st.none() | init_from_fetches),
    )


commit_orders = st.builds(
    CommitOrder,
    node_id=text,
    member=member_keys,
    master_addr=text,
    master_port=u32,
    collector_credential=text,
    telemetry_address=text,
    telemetry_fallbacks=st.lists(text, max_size=3).map(tuple),
)
abort_orders = st.builds(AbortOrder, node_id=text, member=member_keys, reason=text)
cancel_orders = st.builds(
    CancelOrder,
    node_id=text,
    member=member_keys,
    reason=text,
    grace_period_s=u32,
    declared_lost=st.booleans(),
)
orders = st.one_of(prepare_orders(), commit_orders, abort_orders, cancel_orders)

# -- Fleets and Nodes -----------------------------------------------------------------------------

capacities = st.builds(
    SeriesCapacity,
    series=printable,
    total=u32,
    healthy=u32,
    free=u32,
    in_use=u32,
    quota=u32,
)
slurm_partitions = st.builds(
    SlurmPartition,
    slurmrestd=printable,
    partition=printable,
    nodes=tuples(
        st.builds(
            SlurmPartitionNode, name=printable, state=printable, cpus=u32, gpus=u32,
            gpus_used=u32, gres=printable,
        )
    ),
    error=printable,
)  # fmt: skip
fleets = st.builds(
    Fleet,
    name=printable,
    kind=printable,
    created_at_ms=i64,
    nodes=u32,
    connected_nodes=u32,
    schedulable_nodes=u32,
    capacity=tuples(capacities),
    queued_jobs=u32,
    active_jobs=u32,
    slurm=st.none() | slurm_partitions,
)
printable_keys = st.builds(MemberKey, run_id=name, attempt=u32, member_index=u32)
node_members = st.builds(
    NodeMember, member=printable_keys, state=printable, gpu_indexes=tuples(u32), owner=printable
)


@st.composite
def nodes(draw: st.DrawFn) -> Node:
    inventory = draw(inventories)
    held = draw(st.lists(st.sampled_from([g.index for g in inventory.gpus])) if inventory.gpus
                else st.just([]))  # fmt: skip
    return Node(
        id=draw(printable),
        fleet=draw(printable),
        hostname=draw(printable),
        scheduling=draw(printable),
        scheduling_reason=draw(printable),
        scheduling_changed_at_ms=draw(i64),
        scheduling_changed_by=draw(printable),
        connected=draw(st.booleans()),
        disconnected_since_ms=draw(i64),
        last_heartbeat_ms=draw(i64),
        enrolled_at_ms=draw(i64),
        inventory=inventory,
        held_by={index: draw(printable_keys) for index in held},
        members=draw(tuples(node_members)),
        credential_issued_at_ms=draw(i64),
        credential_expires_at_ms=draw(i64),
        revoked_at_ms=draw(i64),
        name=draw(name),
        dialed_address=draw(printable),
        outputs_address=draw(printable),
    )


# -- metric reads ---------------------------------------------------------------------------------

selectors = st.builds(
    MetricSelector,
    run_id=name,
    raw=st.booleans(),
    attempt=u32,
    member_index=st.none() | u32,
    source=text,
)


def tag_summaries(raw: bool) -> st.SearchStrategy[TagSummary]:
    """Tags of a raw read (each names its member) or of a canonical one (none does)."""
    return st.builds(
        TagSummary,
        tag=text,
        attempt=u32,
        member_index=u32 if raw else st.none(),
        source=text,
        points=u64,
        last_step=i64,
        last_value=doubles,
        last_wall_time=st.none() | doubles,
        series=u32,
    )


buckets = st.builds(
    Bucket, first_step=i64, last_step=i64, count=u64, min=doubles, max=doubles, last=doubles
)
series_results = st.builds(
    SeriesResult,
    tag=text,
    attempt=u32,
    total_points=u64,
    downsampled=st.booleans(),
    buckets=tuples(buckets, 4),
    series=u32,
)
run_hparams = st.builds(
    RunHParams, source=text, hparams=tuples(st.tuples(text, text)), metrics=tuples(text)
)


def deliveries(run_id: str) -> st.SearchStrategy[Delivery]:
    """One member's delivery of Job ``run_id`` (a GetDelivery reply is about one Job)."""
    return st.builds(
        Delivery,
        member=st.builds(MemberKey, run_id=st.just(run_id), attempt=u32, member_index=u32),
        points_stored=u64,
        spool_points=u64,
        backpressure=st.booleans(),
        drained=st.booleans(),
        last_point_wall_ms=st.none() | i64,
        last_contact_ms=i64,
        warnings=u64,
        data_loss_warnings=u64,
        hparams=tuples(run_hparams),
        orphaned_points=u64,
    )


# -- what collectors ship -------------------------------------------------------------------------

shipped_points = st.builds(
    ShippedPoint,
    source_id=text,
    offset=u64,
    index=u32,
    tag=text,
    step=i64,
    wall_time=st.none() | doubles,
    value=doubles,
)
shipped_restarts = st.builds(
    ShippedRestart,
    source_id=text,
    offset=u64,
    step=i64,
    tags=st.none() | tuples(text),
    wall_time=st.none() | doubles,
)
shipped_hparams = st.builds(
    ShippedHParams,
    source_id=text,
    offset=u64,
    index=u32,
    hparams=tuples(st.tuples(text, text)),
    metrics=tuples(text),
)
collector_reports = st.builds(
    CollectorReport,
    spool_points=u64,
    backpressure=st.booleans(),
    member_exited=st.booleans(),
    drained=st.booleans(),
    warnings=u64,
    data_loss_warnings=u64,
)
ship_results = st.builds(ShipResult, stored=u32, duplicates=u32)
refused_points = st.builds(RefusedPoint, source_id=text, offset=u64, index=u32, reason=text)

# -- lifecycle replies ----------------------------------------------------------------------------

cancel_outcomes = st.builds(CancelOutcome, outcome=text, job=jobs)
retry_outcomes = st.builds(RetryOutcome, attempt=u32, job=jobs)
log_pages = st.builds(
    LogPage,
    attempt=u32,
    member_index=u32,
    stream=text,
    pieces=tuples(st.builds(LogPiece, offset=u64, data=st.binary(max_size=16), dropped_before=u64)),
    next_offset=u64,
    complete=st.booleans(),
    dropped_bytes=u64,
    member_state=text,
)
node_losses = st.builds(
    NodeLossOutcome, node=nodes(), lost=tuples(printable_keys), jobs=tuples(jobs, 2)
)
