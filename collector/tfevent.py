"""TensorBoard event files: TFRecord framing plus a hand-written decoder of the scalar fields.

Rules:
- Field numbers follow proto/tensorboard/summary.proto (our copy of TensorBoard's); every other
  field is skipped by its wire type, so unknown or large fields (graphs, images) cost a skip.
- Scalars are TF1 ``simple_value`` values and rank-0 float/double tensors whose tag's plugin is
  ``scalars``. Writers send a tag's metadata on its first value only, so the first metadata seen
  per tag is remembered (as TensorBoard does) and kept in the checkpointed state.
- Restarted writers are judged as TensorBoard's reader judges them (:class:`RunState`, kept in
  the checkpointed state and carried from one event file of a run directory to the next): the
  decoder emits a :class:`RestartMark` wherever TensorBoard would purge orphaned points, and the
  coordinator honours it. The hparams plugin's session start (names and values) and experiment
  (metric names) become :class:`HParamsMark` records.
"""

from __future__ import annotations

import json
import math
import posixpath
import struct
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from .point_rules import MAX_HPARAM_VALUE_CHARS, MAX_MARK_NAMES
from .points import (
    Decoded,
    HParamsMark,
    Mark,
    ReadWarning,
    RestartMark,
    ScalarPoint,
)
from .tfrecord import RecordSplitter

SCALARS_PLUGIN = "scalars"
HPARAMS_PLUGIN = "hparams"
#: ``SessionLog.status`` of a (re)started writer.
SESSION_START = 1
#: Bounds on one run's hparams: past them an entry is skipped with a warning, never shipped.
MAX_HPARAMS = MAX_MARK_NAMES // 2
MAX_HPARAM_NAME_CHARS = 256
#: A by-tag restart names at most this many tags; a larger event is sent as "every tag" (the
#: coordinator then orphans a little more than TensorBoard would, never less).
MAX_RESTART_TAGS = MAX_MARK_NAMES
DT_FLOAT = 1
DT_DOUBLE = 2

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_DOUBLE = struct.Struct("<d")
_FLOAT = struct.Struct("<f")


