"""Which points may be shipped: one rule, used by the collector before it spools a point and by
the telemetry gateway for every point it receives (a collector is not trusted to have used it).

Rules:
- Pure: the caller passes ``now`` (seconds since the epoch); nothing here reads a clock.
- A point is refused on its own, with a sentence naming the field, what is wrong and the limit;
  the rest of its batch goes on. docs/telemetry.md ("Points the collector refuses") lists them.
- Values are never refused: NaN and the infinities are data (a diverging loss). Steps are any
  int64, negative ones included, as TensorBoard keeps them. A wall time, when present, must be
  finite, not before 2000-01-01 and at most a day ahead of ``now``.
- ``system/`` tags come only from the source ``system`` (the collector's GPU and process
  samples) and that source carries nothing else: a workload's file cannot forge them.
- Marks (restarts, hparams) are checked by :func:`mark_problem` the same way on both sides:
  names as tags are, at most :data:`MAX_MARK_NAMES` names, hparam values JSON text of at most
  :data:`MAX_HPARAM_VALUE_CHARS` characters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import attrs

from .points import HParamsMark, Mark, ReadWarning, RestartMark, ScalarPoint

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_TAG_CHARS = 1024
MAX_SOURCE_CHARS = 4096
#: 2000-01-01T00:00:00Z. Earlier wall times are a unit mistake (steps, or milliseconds / 1e6).
EARLIEST_WALL_TIME = 946_684_800.0
#: How far ahead of the checking clock a wall time may be (clock skew between machines).
MAX_FUTURE_S = 86_400.0
#: The kind of the data-loss warning a refused point becomes.
REFUSED_KIND = "not-shippable"
#: The collector's own series (GPU and process samples): their source and their tags' prefix.
SYSTEM_SOURCE = "system"
SYSTEM_PREFIX = "system/"


def text_problem(field: str, text: str, limit: int) -> str | None:
    """Why ``text`` cannot name a point's ``field`` (``tag`` or ``source name``), or None."""
    if not text:
        return f"the {field} is empty"
    if len(text) > limit:
        return f"the {field} is {len(text)} characters, more than {limit}"
    return encoding_problem(field, text)


def encoding_problem(field: str, text: str) -> str | None:
    """Why ``text`` cannot travel or be stored as a name: a NUL, or a lone surrogate."""
    if "\x00" in text:
        return f"the {field} contains a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return f"the {field} is not valid UTF-8 (it holds a lone surrogate)"
    return None


def namespace_problem(source_id: str, tag: str) -> str | None:
    """Why ``tag`` may not come from ``source_id``: the ``system/`` tags and the source
    ``system`` are the collector's own samples (collector/system_sampler.py), so a workload's
    file can neither write into them nor a sample be stored under another name."""
    if tag.startswith(SYSTEM_PREFIX) and source_id != SYSTEM_SOURCE:
        return (
            f"the tag {tag[:80]!r} is in the system/ namespace, which only the collector's own "
            "GPU and process samples may use; log it under another name"
        )
    if source_id == SYSTEM_SOURCE and not tag.startswith(SYSTEM_PREFIX):
        return f"the source {SYSTEM_SOURCE!r} carries only system/ tags, not {tag[:80]!r}"
    return None


def number_problem(step: int, wall_time: float | None, offset: int, now: float) -> str | None:
    """Why a point's step, wall time or byte offset is out of range, or None."""
    if not INT64_MIN <= step <= INT64_MAX:
        return f"the step {_short(step)} does not fit a signed 64-bit integer"
    if not 0 <= offset <= INT64_MAX:
        return f"the byte offset {_short(offset)} is outside 0..2^63-1"
    if wall_time is None:
        return None
    if not math.isfinite(wall_time):
        return f"the wall time is {wall_time}; it must be a finite number of seconds"
    if wall_time < EARLIEST_WALL_TIME:
        return (
            f"the wall time {wall_time:g} is before 2000-01-01; write seconds since the epoch "
            "(time.time())"
        )
    if wall_time > now + MAX_FUTURE_S:
        return (
            f"the wall time {wall_time:g} is more than a day after this machine's clock "
            f"({now:.0f}); write seconds since the epoch (time.time())"
        )
    return None


