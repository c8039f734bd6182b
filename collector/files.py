"""Which files hold telemetry, the decoder for each, and reading a whole file once.

Rules:
- TensorBoard event files are recognised as TensorBoard does (``tfevents`` in the name); JSONL
  files by ``.jsonl`` in the name, so rotated copies (``metrics.jsonl.1``) are still followed.
  Compressed rotations (``.gz``, ``.bz2``, ``.xz``, ``.zst``) are not telemetry.
- Reading is chunked; a decoder never sees more than one chunk plus its unconsumed rest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from tuneplane.collector.jsonl import JsonlDecoder
from tuneplane.collector.points import Decoded, Decoder, ReadWarning, ScalarPoint
from tuneplane.collector.tfevent import TFEventDecoder

Kind = Literal["tfevents", "jsonl"]
CHUNK_BYTES = 4 * 1024 * 1024
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


class TelemetryPathError(ValueError):
    """A path given to a reader is not a telemetry file or directory."""


def kind_of(name: str) -> Kind | None:
    """The format of a file by its base name, or None when it is not telemetry."""
    base = os.path.basename(name)
    if base.endswith(_COMPRESSED) or base.startswith("."):
        return None
    if "tfevents" in base:
        return "tfevents"
    if ".jsonl" in base:
        return "jsonl"
    return None


def make_decoder(
    kind: Kind, source: str, source_id: str = "", state: dict[str, Any] | None = None
) -> Decoder:
    if kind == "tfevents":
        return TFEventDecoder(source, source_id, state)
    return JsonlDecoder(source, source_id, state)


def telemetry_files(root: Path) -> Iterator[Path]:
    """Every telemetry file under ``root`` (recursively), in a stable order."""
    for directory, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if kind_of(name) is not None:
                yield Path(directory) / name


def read_chunks(
    handle: Any, decoder: Decoder, start: int, *, final: bool, limit: int | None = None
) -> Iterator[Decoded]:
    """Feed ``handle`` from byte ``start`` to its end through ``decoder``.

    Yields one :class:`Decoded` per chunk whose ``consumed`` is absolute: the stream position
    the caller may resume from (``handle.tell()`` is how far was read). ``limit`` bounds how far
    decoding advances in one call, but a record larger than it is still read to its end. With
    ``final`` the last chunk reports an incomplete tail.
    """
    handle.seek(start)
    pending = b""
    position = start
    while limit is None or position - start < limit:
        chunk = handle.read(CHUNK_BYTES)
        at_end = not chunk
        if at_end and not final:
            return
        data = pending + chunk if pending else chunk
        if not data:
            return
        decoded = decoder.feed(data, position, final=final and at_end)
        position += decoded.consumed
        pending = data[decoded.consumed :]
        yield Decoded(decoded.points, decoded.warnings, position)
        if at_end:
            return


def read_file(path: Path, source: str) -> tuple[list[ScalarPoint], list[ReadWarning]]:
    """Decode a whole file as the collector would, treating it as finished."""
    kind = kind_of(path.name)
    if kind is None:
        raise TelemetryPathError(
            f"{path} is not a telemetry file: names must contain 'tfevents' (TensorBoard) or "
            "'.jsonl' (JSON lines). Rename it or point at its directory"
        )
    decoder = make_decoder(kind, source)
    points: list[ScalarPoint] = []
    warnings: list[ReadWarning] = []
    with path.open("rb") as handle:
        for decoded in read_chunks(handle, decoder, 0, final=True):
            points += decoded.points
            warnings += decoded.warnings
    return points, warnings
