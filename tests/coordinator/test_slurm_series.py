"""Series mappings of a Fleet of kind slurm: ``--series`` read, refused with a sentence naming
the flag, and the request a Job of each Series makes (pure, tests/integration/test_slurm_series.py
runs them on the real Slurm)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.coordinator.executors.slurm import (
    SlurmSettingsError,
    parse_series,
    series_request,
    series_words,
)
from tuneplane.coordinator.executors.slurm._v0038 import submit_body
from tuneplane.coordinator.slurm_attempt import job_request
from tuneplane.coordinator.values.fleet import SlurmSeries

pytestmark = pytest.mark.timeout(60)

NAMES = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,10}", fullmatch=True)


def test_gres_and_constraint_of_one_series_combine() -> None:
    assert parse_series(["h200=gres:gpu:h200", "h100=constraint:ib", "h200=constraint:nvl"]) == (
        SlurmSeries("h100", "", "ib"),
        SlurmSeries("h200", "h200", "nvl"),
    )


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("h200", "does not start with a Series name and '='"),
        ("=gres:gpu:h200", "does not start with a Series name and '='"),
        ("h200=gpu:h200", "maps to neither gres: nor constraint:"),
        ("h200=gres:h200", "does not name a gpu GRES type"),
        ("h200=gres:gpu:", "does not name a gpu GRES type"),
        ("h200=gres:nic:cx7", "does not name a gpu GRES type"),
        ("h200=constraint:a&b", "does not name one node feature"),
        ("h200=constraint:", "does not name one node feature"),
    ],
)
def test_a_malformed_mapping_is_refused_naming_the_flag(value: str, why: str) -> None:
    with pytest.raises(SlurmSettingsError) as refused:
        parse_series([value])
    assert str(refused.value).startswith(f"--series {value!r} {why}; give SERIES=gres:gpu:TYPE")


def test_a_series_mapped_twice_the_same_way_is_refused() -> None:
    with pytest.raises(SlurmSettingsError, match="to a second GRES type"):
        parse_series(["h200=gres:gpu:h200", "h200=gres:gpu:b200"])
    with pytest.raises(SlurmSettingsError, match="a second node feature"):
        parse_series(["h200=constraint:a", "h200=constraint:b"])


@given(st.dictionaries(NAMES, st.tuples(st.none() | NAMES, st.none() | NAMES)), NAMES)
def test_every_series_asks_for_its_mapping_or_is_refused(
    mapping: dict[str, tuple[str | None, str | None]], asked: str
) -> None:
    values = [f"{s}=gres:gpu:{g}" for s, (g, _) in mapping.items() if g]
    values += [f"{s}=constraint:{c}" for s, (_, c) in mapping.items() if c]
    mapped = parse_series(values)
    named = {m.series for m in mapped}
    assert [m.series for m in mapped] == sorted(named)
    found = series_request(mapped, asked)
    if not mapped:
        assert found == SlurmSeries(asked)
    elif asked not in named:
        assert found is None
    else:
        gres, constraint = mapping[asked]
        assert found == SlurmSeries(asked, gres or "", constraint or "")
        assert series_words(found) != "any GPU"


def test_the_job_request_asks_for_the_typed_gres_and_the_feature() -> None:
    request = job_request("r1", 1, "tp", "python3", Path("/s/r1/attempt-1"), 2, 4, "h200", "ib")
    job = submit_body(request)["job"]
    assert (job["gpus_per_node"], job["constraints"], job["nodes"]) == ("h200:4", "ib", 2)
    plain = submit_body(job_request("r1", 1, "tp", "python3", Path("/s"), 1, 2))["job"]
    assert plain["gpus_per_node"] == "2" and "constraints" not in plain
    no_gpus = submit_body(job_request("r1", 1, "tp", "python3", Path("/s"), 1, 0, "h200"))["job"]
    assert "gpus_per_node" not in no_gpus