class WireError(ValueError):
    """A record passed its CRCs but is not a well-formed Event message."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    try:
        byte = buf[pos]
        if byte < 0x80:
            return byte, pos + 1
        result = byte & 0x7F
        shift = 7
        pos += 1
        while True:
            byte = buf[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result, pos
            shift += 7
            if shift > 63:
                raise WireError("a varint runs longer than 10 bytes")
    except IndexError:
        raise WireError("a varint runs past the end of its message") from None


def _fields(buf: bytes, pos: int = 0, end: int = -1) -> list[tuple[int, int, int, int]]:
    """(field number, wire type, start, end) of every field in ``buf[pos:end]``; for LEN fields
    start/end bound the payload, for others the value bytes. Offsets are into ``buf``."""
    out: list[tuple[int, int, int, int]] = []
    n = len(buf) if end < 0 else end
    append = out.append
    try:
        while pos < n:
            # One-byte keys and lengths are the common case: decode them inline.
            key = buf[pos]
            if key < 0x80:
                pos += 1
            else:
                key, pos = _varint(buf, pos)
            wire_type = key & 7
            if wire_type == _LEN:
                length = buf[pos]
                if length < 0x80:
                    start = pos + 1
                else:
                    length, start = _varint(buf, pos)
                pos = start + length
            elif wire_type == _I64:
                start = pos
                pos += 8
            elif wire_type == _I32:
                start = pos
                pos += 4
            elif wire_type == _VARINT:
                start = pos
                while buf[pos] >= 0x80:
                    pos += 1
                pos += 1
            else:
                raise WireError(f"wire type {wire_type} (groups) is not used by event files")
            append((key >> 3, wire_type, start, pos))
            if pos > n:
                raise WireError(f"field {key >> 3} runs past the end of its message")
    except IndexError:
        raise WireError("a field runs past the end of its message") from None
    return out


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _plugin_name(metadata: bytes) -> str:
    for number, wire_type, start, end in _fields(metadata):
        if number == 1 and wire_type == _LEN:
            for inner, inner_type, s, e in _fields(metadata, start, end):
                if inner == 1 and inner_type == _LEN:
                    return metadata[s:e].decode("utf-8", "replace")
    return ""


def tensor_scalar(tensor: bytes) -> float | None:
    """The value of a rank-0 float or double tensor; None for any other tensor."""
    dtype = 0
    rank = 0
    unknown_rank = False
    content = b""
    values: list[float] = []
    for number, wire_type, start, end in _fields(tensor):
        if number == 1 and wire_type == _VARINT:
            dtype = _varint(tensor, start)[0]
        elif number == 2 and wire_type == _LEN:
            for inner, inner_type, s, _e in _fields(tensor, start, end):
                if inner == 2 and inner_type == _LEN:
                    rank += 1
                elif inner == 3 and inner_type == _VARINT:
                    unknown_rank = bool(_varint(tensor, s)[0])
        elif number == 4 and wire_type == _LEN:
            content = tensor[start:end]
        elif number == 5:
            width = _FLOAT.size
            values += [_FLOAT.unpack_from(tensor, p)[0] for p in range(start, end, width)]
        elif number == 6:
            width = _DOUBLE.size
            values += [_DOUBLE.unpack_from(tensor, p)[0] for p in range(start, end, width)]
    if rank or unknown_rank or dtype not in (DT_FLOAT, DT_DOUBLE):
        return None
    if values:
        return values[0] if len(values) == 1 else None
    if content:
        codec = _FLOAT if dtype == DT_FLOAT else _DOUBLE
        return codec.unpack(content)[0] if len(content) == codec.size else None
    # A rank-0 tensor with no values is the dtype's zero (TensorBoard's make_ndarray agrees).
    return 0.0


@attrs.define
class RunState:
    """What TensorBoard's reader (``plugin_event_accumulator.EventAccumulator``, the one its
    server reads runs with) remembers across the events of one run directory, and its rule for
    orphaned points, as a pure state machine.

    Theory of operation, per event in reading order (files sorted by name, then byte offset):

    - an event carrying ``file_version`` sets the version (``brain.Event:2`` -> 2.0);
    - with a version of at least 2, a ``SessionLog.START`` event *after the first one in the
      run* orphans every earlier point whose step is at least the event's step, whatever its
      tag; the first START is a start, not a restart;
    - without such a version (old writers), a summary event whose step is smaller than the
      previous summary event's orphans the earlier points of *its own tags* with a step at
      least its own;
    - every summary event then becomes "the previous summary event".

    Purges apply to points read before the event; the event's own values are kept.
    """

    file_version: float | None = None
    seen_start: bool = False
    most_recent_step: int = -1

    def to_json(self) -> dict[str, Any]:
        return {
            "file_version": self.file_version,
            "seen_start": self.seen_start,
            "most_recent_step": self.most_recent_step,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> RunState:
        raw = raw or {}
        version = raw.get("file_version")
        return cls(
            None if version is None else float(version),
            bool(raw.get("seen_start", False)),
            int(raw.get("most_recent_step", -1)),
        )

    def event(
        self,
        step: int,
        *,
        file_version: str | None = None,
        session_start: bool = False,
        summary_tags: tuple[str, ...] | None = None,
    ) -> tuple[str, ...] | Literal[False] | None:
        """Feed one event; returns False when it orphans nothing, None when it orphans every
        tag (from ``step`` on), or the tags it orphans. ``summary_tags`` is None for an event
        without a summary, else the tags of its values."""
        if file_version is not None:
            self.file_version = parse_file_version(file_version)
        orphans: tuple[str, ...] | Literal[False] | None = False
        if self.file_version and self.file_version >= 2:
            if session_start:
                if self.seen_start:
                    orphans = None
                self.seen_start = True
        elif summary_tags is not None and step < self.most_recent_step:
            orphans = summary_tags
        if summary_tags is not None:
            self.most_recent_step = step
        return orphans


def parse_file_version(text: str) -> float:
    """TensorBoard's reading of ``Event.file_version`` (``brain.Event:2``); -1 when unreadable."""
    try:
        return float(text.split("brain.Event:")[-1])
    except ValueError:
        return -1.0


