"""Hypothesis fuzzing of every parser that reads outside input (issue 8): only documented errors.

- The JobSpec parser raises :class:`JobSpecError` and nothing else.
- The JSONL and TensorBoard readers never raise: bad input becomes a ReadWarning.
- Every RPC's request, decoded the way the listeners decode it
  (:func:`tuneplane.coordinator.gateways.bounded_decode.decode`), is a message or a GRPCError with
  INVALID_ARGUMENT or RESOURCE_EXHAUSTED and a sentence; our conversion of what decoded raises
  only the wire edge's documented errors. The same for what the agent accepts.

Each test is bounded to a few seconds in the default run; set TUNEPLANE_FUZZ_EXAMPLES for a
longer campaign.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Any

import betterproto
import pytest
from grpclib import GRPCError
from grpclib.const import Status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuneplane.agent.wire import UnknownMessage
from tuneplane.agent.wire_convert import from_wire
from tuneplane.collector.jsonl import JsonlDecoder
from tuneplane.collector.tfevent import TFEventDecoder
from tuneplane.collector.tfrecord import frame
from tuneplane.coordinator.gateways.bounded_decode import MAX_SHIP_POINTS, decode
from tuneplane.coordinator.wire import control, fleet, telemetry
from tuneplane.coordinator.wire.errors import BadMessage
from tuneplane.coordinator.wire.members import member_key
from tuneplane.proto import v1
from tuneplane.proto.contract import jobspec

EXAMPLES = int(os.environ.get("TUNEPLANE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _request_types() -> list[type[betterproto.Message]]:
    """The request type of every RPC of the three services, read from the generated bases."""
    found: dict[str, type[betterproto.Message]] = {}
    for base in (v1.ApiBase, v1.ControlBase, v1.TelemetryBase):
        service: Any = type("Service", (base,), {"__abstractmethods__": frozenset()})()
        for handler in service.__mapping__().values():
            found[handler.request_type.__name__] = handler.request_type
    return [found[name] for name in sorted(found)]


REQUESTS = _request_types()

# -- messages built from the generated classes ----------------------------------------------

_INTS = {
    "int32": st.integers(-(2**31), 2**31 - 1),
    "sint32": st.integers(-(2**31), 2**31 - 1),
    "sfixed32": st.integers(-(2**31), 2**31 - 1),
    "uint32": st.integers(0, 2**32 - 1),
    "fixed32": st.integers(0, 2**32 - 1),
    "int64": st.integers(-(2**63), 2**63 - 1),
    "sint64": st.integers(-(2**63), 2**63 - 1),
    "sfixed64": st.integers(-(2**63), 2**63 - 1),
    "uint64": st.integers(0, 2**64 - 1),
    "fixed64": st.integers(0, 2**64 - 1),
}
# Text a protobuf string can carry (valid UTF-8, so no lone surrogates), NUL included.
_TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)


def _info(cls: type[betterproto.Message]) -> Any:
    """betterproto's per-class field metadata (typed too loosely for mypy)."""
    current: Any = cls
    return current._betterproto


def _field(meta: Any, cls: type[betterproto.Message], name: str, depth: int) -> Any:
    kind = meta.proto_type
    if kind in _INTS:
        return _INTS[kind]
    if kind == "bool":
        return st.booleans()
    if kind in ("double", "float"):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if kind == "float" else 64)
    if kind == "string":
        return _TEXT
    if kind == "bytes":
        return st.binary(max_size=12)
    if kind == "enum":
        return st.integers(0, 12)
    if kind == "message":
        sub = _info(cls).cls_by_field[name]
        return messages(sub, depth + 1) if depth < 3 else st.just(sub())
    if kind == "map":
        value = st.binary(max_size=8) if meta.map_types[1] == "bytes" else _TEXT
        return st.dictionaries(_TEXT, value, max_size=2)
    raise AssertionError(f"no strategy for proto type {kind}")


