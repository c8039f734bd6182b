"""What the readers produce: scalar points, read warnings, and the decoder contract.

Rules:
- A point's dedup key is (source identity, byte offset of its record or line, index within it);
  the same bytes read twice give the same key, so a re-read after a crash never duplicates.
- A warning names the file, the byte offset and why; ``data_loss`` says whether a value that the
  writer meant to record will never be shipped.
- Marks are what a source says about its points rather than points: a restart (TensorBoard's
  orphaned points) and hparams. They travel beside points with the same kind of dedup key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, overload

import attrs

DedupKey = tuple[str, int, int]


@attrs.frozen(slots=True)
class ScalarPoint:
    """One scalar value of one Series tag at one step.

    ``source`` is the file path relative to the telemetry root at the time it was read;
    ``source_id`` is the identity of the byte stream (stable across renames); ``offset`` is the
    byte offset of the record or line that carried the value and ``index`` its position there.
    ``wall_time`` is None when the source carried none (a JSONL line without ``wall_time``).
    """

    source: str
    tag: str
    step: int
    wall_time: float | None
    value: float
    offset: int
    index: int = 0
    source_id: str = ""

    @property
    def dedup_key(self) -> DedupKey:
        return (self.source_id or self.source, self.offset, self.index)


@attrs.define(slots=True, eq=False)
class ScalarColumns(Sequence[ScalarPoint]):
    """Points of one source held as columns: the event-file reader appends a scalar's fields
    to six columns instead of building an object per point (an attrs object costs more than
    decoding the record). It is a sequence of :class:`ScalarPoint`, each built when read, and
    equal to any sequence of the same points."""

    source: str
    source_id: str = ""
    tags: list[str] = attrs.field(factory=list)
    steps: list[int] = attrs.field(factory=list)
    wall_times: list[float | None] = attrs.field(factory=list)
    values: list[float] = attrs.field(factory=list)
    offsets: list[int] = attrs.field(factory=list)
    indexes: list[int] = attrs.field(factory=list)

    def add(
        self, tag: str, step: int, wall_time: float | None, value: float, offset: int, index: int
    ) -> None:
        self.tags.append(tag)
        self.steps.append(step)
        self.wall_times.append(wall_time)
        self.values.append(value)
        self.offsets.append(offset)
        self.indexes.append(index)

    def extend(self, other: ScalarColumns) -> None:
        """Append ``other``'s points; both hold the same source."""
        if (other.source, other.source_id) != (self.source, self.source_id):
            raise ValueError(
                f"points of {other.source!r} cannot join the columns of {self.source!r}"
            )
        self.tags += other.tags
        self.steps += other.steps
        self.wall_times += other.wall_times
        self.values += other.values
        self.offsets += other.offsets
        self.indexes += other.indexes

    def __len__(self) -> int:
        return len(self.tags)

    def __iter__(self) -> Iterator[ScalarPoint]:
        source, source_id = self.source, self.source_id
        for tag, step, wall_time, value, offset, index in zip(
            self.tags,
            self.steps,
            self.wall_times,
            self.values,
            self.offsets,
            self.indexes,
            strict=True,
        ):
            yield ScalarPoint(source, tag, step, wall_time, value, offset, index, source_id)

    @overload
    def __getitem__(self, i: int) -> ScalarPoint: ...

    @overload
    def __getitem__(self, i: slice) -> list[ScalarPoint]: ...

    def __getitem__(self, i: int | slice) -> ScalarPoint | list[ScalarPoint]:
        if isinstance(i, slice):
            return list(self)[i]
        return ScalarPoint(
            self.source,
            self.tags[i],
            self.steps[i],
            self.wall_times[i],
            self.values[i],
            self.offsets[i],
            self.indexes[i],
            self.source_id,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]


@attrs.frozen(slots=True)
class ReadWarning:
    """Something a reader skipped. ``line`` is 1-based and set for line-oriented sources."""

    source: str
    offset: int
    kind: str
    message: str
    data_loss: bool = True
    line: int | None = None

    def describe(self) -> str:
        where = f"{self.source} at byte {self.offset}"
        if self.line is not None:
            where += f" (line {self.line})"
        return f"{where}: {self.message}"


@attrs.frozen(slots=True)
class RestartMark:
    """A TensorBoard writer restarted: points of the same run directory read *before* this
    mark (in TensorBoard's reading order: file name, then byte offset) whose step is at least
    ``step`` are orphaned, for every tag (``tags`` is None: a ``SessionLog.START``) or only for
    ``tags`` (a step that went backwards in a file without ``file_version``). See
    docs/telemetry.md, "Restarted writers"."""

    source: str
    source_id: str
    offset: int
    step: int
    tags: tuple[str, ...] | None
    wall_time: float | None = None

    @property
    def dedup_key(self) -> DedupKey:
        return (self.source_id or self.source, self.offset, 0)


@attrs.frozen(slots=True)
class HParamsMark:
    """A run's hyperparameters (name -> value as JSON text) and/or the names of the metrics it
    declared, as TensorBoard's hparams plugin or ``tuneplane.report.init(hparams=...)`` wrote
    them. ``index`` tells apart several in one record (TensorBoard writes each in its own
    summary value)."""

    source: str
    source_id: str
    offset: int
    index: int
    hparams: tuple[tuple[str, str], ...]
    metrics: tuple[str, ...] = ()

    @property
    def dedup_key(self) -> DedupKey:
        return (self.source_id or self.source, self.offset, self.index)


Mark = RestartMark | HParamsMark


@attrs.frozen
class Decoded:
    """The result of feeding bytes to a decoder: ``consumed`` bytes are done for good."""

    points: Sequence[ScalarPoint]
    warnings: list[ReadWarning]
    consumed: int
    marks: list[Mark] = attrs.field(factory=list)


class Decoder(Protocol):
    """A sans-IO decoder for one byte stream.

    ``feed(data, offset, final=False)`` decodes ``data`` that starts at byte ``offset`` of the
    stream and reports how many leading bytes it consumed; the caller passes the unconsumed rest
    again, with more bytes appended, on the next call. With ``final=True`` the writer is known to
    be done, so an incomplete tail is reported as a warning and consumed. ``snapshot()`` is the
    JSON-able state matching the end of the consumed bytes (restored through the constructor).
    """

    source: str
    source_id: str

    def feed(self, data: bytes, offset: int, *, final: bool = False) -> Decoded: ...

    def snapshot(self) -> dict[str, Any]: ...
