"""``tuneplane.report``: the metrics SDK a workload imports (``init``, ``log``, ``finish``).

Rules:
- Standard library only: the runner puts this package on the workload's PYTHONPATH, so it must
  import in any training image without installing anything.
- Each process appends to its own file, ``report.rank<RANK>.jsonl`` (``RANK`` as torchrun sets
  it, 0 when unset), with one ``write`` per line on an ``O_APPEND`` descriptor: lines from
  processes or threads never interleave, and every line is on disk for the collector at once.
- Lines use the shapes the collector reads (docs/telemetry.md):
  ``{"step": N, "metrics": {...}, "wall_time": t}`` and ``{"hparams": {...}, "wall_time": t}``.
"""

from __future__ import annotations

import atexit
import json
import numbers
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["ReportError", "finish", "init", "log", "telemetry_dir"]


class ReportError(ValueError):
    """A call to ``tuneplane.report`` was given something it cannot record."""


def telemetry_dir(explicit: str | os.PathLike[str] | None = None) -> str:
    """Where metrics go: ``explicit``, else ``$TUNEPLANE_TELEMETRY_DIR``, else
    ``$TUNEPLANE_OUT_DIR/telemetry``, else ``./tuneplane-telemetry``."""
    if explicit is not None:
        return os.fspath(explicit)
    configured = os.environ.get("TUNEPLANE_TELEMETRY_DIR")
    if configured:
        return configured
    out_dir = os.environ.get("TUNEPLANE_OUT_DIR")
    if out_dir:
        return os.path.join(out_dir, "telemetry")
    return os.path.join(os.getcwd(), "tuneplane-telemetry")


def _rank() -> str:
    rank = os.environ.get("RANK", "0").strip() or "0"
    if not rank.isdigit():
        raise ReportError(
            f"environment variable RANK is {rank!r}, not a non-negative integer; unset it or set "
            "it to this process's rank"
        )
    return str(int(rank))


class _Report:
    """One process's open report file."""

    def __init__(self, directory: str, hparams: Mapping[str, Any] | None) -> None:
        self.directory = directory
        self.rank = _rank()
        self.path = os.path.join(directory, f"report.rank{self.rank}.jsonl")
        self.hparams = dict(hparams) if hparams is not None else None
        self.next_step = 0
        self._fd: int | None = None
        self._pid = os.getpid()

    def write(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if self._fd is None or self._pid != os.getpid():
            # Opened lazily, so ranks that never log leave no empty files behind; reopened in a
            # forked child, which must not share the parent's descriptor bookkeeping.
            os.makedirs(self.directory, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._pid = os.getpid()
        view = memoryview(line)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None


_lock = threading.RLock()
_current: _Report | None = None


def _hparams_json(hparams: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(hparams, Mapping):
        raise ReportError(
            f"init(hparams=...) takes a mapping of name to value, not {type(hparams).__name__}"
        )
    for key in hparams:
        if not isinstance(key, str):
            raise ReportError(f"hparams key {key!r} is not a string; use string names")
    try:
        json.dumps(hparams)
    except (TypeError, ValueError) as exc:
        raise ReportError(
            f"hparams cannot be written as JSON ({exc}); pass numbers, strings, booleans, None, "
            "lists or nested mappings of them"
        ) from None
    return dict(hparams)


def init(
    hparams: Mapping[str, Any] | None = None, *, dir: str | os.PathLike[str] | None = None
) -> None:
    """Start reporting. ``hparams`` are recorded once, by rank 0. Calling ``init`` again with
    the same hparams does nothing; with different ones it is an error until ``finish()``."""
    global _current
    with _lock:
        params = _hparams_json(hparams) if hparams is not None else None
        directory = telemetry_dir(dir)
        if _current is not None:
            if params is not None and _current.hparams is not None and params != _current.hparams:
                raise ReportError(
                    "init() was already called with different hparams; call finish() before "
                    "starting a new report"
                )
            if params is not None and _current.hparams is None:
                _current.hparams = params
                _write_hparams(_current)
            return
        _current = _Report(directory, params)
        if params is not None:
            _write_hparams(_current)


def _write_hparams(report: _Report) -> None:
    if report.rank == "0" and report.hparams is not None:
        report.write({"hparams": report.hparams, "wall_time": time.time()})


def _number(tag: str, value: object) -> float:
    if isinstance(value, bool | str | bytes):
        raise ReportError(
            f"metric {tag!r} is {value!r} ({type(value).__name__}), not a number; log numbers "
            "only (convert tensors with float(...))"
        )
    if isinstance(value, numbers.Real) or hasattr(value, "__float__"):
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ReportError(
                f"metric {tag!r} = {value!r} cannot be converted to a float ({exc}); log a "
                "single number"
            ) from None
    raise ReportError(f"metric {tag!r} is a {type(value).__name__}, not a number; log numbers only")


def log(metrics: Mapping[str, float], step: int | None = None) -> None:
    """Record ``metrics`` (tag -> number) at ``step``; without a step, one past the last.

    Nothing is written unless every value is a number. NaN and infinities are recorded. Calling
    ``log`` before ``init`` starts a report in the default directory."""
    global _current
    with _lock:
        if not isinstance(metrics, Mapping):
            raise ReportError(
                f"log() takes a mapping of tag to number, not {type(metrics).__name__}"
            )
        values: dict[str, float] = {}
        for tag, value in metrics.items():
            if not isinstance(tag, str) or not tag:
                raise ReportError(f"metric tag {tag!r} is not a non-empty string")
            values[tag] = _number(tag, value)
        given: object = step  # callers pass numpy integers too; check what actually came
        if given is not None and (
            isinstance(given, bool) or not isinstance(given, numbers.Integral)
        ):
            raise ReportError(f"step is {step!r}; pass an integer step or leave it out")
        if _current is None:
            _current = _Report(telemetry_dir(), None)
        report = _current
        step_value = report.next_step if step is None else int(step)
        report.write({"step": step_value, "metrics": values, "wall_time": time.time()})
        report.next_step = step_value + 1


def finish() -> None:
    """Close the report file. Safe to call more than once; ``init`` may start a new report."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
            _current = None


atexit.register(finish)