def messages(cls: type[betterproto.Message], depth: int = 0) -> st.SearchStrategy[Any]:
    """Instances of ``cls`` with a random subset of fields set (one member of each oneof)."""
    metas = _info(cls).meta_by_field_name

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        values: dict[str, Any] = {}
        groups: set[str] = set()
        for name, meta in metas.items():
            if not draw(st.booleans()):
                continue
            if meta.group:
                if meta.group in groups:
                    continue
                groups.add(meta.group)
            strategy = _field(meta, cls, name, depth)
            repeated = isinstance(_info(cls).default_gen[name](), list)
            if repeated:
                values[name] = draw(st.lists(strategy, max_size=3))
            else:
                values[name] = draw(strategy)
        try:
            return cls(**values)
        except (TypeError, ValueError):
            return cls()

    return build()


def _mutated(data: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.just(data),
        st.integers(0, len(data)).map(lambda n: data[:n]),
        st.tuples(st.integers(0, len(data)), st.binary(min_size=1, max_size=8)).map(
            lambda t: data[: t[0]] + t[1] + data[t[0] + len(t[1]) :]
        ),
    )


@st.composite
def request_bytes(draw: st.DrawFn) -> tuple[type[betterproto.Message], bytes]:
    cls = draw(st.sampled_from(REQUESTS))
    if draw(st.booleans()):
        return cls, draw(st.binary(max_size=256))
    message = draw(messages(cls))
    try:
        data = bytes(message)
    except (TypeError, ValueError, struct.error):
        data = b""
    return cls, draw(_mutated(data))


def _convert(message: Any) -> None:
    """What the coordinator does with a decoded request before any store call."""
    if isinstance(message, v1.EnrollRequest):
        control.inventory_from_wire(message.inventory, message.hostname)
    elif isinstance(message, v1.NodeMessage):
        _, body = betterproto.which_one_of(message, "body")
        if isinstance(body, v1.Hello):
            control.inventory_from_wire(body.inventory)
            control.held_from_wire(body)
            control.outputs_from_wire(body)
        elif isinstance(body, v1.Heartbeat):
            control.inventory_from_wire(body.inventory)
        elif isinstance(body, v1.MemberReport):
            control.report_from_wire(body)
        elif isinstance(body, v1.PrepareReply | v1.DecisionQuery | v1.LogChunk):
            member_key(body.member)
    elif isinstance(message, v1.ShipRequest):
        member_key(message.member)
        telemetry.progress_from_wire(message.progress)
        for point in message.points:
            telemetry.point_from_wire(point)
        telemetry.points_from_columns(message.columns)
        for restart in message.restarts:
            telemetry.restart_from_wire(restart)
        for hparams in message.hparams:
            telemetry.hparams_from_wire(hparams)
    elif isinstance(message, v1.PreviewRequest):
        with contextlib.suppress(jobspec.JobSpecError):
            jobspec.loads(message.jobspec_json)


@FUZZ
@given(request_bytes())
def test_every_rpc_request_decodes_or_is_refused_with_a_documented_status(
    case: tuple[type[betterproto.Message], bytes],
) -> None:
    cls, data = case
    try:
        message = decode(data, cls)
    except GRPCError as exc:
        assert exc.status in (Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED), exc
        assert (exc.message or "").rstrip().endswith("."), exc.message
        return
    assert isinstance(message, cls)
    try:
        _convert(message)
    except BadMessage as exc:
        assert str(exc).endswith("."), exc


@FUZZ
@given(messages(v1.CoordinatorMessage).map(bytes).flatmap(_mutated))
def test_what_the_agent_accepts_is_a_message_or_a_documented_refusal(data: bytes) -> None:
    try:
        message = decode(data, v1.CoordinatorMessage)
    except GRPCError as exc:
        assert exc.status in (Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED), exc
        return
    try:
        from_wire(message)
    except UnknownMessage as exc:
        assert str(exc).endswith(".") or "skipped" in str(exc), exc


@FUZZ
@given(messages(v1.Node), messages(v1.Fleet))
def test_tp_reads_any_node_or_fleet_reply(node: v1.Node, fleet_msg: v1.Fleet) -> None:
    fleet.node_from_wire(v1.Node().parse(bytes(node)))
    fleet.fleet_from_wire(v1.Fleet().parse(bytes(fleet_msg)))