class Screened(Protocol):
    """What the rule looks at in a point, whichever record carries it."""

    @property
    def source_id(self) -> str: ...
    @property
    def tag(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def wall_time(self) -> float | None: ...
    @property
    def offset(self) -> int: ...


P = TypeVar("P", bound=Screened)


class PointScreen:
    """Applies the rule to many points, remembering the names it already found good."""

    def __init__(self) -> None:
        self._good_tags: set[str] = set()
        self._good_sources: set[str] = set()

    def problem(
        self, source_id: str, tag: str, step: int, wall_time: float | None, offset: int, now: float
    ) -> str | None:
        """Why this point may not be shipped or stored, or None when it may."""
        if source_id not in self._good_sources:
            why = text_problem("source name", source_id, MAX_SOURCE_CHARS)
            if why is not None:
                return why
            self._good_sources.add(source_id)
        if tag not in self._good_tags:
            why = text_problem("tag", tag, MAX_TAG_CHARS)
            if why is not None:
                return why
            self._good_tags.add(tag)
        why = namespace_problem(source_id, tag)
        if why is not None:
            return why
        return number_problem(step, wall_time, offset, now)

    def partition(
        self, points: Iterable[P], now: float, source: Callable[[P], str] | None = None
    ) -> tuple[list[P], list[tuple[P, str]]]:
        """Split ``points`` into those that pass and, for each other one, it and why not.

        ``source`` names a point's source for the rule (its ``source_id`` by default)."""
        good: list[P] = []
        refused: list[tuple[P, str]] = []
        for p in points:
            name = p.source_id if source is None else source(p)
            why = self.problem(name, p.tag, p.step, p.wall_time, p.offset, now)
            if why is None:
                good.append(p)
            else:
                refused.append((p, why))
        return good, refused

    def screen(
        self, points: Iterable[ScalarPoint], now: float
    ) -> tuple[list[ScalarPoint], list[ReadWarning]]:
        """Split ``points`` into those that may be shipped and a data-loss warning per other."""
        good, refused = self.partition(points, now, source=lambda p: p.source_id or p.source)
        return good, [
            ReadWarning(
                p.source,
                p.offset,
                REFUSED_KIND,
                f"{why}; the value of tag {p.tag[:80]!r} is not shipped",
            )
            for p, why in refused
        ]


#: Tags one restart mark names, or hparams (and metric names) one hparams mark carries.
MAX_MARK_NAMES = 256
MAX_HPARAM_VALUE_CHARS = 1024


def mark_problem(
    source_id: str,
    offset: int,
    names: Iterable[str],
    values: Iterable[str] = (),
) -> str | None:
    """Why a restart or hparams mark may not be shipped or stored, or None. ``names`` are its
    tags, or its hparam and metric names; ``values`` its hparam values as JSON text."""
    why = text_problem("source name", source_id, MAX_SOURCE_CHARS)
    if why is None and source_id == SYSTEM_SOURCE:
        why = f"the source {SYSTEM_SOURCE!r} carries only system/ points, not restarts or hparams"
    if why is None:
        why = number_problem(0, None, offset, 0.0)
    if why is not None:
        return why
    for count, name in enumerate(names, 1):
        if count > MAX_MARK_NAMES:
            return f"the mark names more than {MAX_MARK_NAMES} tags or hparams"
        why = text_problem("tag or hparam name", name, MAX_TAG_CHARS)
        if why is not None:
            return why
    for value in values:
        if len(value) > MAX_HPARAM_VALUE_CHARS:
            return (
                f"an hparam value is {len(value)} characters as JSON, more than "
                f"{MAX_HPARAM_VALUE_CHARS}"
            )
        why = encoding_problem("hparam value", value)
        if why is not None:
            return why
    return None


def screen_marks(marks: Iterable[Mark]) -> tuple[list[Mark], list[ReadWarning]]:
    """The marks that may be spooled and shipped, and a warning for what was left out.

    A name that cannot travel (a NUL, a lone surrogate, too long) is dropped from its mark:
    no stored point can carry such a tag, so a restart loses nothing by it; an hparam or metric
    name is lost and said so. A mark that is still refused becomes a warning. The gateway
    refuses a whole call holding a NUL, so none may reach the spool.
    """
    good: list[Mark] = []
    warnings: list[ReadWarning] = []

    def bad_name(name: str) -> bool:
        return text_problem("tag", name, MAX_TAG_CHARS) is not None

    for mark in marks:
        if isinstance(mark, RestartMark) and mark.tags is not None:
            tags = tuple(t for t in mark.tags if not bad_name(t))
            if not tags:
                continue
            mark = attrs.evolve(mark, tags=tags)
        elif isinstance(mark, HParamsMark):
            kept = tuple(
                (n, v) for n, v in mark.hparams if not bad_name(n) and not encoding_problem("", v)
            )
            metrics = tuple(m for m in mark.metrics if not bad_name(m))
            if len(kept) < len(mark.hparams) or len(metrics) < len(mark.metrics):
                warnings.append(
                    ReadWarning(
                        mark.source,
                        mark.offset,
                        "hparam-skipped",
                        "an hparam or metric name (or value) holds a NUL, a lone surrogate or "
                        f"more than {MAX_TAG_CHARS} characters; it is not shipped",
                        data_loss=False,
                    )
                )
            if not kept and not metrics:
                continue
            mark = attrs.evolve(mark, hparams=kept, metrics=metrics)
        names: list[str] = []
        values: list[str] = []
        if isinstance(mark, RestartMark):
            names = list(mark.tags or ())
        else:
            names = [n for n, _ in mark.hparams] + list(mark.metrics)
            values = [v for _, v in mark.hparams]
        why = mark_problem(mark.source_id or mark.source, mark.offset, names, values)
        if why is None:
            good.append(mark)
        else:
            warnings.append(
                ReadWarning(
                    mark.source, mark.offset, REFUSED_KIND, f"{why}; the mark is not shipped"
                )
            )
    return good, warnings


def storable(text: str) -> str:
    """``text`` with lone surrogates (an undecodable file name) written as escapes, so SQLite
    and protobuf can hold it; valid text comes back unchanged."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _short(number: int) -> str:
    # str() of a huge integer is slow, and refused past 4300 digits: say how big it is instead.
    return str(number) if number.bit_length() <= 128 else f"of {number.bit_length()} bits"
