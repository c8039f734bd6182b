"""Parameter passing: how a recipe declares it, how values become argv and TUNEPLANE_PARAM_*
text, and how Preview stores the result in the resolved JobSpec (and refuses a missing script)."""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.coordinator.grpc_client import jobspec
from tuneplane.coordinator import capsule
from tuneplane.coordinator.admission import resolve
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.cli.render_launch import launch_json, launch_rows
from tuneplane.coordinator.config import DEFAULT_CONFIG, parse_config
from tuneplane.coordinator.parameters import (
    ParameterError,
    Passing,
    RecipeError,
    env_name,
    passing_of,
    render,
    value_text,
)
from tuneplane.proto.contract import jobspec as js

CONFIG = parse_config(DEFAULT_CONFIG, Path("coordinator.toml"))
CATALOGUE = Catalogue.bundled()
PARAMS: dict[str, dict[str, Any]] = {
    "steps": {"type": "int"},
    "learning_rate": {"type": "float"},
    "shuffle": {"type": "bool"},
    "note": {"type": "str", "flag": "--note-text"},
    "lora.rank": {"type": "int"},
}


def _passing(argv: list[str], env: object = "all") -> Passing:
    return passing_of("test/method", {"argv": argv, "env": env}, PARAMS)


@pytest.mark.parametrize(
    ("kind", "value", "text"),
    [
        ("int", 100, "100"),
        ("int", -3, "-3"),
        ("float", 0.001, "0.001"),
        ("float", 1e-05, "1e-05"),
        ("float", 3, "3.0"),  # an int given for a float parameter is written as a float
        ("float", 2.5e-4, "0.00025"),
        ("bool", True, "true"),
        ("bool", False, "false"),
        ("str", "a b 'c' $HOME\nd", "a b 'c' $HOME\nd"),  # argv and env need no quoting
        ("str", "", ""),
    ],
)
def test_values_are_written_by_type(kind: str, value: object, text: str) -> None:
    assert value_text(kind, value) == text


@pytest.mark.parametrize(("kind", "value"), [("int", True), ("int", 1.5), ("bool", 1), ("str", 1)])
def test_a_value_of_the_wrong_type_is_refused(kind: str, value: object) -> None:
    with pytest.raises(TypeError):
        value_text(kind, value)


def test_flags_follow_the_declared_order_not_the_values_order() -> None:
    passing = _passing(["steps", "note", "learning_rate"])
    values = {"learning_rate": 0.5, "note": "hi there", "steps": 7}
    assert render(passing, values).argv == (
        "--steps", "7", "--note-text", "hi there", "--learning_rate", "0.5",
    )  # fmt: skip


def test_variables_are_upper_case_with_other_characters_as_underscores() -> None:
    assert env_name("learning_rate") == "TUNEPLANE_PARAM_LEARNING_RATE"
    assert env_name("lora.rank") == "TUNEPLANE_PARAM_LORA_RANK"
    assert env_name("max-len") == "TUNEPLANE_PARAM_MAX_LEN"
    rendered = render(_passing([]), {"lora.rank": 8, "shuffle": True})
    assert rendered.env == {"TUNEPLANE_PARAM_LORA_RANK": "8", "TUNEPLANE_PARAM_SHUFFLE": "true"}
    assert rendered.argv == ()


def test_an_absent_parameter_is_in_neither_argv_nor_env() -> None:
    passing = _passing(["steps", "learning_rate"])
    rendered = render(passing, {"learning_rate": 0.1, "steps": None})
    assert rendered.argv == ("--learning_rate", "0.1")
    assert rendered.env == {"TUNEPLANE_PARAM_LEARNING_RATE": "0.1"}


def test_env_can_name_only_some_parameters() -> None:
    rendered = render(_passing(["steps"], ["learning_rate"]), {"steps": 1, "learning_rate": 2.0})
    assert rendered.argv == ("--steps", "1")
    assert rendered.env == {"TUNEPLANE_PARAM_LEARNING_RATE": "2.0"}


def test_a_value_too_long_to_pass_is_refused_naming_the_parameter() -> None:
    with pytest.raises(ParameterError, match="parameter 'note' is 40000 characters long"):
        render(_passing(["note"]), {"note": "x" * 40000})