def test_a_ship_batch_is_counted_before_it_is_decoded() -> None:
    points = b"".join(bytes(v1.ShipRequest(points=[v1.MetricPoint()])) for _ in range(2))
    assert decode(points, v1.ShipRequest).points
    over = bytes([0x12, 0x00]) * (MAX_SHIP_POINTS + 1)  # field 2, empty, one more than allowed
    with pytest.raises(GRPCError) as caught:
        decode(over, v1.ShipRequest)
    assert caught.value.status == Status.RESOURCE_EXHAUSTED
    assert f"ShipRequest.points holds more than {MAX_SHIP_POINTS}" in (caught.value.message or "")


# -- the JobSpec parser ---------------------------------------------------------------------

_ANY_TEXT = st.text(st.characters(blacklist_categories=()), max_size=10)  # surrogates too
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**40), 10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_ANY_TEXT, inner, max_size=3),
    max_leaves=12,
)
_BASE = {
    "api_version": "tuneplane/v1",
    "project": "demo",
    "experiment": "hello",
    "method_id": "custom/custom",
    "recipe_digest": "sha256:" + "0" * 64,
    "runtime_id": "host:bash",
    "entrypoint": ["bash", "train.sh"],
    "resources": {"profile": "cpu", "series": "", "gpus": 0},
    "parameters": {},
    "env": {},
    "source_files": {"train.sh": "ZWNobwo="},
}


@FUZZ
@given(st.sampled_from(sorted(_BASE)), _JSON, st.sampled_from(["replace", "inside"]))
def test_the_jobspec_parser_raises_only_jobspec_errors(key: str, value: Any, how: str) -> None:
    raw = json.loads(json.dumps(_BASE))
    if how == "inside" and isinstance(raw[key], dict):
        raw[key]["fuzzed"] = value
    else:
        raw[key] = value
    for text in (None, json.dumps(raw)):
        try:
            spec = jobspec.parse(raw) if text is None else jobspec.loads(text)
        except jobspec.JobSpecError as exc:
            assert str(exc).rstrip().endswith("."), exc
            continue
        # What is admitted can be hashed and sent on: canonical JSON is valid UTF-8.
        jobspec.digest(spec)


@FUZZ
@given(st.text(max_size=200))
def test_any_text_is_a_jobspec_or_a_jobspec_error(text: str) -> None:
    with contextlib.suppress(jobspec.JobSpecError):
        jobspec.loads(text)


# -- the telemetry readers --------------------------------------------------------------------

_LINE = st.one_of(
    _JSON.map(lambda v: json.dumps(v).encode("utf-8", "surrogatepass")),
    st.fixed_dictionaries({"step": _JSON, "metrics": _JSON}).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
)


@FUZZ
@given(st.lists(_LINE, max_size=8), st.booleans(), st.integers(0, 2**40))
def test_the_jsonl_reader_never_raises(lines: list[bytes], final: bool, offset: int) -> None:
    data = b"\n".join(lines)
    decoded = JsonlDecoder("metrics.jsonl").feed(data, offset, final=final)
    assert 0 <= decoded.consumed <= len(data)
    for point in decoded.points:
        assert isinstance(point.value, float) and isinstance(point.step, int)
    assert all(w.message for w in decoded.warnings)


_EVENT_FIELD = st.tuples(st.integers(1, 8), st.sampled_from([0, 1, 2, 5]), st.binary(max_size=20))


def _proto_bytes(fields: list[tuple[int, int, bytes]]) -> bytes:
    out = bytearray()
    for number, kind, payload in fields:
        out.append((number << 3) | kind)
        if kind == 2:
            out.append(len(payload) & 0x7F)
        out += payload
    return bytes(out)


@FUZZ
@given(
    st.lists(
        st.one_of(st.binary(max_size=60), st.lists(_EVENT_FIELD, max_size=4).map(_proto_bytes)),
        max_size=6,
    ),
    st.binary(max_size=30),
    st.booleans(),
)
def test_the_tensorboard_reader_never_raises(
    records: list[bytes], garbage: bytes, final: bool
) -> None:
    data = b"".join(frame(r) for r in records) + garbage
    decoded = TFEventDecoder("events.out.tfevents.1").feed(data, 0, final=final)
    assert 0 <= decoded.consumed <= len(data)
    assert all(w.message for w in decoded.warnings)
