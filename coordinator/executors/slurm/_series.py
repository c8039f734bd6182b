"""Series on a Fleet of kind slurm: the operator's ``--series`` mappings read, and the one a Job
asks Slurm for.

Rules: pure. A mapping is ``SERIES=gres:gpu:TYPE`` (the Series' GPUs are Slurm's ``gpu`` GRES
of that type) or ``SERIES=constraint:FEATURE`` (its nodes carry that node feature); one Series
may be given once of each. Anything else is a :class:`~._settings.SlurmSettingsError` naming
``--series``. A Fleet that maps no Series asks every Series as GPUs of any type, on any node of
its partition; one that maps some asks only those (:func:`series_request` is None for others).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

from tuneplane.coordinator.values.fleet import SlurmSeries

from ._settings import SlurmSettingsError

# Series names as Profiles write them, and Slurm's GRES type and node feature names.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_FORM = "SERIES=gres:gpu:TYPE or SERIES=constraint:FEATURE, e.g. h200=gres:gpu:h200"


def _refuse(value: str, why: str) -> SlurmSettingsError:
    return SlurmSettingsError(f"--series {value!r} {why}; give {_FORM}.")


def parse_series(values: Sequence[str]) -> tuple[SlurmSeries, ...]:
    """The mappings ``--series`` gave, one per Series, sorted by Series."""
    found: dict[str, SlurmSeries] = {}
    for value in values:
        series, sep, how = value.partition("=")
        if not sep or not _NAME.match(series):
            raise _refuse(value, "does not start with a Series name and '='")
        kind, _, what = how.partition(":")
        mapped = found.get(series, SlurmSeries(series))
        if kind == "gres":
            name, _, gres_type = what.partition(":")
            if name != "gpu" or not _NAME.match(gres_type):
                raise _refuse(value, "does not name a gpu GRES type")
            if mapped.gres_type:
                raise _refuse(value, f"maps the Series {series!r} to a second GRES type")
            mapped = attrs.evolve(mapped, gres_type=gres_type)
        elif kind == "constraint":
            if not _NAME.match(what):
                raise _refuse(value, "does not name one node feature")
            if mapped.constraint:
                raise _refuse(value, f"gives the Series {series!r} a second node feature")
            mapped = attrs.evolve(mapped, constraint=what)
        else:
            raise _refuse(value, "maps to neither gres: nor constraint:")
        found[series] = mapped
    return tuple(found[name] for name in sorted(found))


def series_request(mapped: Sequence[SlurmSeries], series: str) -> SlurmSeries | None:
    """How a Job of ``series`` asks Slurm: its mapping; any GPU when the Fleet maps none; None
    when the Fleet maps others and not this one (a Preview of it is refused)."""
    if not mapped:
        return SlurmSeries(series)
    return next((m for m in mapped if m.series == series), None)


def series_words(mapped: SlurmSeries) -> str:
    """A mapping as ``tp fleet show`` and the decision log say it."""
    parts = [f"gres gpu:{mapped.gres_type}"] if mapped.gres_type else []
    parts += [f"constraint {mapped.constraint}"] if mapped.constraint else []
    return ", ".join(parts) or "any GPU"