@pytest.mark.parametrize(
    ("raw", "params", "says"),
    [
        (None, PARAMS, "has parameters but no 'pass_parameters'"),
        ({"argv": ["epochs"]}, PARAMS, "names 'epochs', which is not one of its parameters"),
        ({"env": "some"}, PARAMS, 'must be a list of parameter names or "all"'),
        ({"argv": ["steps", "steps"]}, PARAMS, "names a parameter twice"),
        ({"argv": [], "files": []}, PARAMS, "only 'argv' and 'env'"),
        ({"argv": ["steps"]}, {"steps": {"type": "int", "flag": "steps"}}, "has flag 'steps'"),
        ({"env": "all"}, {"a-b": {"type": "int"}, "a_b": {"type": "int"}}, "would both be"),
        ({"env": "all"}, {"n": {"type": "list"}}, "has type 'list'"),
    ],
)
def test_a_wrong_declaration_is_refused_with_a_sentence(
    raw: object, params: dict[str, dict[str, Any]], says: str
) -> None:
    with pytest.raises(RecipeError, match="Recipe test/method") as err:
        passing_of("test/method", raw, params)
    assert says in str(err.value)


def test_every_bundled_parameter_reaches_the_workload() -> None:
    for recipe in CATALOGUE:
        passed = {name for name, _ in recipe.passing.argv} | set(recipe.passing.env)
        assert passed == set(recipe.parameters), recipe.method_id
    pg = CATALOGUE.recipes["pytorch/process-group"]
    assert pg.passing.argv == (("steps", "--steps"), ("learning_rate", "--learning_rate"))


# -- Preview: the resolved JobSpec carries what every rank runs --------------------------------


def _pg(**parameters: object) -> dict[str, Any]:
    spec = jobspec(method_id="pytorch/process-group", gpus=1)
    spec["entrypoint"] = ["python3", str(parameters.get("script", "train.py"))]
    spec["source_files"] = {
        "train.py": base64.b64encode(b"print(1)\n").decode(),
        "data/prep.py": base64.b64encode(b"\n").decode(),
    }
    spec["parameters"] = parameters
    return spec


def test_preview_stores_the_command_and_variables_in_the_resolved_jobspec() -> None:
    resolved = resolve(js.parse(_pg(steps=7, learning_rate=0.25)), CONFIG, CATALOGUE).spec
    assert resolved.command == ("python3", "train.py", "--steps", "7", "--learning_rate", "0.25")
    assert resolved.parameter_env == {
        "TUNEPLANE_PARAM_LEARNING_RATE": "0.25",
        "TUNEPLANE_PARAM_SCRIPT": "train.py",
        "TUNEPLANE_PARAM_STEPS": "7",
    }
    # Canonical JSON round-trips them, the digest covers them, and the capsule runs them.
    text = js.canonical_json(resolved)
    assert js.loads(text) == resolved
    other = resolve(js.parse(_pg(steps=8, learning_rate=0.25)), CONFIG, CATALOGUE).spec
    assert js.digest(other) != js.digest(resolved)
    sealed = json.loads(capsule.seal(resolved, "process-group", "run-1", 1, 1)["capsule.json"])
    assert sealed["entrypoint"] == list(resolved.command)
    # The preview shows exactly what the resolved JobSpec says.
    assert launch_json(text) == {
        "command": list(resolved.command),
        "env": dict(sorted(resolved.parameter_env.items())),
    }
    rows = dict(launch_rows(text))
    assert rows["Command"] == "python3 train.py --steps 7 --learning_rate 0.25"


def test_a_jobspec_without_them_keeps_its_json_and_runs_its_entrypoint() -> None:
    spec = js.parse(jobspec())
    assert "command" not in js.to_json_obj(spec)
    assert "parameter_env" not in js.to_json_obj(spec)
    sealed = json.loads(capsule.seal(spec, "member", "run-1", 1, 1)["capsule.json"])
    assert sealed["entrypoint"] == ["bash", "train.sh"]


@pytest.mark.parametrize("field", ["command", "parameter_env"])
def test_an_intent_that_sets_them_is_refused(field: str) -> None:
    spec = _pg()
    spec[field] = ["python3", "evil.py"] if field == "command" else {"TUNEPLANE_PARAM_X": "1"}
    with pytest.raises(js.JobSpecError) as err:
        resolve(js.parse(spec), CONFIG, CATALOGUE)
    assert err.value.field == field
    assert "computed by the coordinator at Preview" in str(err.value)


