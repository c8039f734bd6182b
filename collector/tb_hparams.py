"""The TensorBoard hparams plugin's data (names, values, metric names) and the bounds on hparams.

Rules: field numbers follow proto/tensorboard (``HParamsPluginData``, ``google.protobuf.Value``);
a value nests at most 8 levels. :func:`bounded_hparams` is the one rule for what is shipped, for
TensorBoard's hparams and ``tuneplane.report``'s alike: past a bound an entry is skipped with a
sentence, never shipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tuneplane.proto.varint import WireError, read_varint

from .point_rules import MAX_HPARAM_VALUE_CHARS, MAX_MARK_NAMES
from .protowire import DOUBLE, I64, LEN, VARINT, fields

#: Bounds on one run's hparams: past them an entry is skipped with a warning, never shipped.
MAX_HPARAMS = MAX_MARK_NAMES // 2
MAX_HPARAM_NAME_CHARS = 256


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


def plugin_content(metadata: bytes) -> bytes:
    for number, wire_type, start, end in fields(metadata):
        if number == 1 and wire_type == LEN:
            for inner, inner_type, s, e in fields(metadata, start, end):
                if inner == 2 and inner_type == LEN:
                    return metadata[s:e]
    return b""


def _json_value(buf: bytes, start: int, end: int, depth: int = 0) -> Any:
    """A ``google.protobuf.Value`` as a Python value (null, number, string, bool, dict, list)."""
    if depth > 8:
        raise WireError("an hparam value nests deeper than 8 levels")
    for number, wire_type, s, e in fields(buf, start, end):
        if number == 1 and wire_type == VARINT:
            return None
        if number == 2 and wire_type == I64:
            return DOUBLE.unpack_from(buf, s)[0]
        if number == 3 and wire_type == LEN:
            return buf[s:e].decode("utf-8")
        if number == 4 and wire_type == VARINT:
            return bool(read_varint(buf, s)[0])
        if number == 5 and wire_type == LEN:
            return dict(_map_entries(buf, s, e, depth + 1))
        if number == 6 and wire_type == LEN:
            return [
                _json_value(buf, vs, ve, depth + 1)
                for field, field_type, vs, ve in fields(buf, s, e)
                if field == 1 and field_type == LEN
            ]
    return None


def _map_entries(buf: bytes, start: int, end: int, depth: int) -> list[tuple[str, Any]]:
    """The entries of a ``map<string, Value>`` field (repeated {key = 1, value = 2})."""
    out: list[tuple[str, Any]] = []
    for number, wire_type, s, e in fields(buf, start, end):
        if number != 1 or wire_type != LEN:
            continue
        key = ""
        value: Any = None
        for field, field_type, fs, fe in fields(buf, s, e):
            if field == 1 and field_type == LEN:
                key = buf[fs:fe].decode("utf-8")
            elif field == 2 and field_type == LEN:
                value = _json_value(buf, fs, fe, depth)
        out.append((key, value))
    return out


def hparams_plugin_data(content: bytes) -> tuple[list[tuple[str, Any]], list[str]]:
    """(hparams, metric names) in an ``HParamsPluginData`` message: the session start's
    name -> value map, and the experiment's metric tags (``group/tag`` when grouped)."""
    hparams: list[tuple[str, Any]] = []
    metrics: list[str] = []
    for number, wire_type, start, end in fields(content):
        if number == 3 and wire_type == LEN:  # session_start_info
            hparams += _map_entries(content, start, end, 0)
        elif number == 2 and wire_type == LEN:  # experiment
            for field, field_type, s, e in fields(content, start, end):
                if field != 5 or field_type != LEN:  # metric_infos
                    continue
                for info, info_type, ns, ne in fields(content, s, e):
                    if info != 1 or info_type != LEN:  # MetricInfo.name
                        continue
                    group = tag = ""
                    for part, part_type, ps, pe in fields(content, ns, ne):
                        if part == 1 and part_type == LEN:
                            group = content[ps:pe].decode("utf-8")
                        elif part == 2 and part_type == LEN:
                            tag = content[ps:pe].decode("utf-8")
                    metrics.append(f"{group}/{tag}" if group else tag)
    return hparams, metrics
