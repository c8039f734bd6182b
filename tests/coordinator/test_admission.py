"""Admission resolves intent against coordinator.toml and the Catalogue, or names the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.coordinator.grpc_client import jobspec
from tuneplane.coordinator.admission import resolve
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.config import DEFAULT_CONFIG, ConfigError, parse_config
from tuneplane.proto.contract import jobspec as js

CONFIG = parse_config(DEFAULT_CONFIG, Path("coordinator.toml"))
CATALOGUE = Catalogue.bundled()


def test_resolution_fills_series_defaults_and_runtime() -> None:
    spec = jobspec(method_id="pytorch/process-group", gpus=4, profile="h200-2g")
    spec["parameters"] = {"steps": 5}
    resolved = resolve(js.parse(spec), CONFIG, CATALOGUE)
    assert resolved.spec.resources.series == "h200"
    assert resolved.spec.resources.gpus_per_member == 2
    assert resolved.spec.runtime_id == "host:python3"
    assert resolved.spec.parameters == {"learning_rate": 0.001, "script": "train.py", "steps": 5}
    assert resolved.summary.members == 2 and resolved.summary.gpus_per_member == 2
    # The digest is of the resolved spec, and resolution is deterministic.
    again = resolve(js.parse(spec), CONFIG, CATALOGUE)
    assert js.digest(resolved.spec) == js.digest(again.spec)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"parameters": {"steps": "5"}}, "parameters.steps"),
        ({"parameters": {"epochs": 1}}, "parameters.epochs"),
        ({"parameters": {"learning_rate": 11.0}}, "parameters.learning_rate"),
    ],
)
def test_parameters_are_checked_against_the_recipe(change: dict[str, object], field: str) -> None:
    spec = jobspec(method_id="pytorch/process-group")
    spec.update(change)
    with pytest.raises(js.JobSpecError) as err:
        resolve(js.parse(spec), CONFIG, CATALOGUE)
    assert err.value.field == field


def test_a_series_that_contradicts_the_profile_is_refused() -> None:
    spec = jobspec()
    spec["resources"]["series"] = "h100"
    with pytest.raises(js.JobSpecError) as err:
        resolve(js.parse(spec), CONFIG, CATALOGUE)
    assert err.value.field == "resources.series"


def test_a_cpu_profile_takes_no_gpus() -> None:
    with pytest.raises(js.JobSpecError) as err:
        resolve(js.parse(jobspec(profile="cpu", gpus=1)), CONFIG, CATALOGUE)
    assert err.value.field == "resources.gpus"
    assert resolve(js.parse(jobspec(profile="cpu", gpus=0)), CONFIG, CATALOGUE).summary


def test_config_errors_name_the_file_and_key() -> None:
    with pytest.raises(ConfigError, match=r"x\.toml: \[profiles\.p\] series = 'nope' names no"):
        parse_config('[profiles.p]\nseries = "nope"\n', Path("x.toml"))
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config(
            '[series.s]\ncard_memory_gib = 1\nscheduling_pin = "s"\ncards = 0\n'
            "accelerator = true\ncolour = 1\n",
            Path("x.toml"),
        )
