"""Which byte stream each telemetry file is: the tailer's sans-IO identity core.

Theory of operation:
- A *stream* is one run of bytes a writer produced; its ``source_id`` is the dedup identity of
  its points. A file is matched to a stream by device+inode *and* by its head (first bytes up to
  1 KiB), so a renamed file keeps its stream, while a truncated file, a copytruncate and an inode
  that the filesystem reused for new content all start a new stream from byte 0 (counted).
- A new inode whose head matches an *orphaned* stream (its file vanished or was truncated) is
  that stream's copy (copy-then-truncate rotation) and continues it at its position, so the
  bytes written between the last read and the truncation are not lost and nothing is read twice.
  A new inode matching a *live* stream waits (it may be a copy about to be adopted); once the
  writers are done, a file whose full 1 KiB head matches is reported as a copy and not read, any
  other waiting file is read as a stream of its own.
- At most ``max_live`` streams are followed at once: a file that would open one more is
  reported as :class:`NotFollowed` (on every look, so the shell decides how often to say so)
  and is not read. Files already followed keep their streams; a copy continuing an orphaned
  stream is always adopted (it frees nothing and takes no new place).
- A stream's ``source_id`` is its file's path when it opened (``#<k>`` after it for the k-th
  later stream at that path), with ``source_prefix`` in front: "" by default; a Slurm job's
  requeued run gives ``restart-<r>/`` so its files' points are not its first run's duplicates.
- ``observe`` takes what the shell saw and returns what changed, as data; it does no I/O.
"""

from __future__ import annotations

from typing import Any

import attrs

from .files import Kind, kind_of

HEAD_BYTES = 1024


@attrs.frozen
class FileStat:
    """One telemetry file as the shell saw it: path relative to the root, inode, size, head."""

    path: str
    dev: int
    ino: int
    size: int
    head: bytes


@attrs.define
class Stream:
    """One stream. ``inode`` is None once its file is gone (orphaned); ``position`` is how far
    it was decoded, ``seen`` how far it was read; ``committed``/``committed_state`` are what the
    checkpoint holds (advanced only when a consumer made the points durable)."""

    source_id: str
    kind: Kind
    path: str
    inode: tuple[int, int] | None
    head: bytes
    position: int = 0
    seen: int = 0
    committed: int = 0
    committed_state: dict[str, Any] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "source_id": self.source_id,
            "kind": self.kind,
            "path": self.path,
            "inode": list(self.inode) if self.inode else None,
            "head": self.head.hex(),
            "committed": self.committed,
            "committed_state": self.committed_state,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Stream:
        inode = raw["inode"]
        committed = int(raw["committed"])
        return cls(
            source_id=str(raw["source_id"]),
            kind=raw["kind"],
            path=str(raw["path"]),
            inode=(int(inode[0]), int(inode[1])) if inode else None,
            head=bytes.fromhex(raw["head"]),
            position=committed,
            seen=committed,
            committed=committed,
            committed_state=dict(raw["committed_state"]),
        )


@attrs.frozen
class Opened:
    """A new stream starts at byte 0 of ``path``."""

    source_id: str
    path: str


@attrs.frozen
class Moved:
    """A stream's file was renamed (rotation); reading continues under the new path."""

    source_id: str
    old_path: str
    path: str


@attrs.frozen
class Restarted:
    """``path``'s inode no longer holds ``old_id``'s bytes; ``new_id`` reads it from byte 0.

    ``reason`` is ``truncated`` (smaller than what was read) or ``replaced`` (different head:
    copytruncate with new bytes already written, or an inode reused for another file)."""

    old_id: str
    new_id: str
    path: str
    reason: str
    size: int
    seen: int


@attrs.frozen
class Adopted:
    """A new file is a copy of orphaned ``source_id``; reading continues there at its position."""

    source_id: str
    path: str


@attrs.frozen
class Vanished:
    """A stream's file is gone from the directory; the stream waits for a copy to adopt."""

    source_id: str
    path: str


@attrs.frozen
class SkippedCopy:
    """Once writers are done: ``path`` is a copy of live ``source_id`` and is not read."""

    source_id: str
    path: str


@attrs.frozen
class NotFollowed:
    """``path`` would be a new stream, but ``limit`` streams are followed already."""

    path: str
    limit: int


Change = Opened | Moved | Restarted | Adopted | Vanished | SkippedCopy | NotFollowed


def _agrees(a: bytes, b: bytes) -> bool:
    common = min(len(a), len(b))
    return common > 0 and a[:common] == b[:common]