@pytest.mark.parametrize("name", ["TUNEPLANE_OUT_DIR", "LD_PRELOAD", "TUNEPLANE_PARAM_lower"])
def test_parameter_env_holds_only_tuneplane_param_names(name: str) -> None:
    spec = jobspec()
    spec["parameter_env"] = {name: "1"}
    with pytest.raises(js.JobSpecError) as err:
        js.parse(spec)
    assert err.value.field == f"parameter_env.{name}"


def test_a_misspelled_script_is_refused_naming_the_closest_file() -> None:
    with pytest.raises(js.JobSpecError) as err:
        resolve(js.parse(_pg(script="trian.py")), CONFIG, CATALOGUE)
    assert err.value.field == "parameters.script"
    assert "is not a file of experiment 'hello'" in str(err.value)
    assert "Did you mean 'train.py'?" in str(err.value)


def test_a_script_far_from_every_file_lists_the_files() -> None:
    with pytest.raises(js.JobSpecError) as err:
        resolve(js.parse(_pg(script="zzz.py")), CONFIG, CATALOGUE)
    assert "Its files are: data/prep.py, train.py." in str(err.value)


def test_a_script_in_a_folder_of_the_experiment_is_accepted() -> None:
    resolved = resolve(js.parse(_pg(script="./data/prep.py")), CONFIG, CATALOGUE).spec
    assert resolved.command[:2] == ("python3", "./data/prep.py")


def test_an_entrypoint_not_from_the_parameter_names_the_entrypoint() -> None:
    spec = _pg()
    spec["entrypoint"] = ["python3", "trainer.py"]
    with pytest.raises(js.JobSpecError) as err:
        resolve(js.parse(spec), CONFIG, CATALOGUE)
    assert err.value.field == "entrypoint[1]"
    assert "Did you mean 'train.py'?" in str(err.value)


def test_a_custom_job_without_its_train_sh_is_refused_at_preview() -> None:
    """custom/custom runs the experiment's train.sh: an experiment whose script is named
    otherwise is refused before it can take a GPU, naming the closest file."""
    spec = jobspec()
    spec["source_files"] = {"trian.sh": spec["source_files"]["train.sh"]}
    with pytest.raises(js.JobSpecError) as err:
        resolve(js.parse(spec), CONFIG, CATALOGUE)
    assert err.value.field == "entrypoint[1]"
    assert "'train.sh': is not a file of experiment 'hello'" in str(err.value)
    assert (
        "Did you mean 'trian.sh'? The recipe custom/custom runs 'train.sh': add it to the "
        "experiment or rename yours and preview again." in str(err.value)
    )


# -- what the workload reads back ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    steps=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    rate=st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**53), 2**53),
    note=st.text(alphabet=st.characters(exclude_characters="\x00", exclude_categories=["Cs"])),
    shuffle=st.booleans(),
)
def test_argparse_reads_back_exactly_the_values_sent(
    steps: int, rate: float, note: str, shuffle: bool
) -> None:
    passing = _passing(["steps", "learning_rate", "note", "shuffle"])
    values = {"steps": steps, "learning_rate": rate, "note": note, "shuffle": shuffle}
    rendered = render(passing, values)
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int)
    parser.add_argument("--learning_rate", type=float)
    parser.add_argument("--note-text", dest="note")
    parser.add_argument("--shuffle", type=lambda text: text == "true")
    # A value that starts with '-' is passed as it is; argparse needs the --flag=value form to
    # take it, which is what a workload's own parser sees in sys.argv either way.
    argv = list(rendered.argv)
    joined = [f"{argv[i]}={argv[i + 1]}" for i in range(0, len(argv), 2)]
    read = parser.parse_args(joined)
    assert (read.steps, read.learning_rate, read.note, read.shuffle) == (
        steps, float(rate), note, shuffle,
    )  # fmt: skip
    # The variables hold the same text as the flags.
    assert rendered.env["TUNEPLANE_PARAM_STEPS"] == argv[argv.index("--steps") + 1]
    assert float(rendered.env["TUNEPLANE_PARAM_LEARNING_RATE"]) == float(rate)
    assert rendered.env["TUNEPLANE_PARAM_NOTE"] == note
