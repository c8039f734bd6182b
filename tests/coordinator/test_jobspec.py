"""The JobSpec digest: the same intent always has the same digest, any edit changes it."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.proto.contract import jobspec

BASE: dict[str, Any] = {
    "api_version": "tuneplane/v1",
    "project": "demo",
    "experiment": "hello",
    "method_id": "custom/custom",
    "recipe_digest": "sha256:" + "0" * 64,
    "runtime_id": "host:bash",
    "entrypoint": ["bash", "train.sh"],
    "resources": {"profile": "h200:2", "series": "", "gpus": 2},
    "parameters": {"steps": 10, "lr": 0.5},
    "env": {"SEED": "1"},
    "grace_period_s": 30,
    "source_files": {"train.sh": "ZWNobyBoaQo="},
}


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON with every object's keys in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


@given(st.randoms(use_true_random=False))
def test_key_order_and_whitespace_do_not_change_the_digest(rng: random.Random) -> None:
    text = json.dumps(_shuffled(BASE, rng), indent=rng.choice([None, 1, 4]))
    assert jobspec.digest(jobspec.loads(text)) == jobspec.digest(jobspec.parse(BASE))


def _edits() -> list[tuple[str, Any]]:
    return [
        ("project", "demo2"),
        ("experiment", "hello2"),
        ("method_id", "pytorch/process-group"),
        ("recipe_digest", "sha256:" + "1" * 64),
        ("runtime_id", "host:python3"),
        ("entrypoint", ["bash", "other.sh"]),
        ("resources.gpus", 4),
        ("resources.profile", "h200-2g"),
        ("parameters.steps", 11),
        ("parameters.lr", 0.25),
        ("env.SEED", "2"),
        ("grace_period_s", 31),
        ("init_from", "run-0123456789ab"),
        ("source_files.train.sh", "ZWNobyBobwo="),
    ]


@pytest.mark.parametrize(("path", "value"), _edits())
def test_any_edit_changes_the_digest(path: str, value: Any) -> None:
    edited = copy.deepcopy(BASE)
    head, _, rest = path.partition(".")
    if rest:
        edited[head][rest] = value
    else:
        edited[head] = value
    assert jobspec.digest(jobspec.parse(edited)) != jobspec.digest(jobspec.parse(BASE))


def test_digest_is_sha256_of_the_canonical_json() -> None:
    spec = jobspec.parse(BASE)
    text = jobspec.canonical_json(spec)
    assert " " not in text.replace('"bash train.sh"', "")
    assert jobspec.loads(text) == spec
    assert jobspec.digest(spec).startswith("sha256:") and len(jobspec.digest(spec)) == 71


@pytest.mark.parametrize(
    ("change", "field", "why"),
    [
        ({"resources": {"profile": "h200", "series": "", "gpus": "2"}}, "resources.gpus", "int"),
        ({"entrypoint": ["bash", 3]}, "entrypoint[1]", "str"),
        ({"colour": "red"}, "colour", "is not a JobSpec field"),
        ({"resources": {"profile": "h200", "series": "", "gpus": 33, "members": 33}},
         "resources.members", "1 to 32"),
        ({"env": {"TUNEPLANE_OUT_DIR": "/x"}}, "env.TUNEPLANE_OUT_DIR", "reserved"),
        ({"source_files": {"../escape": "eA=="}}, "source_files.../escape", "relative path"),
        ({"grace_period_s": 7200}, "grace_period_s", "3600"),
    ],
)  # fmt: skip
def test_errors_name_the_field_and_why(change: dict[str, Any], field: str, why: str) -> None:
    with pytest.raises(jobspec.JobSpecError) as caught:
        jobspec.parse({**BASE, **change})
    assert caught.value.field == field
    assert why in str(caught.value)
    assert str(caught.value).startswith(f"JobSpec field '{field}'")


def test_text_that_is_not_json_is_a_jobspec_error() -> None:
    with pytest.raises(jobspec.JobSpecError, match="is not JSON"):
        jobspec.loads("{not json")
