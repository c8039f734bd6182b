"""JSONL metric files, sans-IO: one JSON object per line, decoded into scalar points.

Rules:
- Accepted lines (docs/telemetry.md): ``{"step": N, "metrics": {tag: number}, "wall_time"?: t}``,
  the flat ``{"step": N, tag: number, ..., "wall_time"?: t}``, and the SDK's
  ``{"hparams": {...}}`` record (an :class:`HParamsMark`, not a scalar). Blank lines are ignored.
- A line is consumed only up to its newline: a partial last line is waited for (and, once the
  writer is done, decoded if it is complete JSON). Malformed lines (not JSON, nested deeper
  than the decoder allows, an integer of more than 4300 digits, a tag holding a NUL or a lone
  surrogate), lines over 1 MiB and non-numeric values are skipped and reported with file, byte
  offset and line number; decoding never raises, and the next line is read.
"""

from __future__ import annotations

import json
from typing import Any

from .point_rules import encoding_problem
from .points import Decoded, HParamsMark, Mark, ReadWarning, ScalarPoint
from .tb_hparams import bounded_hparams

MAX_LINE_BYTES = 1024 * 1024
_RESERVED = frozenset({"step", "wall_time", "metrics"})
# One decoder, called on text: json.loads would sniff the encoding of every line again.
_DECODE = json.JSONDecoder().decode