@attrs.define
class Tracker:
    """The stream table. Mutated only through :meth:`observe` and :meth:`advance`."""

    streams: dict[str, Stream] = attrs.field(factory=dict)
    # How many streams started at each path, so a restarted path gets a fresh source_id.
    generations: dict[str, int] = attrs.field(factory=dict)
    # New inodes whose head agrees with a known stream's, held back: inode -> path.
    waiting: dict[tuple[int, int], str] = attrs.field(factory=dict)
    # In front of the source id of every stream opened (not stored: the collector is given it).
    source_prefix: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "streams": [s.to_json() for s in self.streams.values()],
            "generations": dict(self.generations),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], source_prefix: str = "") -> Tracker:
        streams = [Stream.from_json(s) for s in raw.get("streams", [])]
        return cls(
            streams={s.source_id: s for s in streams},
            generations={str(k): int(v) for k, v in raw.get("generations", {}).items()},
            source_prefix=source_prefix,
        )

    def unprefixed(self, source_id: str) -> str:
        """``source_id`` as the stream's path named it when it opened (without the prefix)."""
        return source_id.removeprefix(self.source_prefix)

    def live(self) -> list[Stream]:
        return [s for s in self.streams.values() if s.inode is not None]

    def advance(self, source_id: str, position: int, seen: int) -> None:
        stream = self.streams[source_id]
        stream.position = position
        stream.seen = seen

    def observe(
        self, stats: list[FileStat], *, final: bool = False, max_live: int | None = None
    ) -> list[Change]:
        """Match what the shell saw to streams. ``final``: the writers are done, so no file
        waits any longer; ``max_live``: the most streams followed at once (see the module
        notes)."""
        changes: list[Change] = []
        by_inode = {(s.dev, s.ino): s for s in stats}
        claimed: set[tuple[int, int]] = set()
        for stream in list(self.streams.values()):
            if stream.inode is None:
                continue
            stat = by_inode.get(stream.inode)
            if stat is None:
                changes.append(Vanished(stream.source_id, stream.path))
                stream.inode = None
                continue
            claimed.add(stream.inode)
            reason = ""
            if stat.size < stream.seen or len(stat.head) < len(stream.head):
                reason = "truncated"
            elif stat.head[: len(stream.head)] != stream.head:
                reason = "replaced"
            if reason:
                stream.inode = None
                new = self._open(stat, stream.kind)
                changes.append(
                    Restarted(
                        stream.source_id, new.source_id, stat.path, reason, stat.size, stream.seen
                    )
                )
                continue
            if stat.path != stream.path:
                changes.append(Moved(stream.source_id, stream.path, stat.path))
                stream.path = stat.path
            if len(stat.head) > len(stream.head):
                stream.head = stat.head
        live = len(self.live())
        for stat in stats:
            inode = (stat.dev, stat.ino)
            if inode in claimed or stat.size == 0:
                continue
            kind = kind_of(stat.path)
            if kind is None:
                continue
            full = max_live is not None and live >= max_live
            change = self._place(stat, kind, final=final, limit=max_live if full else None)
            if isinstance(change, Opened | Adopted):
                live += 1
            if change is not None:
                changes.append(change)
        return changes

    def _place(
        self, stat: FileStat, kind: Kind, *, final: bool, limit: int | None
    ) -> Change | None:
        """Adopt, hold back, skip or open ``stat``; ``limit``: no stream may be opened (that
        many are followed)."""
        inode = (stat.dev, stat.ino)
        self.waiting.pop(inode, None)
        kin = [s for s in self.streams.values() if s.kind == kind and _agrees(s.head, stat.head)]
        for stream in kin:
            if (
                stream.inode is None
                and len(stat.head) >= len(stream.head)
                and stat.size >= stream.seen
            ):
                stream.inode = inode
                stream.path = stat.path
                return Adopted(stream.source_id, stat.path)
        if kin and not final:
            self.waiting[inode] = stat.path
            return None
        for stream in kin:
            if stream.inode is not None and len(stat.head) == len(stream.head) == HEAD_BYTES:
                return SkippedCopy(stream.source_id, stat.path)
        if limit is not None:
            return NotFollowed(stat.path, limit)
        return Opened(self._open(stat, kind).source_id, stat.path)

    def _open(self, stat: FileStat, kind: Kind) -> Stream:
        generation = self.generations.get(stat.path, 0)
        self.generations[stat.path] = generation + 1
        source_id = self.source_prefix + (
            stat.path if generation == 0 else f"{stat.path}#{generation}"
        )
        stream = Stream(source_id, kind, stat.path, (stat.dev, stat.ino), stat.head)
        self.streams[source_id] = stream
        return stream
