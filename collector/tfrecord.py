"""TFRecord framing, sans-IO: u64 length, masked CRC32C of the length, data, masked CRC32C of data.

Rules:
- A record is released only when both CRCs match; an incomplete tail is waited for (not consumed)
  unless the stream is final, when it is reported as truncated.
- A bad data CRC skips that one record (its length CRC vouched for the length); a bad length CRC
  starts a resync that scans byte by byte for the next header whose CRCs match. Either way the
  reader moves on: corruption is reported, never a stall and never a crash.
"""

from __future__ import annotations

import struct

import attrs
import google_crc32c

HEADER_BYTES = 12
FOOTER_BYTES = 4
# A length above this is treated as a corrupt header: no scalar event comes near it, and waiting
# for a gigabyte that will never arrive would be a stall.
MAX_RECORD_BYTES = 256 * 1024 * 1024

_HEADER = struct.Struct("<QI")
_CRC = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC32C: rotate right by 15 bits, then add a constant (mod 2**32)."""
    crc: int = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One record as a writer frames it (used by tests and the benchmark to build files)."""
    header = struct.pack("<Q", len(data))
    return header + _CRC.pack(masked_crc32c(header)) + data + _CRC.pack(masked_crc32c(data))


@attrs.frozen
class Corruption:
    """A framing fault at stream ``offset``: ``kind`` is a short slug, ``message`` a sentence."""

    offset: int
    kind: str
    message: str


@attrs.frozen
class Split:
    records: list[tuple[int, bytes]]
    corruptions: list[Corruption]
    consumed: int


@attrs.define
class RecordSplitter:
    """Splits a byte stream into records; ``resyncing`` persists across calls and checkpoints."""

    resyncing: bool = False

    def split(
        self,
        buf: bytes,
        offset: int,
        *,
        final: bool = False,
        start: int = 0,
        max_records: int | None = None,
    ) -> Split:
        """Records of ``buf[start:]`` (``buf`` begins at stream ``offset``); ``consumed`` is a
        position in ``buf``. With ``max_records`` it stops once that many records were released
        or skipped for a bad data CRC, so a caller can take the next one itself."""
        records: list[tuple[int, bytes]] = []
        corruptions: list[Corruption] = []
        pos = start
        n = len(buf)
        unpack_header = _HEADER.unpack_from
        unpack_crc = _CRC.unpack_from
        taken = 0
        while max_records is None or taken < max_records:
            if self.resyncing:
                found = _find_header(buf, pos, final=final)
                if found is None:
                    # The next header may straddle the end of what we have: keep its 11 bytes.
                    pos = n if final else max(pos, n - (HEADER_BYTES - 1))
                    break
                pos = found
                self.resyncing = False
            if n - pos < HEADER_BYTES:
                break
            length, length_crc = unpack_header(buf, pos)
            if length > MAX_RECORD_BYTES or masked_crc32c(buf[pos : pos + 8]) != length_crc:
                corruptions.append(
                    Corruption(
                        offset + pos,
                        "bad-length-crc",
                        "the record header's CRC does not match (corrupt or overwritten bytes); "
                        "skipping to the next valid record",
                    )
                )
                self.resyncing = True
                pos += 1
                continue
            start = pos + HEADER_BYTES
            end = start + length + FOOTER_BYTES
            if end > n:
                break
            data = buf[start : start + length]
            if masked_crc32c(data) != unpack_crc(buf, start + length)[0]:
                corruptions.append(
                    Corruption(
                        offset + pos,
                        "bad-data-crc",
                        f"the {length}-byte record's data CRC does not match; the record is "
                        "skipped",
                    )
                )
            else:
                records.append((offset + pos, data))
            pos = end
            taken += 1
        if final and pos < n and (max_records is None or taken < max_records):
            if not self.resyncing:
                corruptions.append(
                    Corruption(
                        offset + pos,
                        "truncated-record",
                        f"the file ends inside a record ({n - pos} bytes of it were written); "
                        "the writer stopped mid-flush and the record is lost",
                    )
                )
            pos = n
        return Split(records, corruptions, pos)


def _find_header(buf: bytes, start: int, *, final: bool) -> int | None:
    """The first position at or after ``start`` where a record with matching CRCs begins.

    A candidate whose data is not all here yet is accepted on its length CRC alone (a false
    match has odds of 2**-32 per position) unless the stream is final.
    """
    n = len(buf)
    unpack_header = _HEADER.unpack_from
    for pos in range(start, n - HEADER_BYTES + 1):
        length, length_crc = unpack_header(buf, pos)
        if length > MAX_RECORD_BYTES or masked_crc32c(buf[pos : pos + 8]) != length_crc:
            continue
        begin = pos + HEADER_BYTES
        end = begin + length + FOOTER_BYTES
        if end > n:
            if final:
                continue
            return pos
        if masked_crc32c(buf[begin : begin + length]) == _CRC.unpack_from(buf, begin + length)[0]:
            return pos
    return None


def header_length(header: bytes) -> int | None:
    """The data length a 12-byte record header announces, or None when it fails the checks
    :meth:`RecordSplitter.split` applies (its CRC, :data:`MAX_RECORD_BYTES`)."""
    length, length_crc = _HEADER.unpack(header)
    if length > MAX_RECORD_BYTES or masked_crc32c(header[:8]) != length_crc:
        return None
    return int(length)