def run_directory(path: str) -> str:
    """The TensorBoard run a file belongs to: its directory ('' for the root)."""
    return posixpath.dirname(path)


def opening_state(path: str, others: Iterable[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The decoder state a newly found event file ``path`` starts from: the run state where the
    last file before it (by name, in the same directory) stands, as TensorBoard reads a run's
    files one after the other. ``others`` are (path, decoder snapshot) of the other files."""
    directory, name = run_directory(path), posixpath.basename(path)
    before = [
        (posixpath.basename(p), snap)
        for p, snap in others
        if run_directory(p) == directory and posixpath.basename(p) < name
    ]
    if not before:
        return {}
    _, snap = max(before, key=lambda item: item[0])
    return {"run": dict(snap.get("run", {}))}


class TFEventDecoder:
    """Decodes an ``events.out.tfevents.*`` stream into scalar points (see :class:`Decoder`)."""

    def __init__(self, source: str, source_id: str = "", state: dict[str, Any] | None = None):
        self.source = source
        self.source_id = source_id or source
        state = state or {}
        self.plugins: dict[str, str] = dict(state.get("plugins", {}))
        self.run = RunState.from_json(state.get("run"))
        self._splitter = RecordSplitter(resyncing=bool(state.get("resyncing", False)))

    def snapshot(self) -> dict[str, Any]:
        return {
            "plugins": dict(self.plugins),
            "resyncing": self._splitter.resyncing,
            "run": self.run.to_json(),
        }

    def feed(self, data: bytes, offset: int, *, final: bool = False) -> Decoded:
        split = self._splitter.split(data, offset, final=final)
        warnings = [
            ReadWarning(self.source, c.offset, c.kind, c.message) for c in split.corruptions
        ]
        points: list[ScalarPoint] = []
        marks: list[Mark] = []
        for record_offset, record in split.records:
            try:
                self._decode_event(record, record_offset, points, warnings, marks)
            except (WireError, UnicodeDecodeError, struct.error) as exc:
                warnings.append(
                    ReadWarning(
                        self.source,
                        record_offset,
                        "malformed-event",
                        f"the record's CRCs match but it is not a valid Event ({exc}); "
                        "it is skipped",
                    )
                )
        return Decoded(points, warnings, split.consumed, marks)

    def _decode_event(
        self,
        event: bytes,
        offset: int,
        out: list[ScalarPoint],
        warnings: list[ReadWarning],
        marks: list[Mark],
    ) -> None:
        wall_time = 0.0
        step = 0
        summary: tuple[int, int] | None = None
        file_version: str | None = None
        session_start = False
        for number, wire_type, start, end in _fields(event):
            if number == 1 and wire_type == _I64:
                wall_time = _DOUBLE.unpack_from(event, start)[0]
            elif number == 2 and wire_type == _VARINT:
                step = _signed64(_varint(event, start)[0])
            elif number == 3 and wire_type == _LEN:
                file_version = event[start:end].decode("utf-8", "replace")
            elif number == 5 and wire_type == _LEN:
                summary = (start, end)
            elif number == 7 and wire_type == _LEN:
                for inner, inner_type, s, _e in _fields(event, start, end):
                    if inner == 1 and inner_type == _VARINT:
                        session_start = _varint(event, s)[0] == SESSION_START
        tags: tuple[str, ...] | None = None
        if summary is not None:
            tags = tuple(
                _value_tag(event, start, end)
                for number, wire_type, start, end in _fields(event, summary[0], summary[1])
                if number == 1 and wire_type == _LEN
            )
        orphans = self.run.event(
            step, file_version=file_version, session_start=session_start, summary_tags=tags
        )
        if orphans is not False:
            if isinstance(orphans, tuple):
                unique = tuple(dict.fromkeys(orphans))
                orphans = unique if len(unique) <= MAX_RESTART_TAGS else None
            when = wall_time if math.isfinite(wall_time) and wall_time > 0 else None
            marks.append(RestartMark(self.source, self.source_id, offset, step, orphans, when))
        if summary is None:
            return
        index = 0
        plugins = self.plugins
        for number, wire_type, start, end in _fields(event, summary[0], summary[1]):
            if number != 1 or wire_type != _LEN:
                continue
            tag = ""
            simple: float | None = None
            metadata: bytes | None = None
            tensor: bytes | None = None
            for field, field_type, s, e in _fields(event, start, end):
                if field == 1 and field_type == _LEN:
                    tag = event[s:e].decode("utf-8")
                elif field == 2 and field_type == _I32:
                    simple = _FLOAT.unpack_from(event, s)[0]
                elif field == 9 and field_type == _LEN:
                    metadata = event[s:e]
                elif field == 8 and field_type == _LEN:
                    tensor = event[s:e]
            if tag not in plugins:
                if metadata is not None:
                    plugins[tag] = _plugin_name(metadata)
                elif simple is not None:
                    plugins[tag] = SCALARS_PLUGIN
            if metadata is not None and plugins.get(tag) == HPARAMS_PLUGIN:
                mark = self._hparams(metadata, offset, index, warnings)
                if mark is not None:
                    marks.append(mark)
            scalar = simple
            if scalar is None and tensor is not None and plugins.get(tag) == SCALARS_PLUGIN:
                scalar = tensor_scalar(tensor)
                if scalar is None:
                    warnings.append(
                        ReadWarning(
                            self.source,
                            offset,
                            "not-a-scalar",
                            f"tag {tag!r} belongs to the scalars plugin but its tensor is not a "
                            "rank-0 float or double; the value is skipped",
                        )
                    )
            if scalar is not None:
                out.append(
                    ScalarPoint(
                        self.source, tag, step, wall_time, scalar, offset, index, self.source_id
                    )
                )
            index += 1

    def _hparams(
        self, metadata: bytes, offset: int, index: int, warnings: list[ReadWarning]
    ) -> HParamsMark | None:
        hparams, metrics = hparams_plugin_data(_plugin_content(metadata))
        if not hparams and not metrics:
            return None
        kept, why = bounded_hparams(hparams)
        for problem in why:
            warnings.append(
                ReadWarning(self.source, offset, "hparam-skipped", problem, data_loss=False)
            )
        return HParamsMark(
            self.source, self.source_id, offset, index, kept, tuple(metrics[:MAX_HPARAMS])
        )


def bounded_hparams(
    hparams: Iterable[tuple[str, Any]],
) -> tuple[tuple[tuple[str, str], ...], list[str]]:
    """``hparams`` as (name, value as JSON text) within the bounds, and a sentence for each
    one left out. The same rule serves TensorBoard's hparams and ``tuneplane.report``'s."""
    kept: dict[str, str] = {}
    problems: list[str] = []
    for name, value in hparams:
        if name in kept:
            continue
        text = json.dumps(value, allow_nan=True, sort_keys=True)
        if not name or len(name) > MAX_HPARAM_NAME_CHARS or "\x00" in name:
            problems.append(
                f"an hparam name {name[:80]!r} is empty, holds a NUL or is longer than "
                f"{MAX_HPARAM_NAME_CHARS} characters; it is not shipped"
            )
        elif len(text) > MAX_HPARAM_VALUE_CHARS:
            problems.append(
                f"hparam {name[:80]!r} is {len(text)} characters as JSON, more than "
                f"{MAX_HPARAM_VALUE_CHARS}; it is not shipped. Record a shorter value"
            )
        elif len(kept) >= MAX_HPARAMS:
            problems.append(
                f"the run has more than {MAX_HPARAMS} hparams; {name[:80]!r} and later ones "
                "are not shipped"
            )
            break
        else:
            kept[name] = text
    return tuple(kept.items()), problems


def _value_tag(buf: bytes, start: int, end: int) -> str:
    for field, field_type, s, e in _fields(buf, start, end):
        if field == 1 and field_type == _LEN:
            return buf[s:e].decode("utf-8")
    return ""


def _plugin_content(metadata: bytes) -> bytes:
    for number, wire_type, start, end in _fields(metadata):
        if number == 1 and wire_type == _LEN:
            for inner, inner_type, s, e in _fields(metadata, start, end):
                if inner == 2 and inner_type == _LEN:
                    return metadata[s:e]
    return b""


def _json_value(buf: bytes, start: int, end: int, depth: int = 0) -> Any:
    """A ``google.protobuf.Value`` as a Python value (null, number, string, bool, dict, list)."""
    if depth > 8:
        raise WireError("an hparam value nests deeper than 8 levels")
    for number, wire_type, s, e in _fields(buf, start, end):
        if number == 1 and wire_type == _VARINT:
            return None
        if number == 2 and wire_type == _I64:
            return _DOUBLE.unpack_from(buf, s)[0]
        if number == 3 and wire_type == _LEN:
            return buf[s:e].decode("utf-8")
        if number == 4 and wire_type == _VARINT:
            return bool(_varint(buf, s)[0])
        if number == 5 and wire_type == _LEN:
            return dict(_map_entries(buf, s, e, depth + 1))
        if number == 6 and wire_type == _LEN:
            return [
                _json_value(buf, vs, ve, depth + 1)
                for field, field_type, vs, ve in _fields(buf, s, e)
                if field == 1 and field_type == _LEN
            ]
    return None


def _map_entries(buf: bytes, start: int, end: int, depth: int) -> list[tuple[str, Any]]:
    """The entries of a ``map<string, Value>`` field (repeated {key = 1, value = 2})."""
    out: list[tuple[str, Any]] = []
    for number, wire_type, s, e in _fields(buf, start, end):
        if number != 1 or wire_type != _LEN:
            continue
        key = ""
        value: Any = None
        for field, field_type, fs, fe in _fields(buf, s, e):
            if field == 1 and field_type == _LEN:
                key = buf[fs:fe].decode("utf-8")
            elif field == 2 and field_type == _LEN:
                value = _json_value(buf, fs, fe, depth)
        out.append((key, value))
    return out


def hparams_plugin_data(content: bytes) -> tuple[list[tuple[str, Any]], list[str]]:
    """(hparams, metric names) in an ``HParamsPluginData`` message: the session start's
    name -> value map, and the experiment's metric tags (``group/tag`` when grouped)."""
    hparams: list[tuple[str, Any]] = []
    metrics: list[str] = []
    for number, wire_type, start, end in _fields(content):
        if number == 3 and wire_type == _LEN:  # session_start_info
            hparams += _map_entries(content, start, end, 0)
        elif number == 2 and wire_type == _LEN:  # experiment
            for field, field_type, s, e in _fields(content, start, end):
                if field != 5 or field_type != _LEN:  # metric_infos
                    continue
                for info, info_type, ns, ne in _fields(content, s, e):
                    if info != 1 or info_type != _LEN:  # MetricInfo.name
                        continue
                    group = tag = ""
                    for part, part_type, ps, pe in _fields(content, ns, ne):
                        if part == 1 and part_type == _LEN:
                            group = content[ps:pe].decode("utf-8")
                        elif part == 2 and part_type == _LEN:
                            tag = content[ps:pe].decode("utf-8")
                    metrics.append(f"{group}/{tag}" if group else tag)
    return hparams, metrics