class JsonlDecoder:
    """Decodes a JSONL metrics stream into scalar points (see :class:`Decoder`)."""

    def __init__(self, source: str, source_id: str = "", state: dict[str, Any] | None = None):
        self.source = source
        self.source_id = source_id or source
        state = state or {}
        # Lines fully consumed so far; the next line's number is lines + 1.
        self.lines = int(state.get("lines", 0))
        # Inside an over-long line already reported: discard through its newline.
        self.skipping = bool(state.get("skipping", False))
        self._marks: list[Mark] = []

    def snapshot(self) -> dict[str, Any]:
        return {"lines": self.lines, "skipping": self.skipping}

    def feed(self, data: bytes, offset: int, *, final: bool = False) -> Decoded:
        points: list[ScalarPoint] = []
        warnings: list[ReadWarning] = []
        marks: list[Mark] = []
        self._marks = marks
        pos = 0
        n = len(data)
        while pos < n:
            newline = data.find(b"\n", pos)
            if newline < 0:
                rest = n - pos
                if self.skipping:
                    pos = n
                elif rest > MAX_LINE_BYTES:
                    warnings.append(self._too_long(offset + pos, rest, self.lines + 1))
                    self.skipping = True
                    pos = n
                elif final:
                    self.lines += 1
                    self._decode_tail(data[pos:], offset + pos, points, warnings)
                    pos = n
                if final and self.skipping:
                    self.skipping = False
                    self.lines += 1
                break
            self.lines += 1
            if self.skipping:
                self.skipping = False
            elif newline - pos > MAX_LINE_BYTES:
                warnings.append(self._too_long(offset + pos, newline - pos, self.lines))
            else:
                self._decode_line(data[pos:newline], offset + pos, points, warnings)
            pos = newline + 1
        return Decoded(points, warnings, pos, marks)

    def _decode_tail(
        self, line: bytes, offset: int, points: list[ScalarPoint], warnings: list[ReadWarning]
    ) -> None:
        """The last line of a finished file has no newline: keep it if it is complete JSON."""
        before = len(warnings)
        self._decode_line(line, offset, points, warnings)
        if len(warnings) > before and warnings[before].kind == "malformed-line":
            warnings[before] = ReadWarning(
                self.source,
                offset,
                "truncated-line",
                "the file ends inside a line that is not complete JSON (the writer stopped "
                "mid-line); the line is lost",
                line=self.lines,
            )

    def _too_long(self, offset: int, seen: int, line: int) -> ReadWarning:
        return ReadWarning(
            self.source,
            offset,
            "line-too-long",
            f"the line is longer than {MAX_LINE_BYTES} bytes ({seen} bytes seen); it is skipped. "
            "Write one small JSON object per step",
            line=line,
        )

    def _warn(self, warnings: list[ReadWarning], offset: int, kind: str, message: str) -> None:
        warnings.append(ReadWarning(self.source, offset, kind, message, line=self.lines))

    def _hparams(self, hparams: object, offset: int, warnings: list[ReadWarning]) -> None:
        """The SDK's ``{"hparams": {...}}`` record: name -> value, kept as JSON text."""
        if not isinstance(hparams, dict):
            self._warn(
                warnings,
                offset,
                "malformed-line",
                f"field 'hparams' is a JSON {type(hparams).__name__}, not an object of name: "
                "value; the record is skipped",
            )
            return
        kept, problems = bounded_hparams((str(k), v) for k, v in hparams.items())
        for problem in problems:
            warnings.append(
                ReadWarning(self.source, offset, "hparam-skipped", problem, False, line=self.lines)
            )
        if kept:
            self._marks.append(HParamsMark(self.source, self.source_id, offset, 0, kept))

    def _decode_line(
        self, line: bytes, offset: int, points: list[ScalarPoint], warnings: list[ReadWarning]
    ) -> None:
        if not line.strip():
            return
        try:
            obj = _DECODE(line.decode("utf-8"))
        except RecursionError:
            self._warn(
                warnings,
                offset,
                "malformed-line",
                "the line nests JSON deeper than the decoder allows; skipped. Write one flat "
                "object per step",
            )
            return
        except ValueError as exc:
            # JSONDecodeError, UnicodeDecodeError, and Python's refusal of an integer of more
            # than 4300 digits are all ValueErrors.
            self._warn(
                warnings,
                offset,
                "malformed-line",
                f"the line is not valid JSON ({_first_words(exc)}); skipped",
            )
            return
        if not isinstance(obj, dict):
            self._warn(
                warnings,
                offset,
                "malformed-line",
                f"the line is a JSON {type(obj).__name__}, not an object with 'step'; skipped",
            )
            return
        if "hparams" in obj and "step" not in obj:
            self._hparams(obj["hparams"], offset, warnings)
            return
        step = obj.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            self._warn(
                warnings,
                offset,
                "malformed-line",
                f"field 'step' is {_short(step)}; every metrics line needs an integer 'step'. "
                "The line is skipped",
            )
            return
        wall_time = obj.get("wall_time")
        if wall_time is not None and not _is_number(wall_time):
            self._warn(
                warnings,
                offset,
                "non-numeric",
                f"field 'wall_time' is {_short(wall_time)}, not a number; the line's values are "
                "kept without a wall time",
            )
            wall_time = None
        if "metrics" in obj:
            metrics = obj["metrics"]
            if not isinstance(metrics, dict):
                self._warn(
                    warnings,
                    offset,
                    "malformed-line",
                    f"field 'metrics' is a JSON {type(metrics).__name__}, not an object of "
                    "tag: number; the line is skipped",
                )
                return
            items = list(metrics.items())
        else:
            items = [(k, v) for k, v in obj.items() if k not in _RESERVED]
        for tag, _ in items:
            why = encoding_problem("tag", tag)
            if why is not None:
                # A NUL or a lone surrogate: the line is not text a person meant to write.
                self._warn(warnings, offset, "malformed-line", f"{why}; the line is skipped")
                return
        when = float(wall_time) if wall_time is not None else None
        for index, (tag, value) in enumerate(items):
            if not _is_number(value):
                self._warn(
                    warnings,
                    offset,
                    "non-numeric",
                    f"metric {tag[:80]!r} is {_short(value)}, not a number; that value is skipped",
                )
                continue
            if not tag:
                self._warn(
                    warnings, offset, "malformed-line", "a metric has an empty tag; it is skipped"
                )
                continue
            points.append(
                ScalarPoint(
                    self.source, tag, step, when, float(value), offset, index, self.source_id
                )
            )


def _is_number(value: object) -> bool:
    if type(value) is float:
        return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    # Huge JSON integers do not fit a float; NaN and infinities are kept (a diverged loss is data).
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _first_words(exc: ValueError) -> str:
    """The decoder's reason, bounded (a reason may quote the line)."""
    if not isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        # Python refuses to convert an integer literal of more than 4300 digits.
        return "it holds an integer too long to convert"
    text = str(exc)
    return text if len(text) <= 120 else text[:117] + "..."


def _short(value: object) -> str:
    try:
        shown = json.dumps(value)
    except (RecursionError, ValueError):
        return f"a JSON {type(value).__name__}"
    return shown if len(shown) <= 60 else shown[:57] + "..."
