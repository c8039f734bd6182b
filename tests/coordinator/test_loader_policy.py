"""Loader variables are site policy, not JobSpec form: parsing accepts them, the pure policy
check refuses them unless coordinator.toml allows them for the JobSpec's (resolved) runtime."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from tests.coordinator.grpc_client import jobspec
from tuneplane.coordinator.admission import resolve
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.config import DEFAULT_CONFIG, ConfigError, parse_config
from tuneplane.coordinator.jobspec import check_loader_policy
from tuneplane.proto.contract import jobspec as js
from tuneplane.proto.contract.input_checks import InputRefused, check_env, loader_refusal

PATH = Path("/etc/tuneplane/coordinator.toml")
CATALOGUE = Catalogue.bundled()
ALLOW_BASH = '\n[runtimes."host:bash"]\nallow_loader_env = true\n'
LOADERS = ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "DYLD_INSERT_LIBRARIES", "PYTHONPATH",
           "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONEXECUTABLE"]  # fmt: skip


def _spec(env: dict[str, str], **changes: object) -> js.JobSpec:
    raw = jobspec(gpus=0, profile="cpu")
    raw["env"] = env
    raw.update(changes)
    return js.parse(raw)


@pytest.mark.parametrize("name", LOADERS)
def test_parsing_checks_the_form_of_a_loader_variable_not_the_policy(name: str) -> None:
    check_env(name, "/opt/lib")  # form only: a valid name and plain text
    spec = js.loads(json.dumps({**jobspec(gpus=0, profile="cpu"), "env": {name: "/opt/lib"}}))
    assert spec.env == {name: "/opt/lib"}
    # Form is still checked for loader variables as for any other.
    with pytest.raises(InputRefused, match=f"env.{name} contains a NUL"):
        check_env(name, "/opt\x00lib")


@pytest.mark.parametrize("name", LOADERS)
def test_the_policy_refuses_each_loader_variable_unless_allowed(name: str) -> None:
    env = {"SEED": "1", name: "/opt/lib"}
    refused = loader_refusal(env, "host:bash", False, "ask for it")
    assert refused is not None and refused.field == f"env.{name}"
    assert "runtime host:bash does not allow loader variables" in str(refused)
    assert str(refused).endswith("or ask for it.")
    assert loader_refusal(env, "host:bash", True, "ask for it") is None


def test_the_policy_passes_ordinary_variables_and_names_the_first_loader_by_name() -> None:
    assert (
        loader_refusal({"SEED": "1", "LDX": "a", "MY_LD_PATH": "b"}, "host:x", False, "x") is None
    )
    refused = loader_refusal({"PYTHONPATH": "/a", "LD_PRELOAD": "/b"}, "host:x", False, "x")
    assert refused is not None and refused.field == "env.LD_PRELOAD"


def test_check_loader_policy_names_the_variable_the_runtime_and_the_operators_fix() -> None:
    spec = _spec({"LD_PRELOAD": "/tmp/x.so"}, runtime_id="host:python3")
    with pytest.raises(js.JobSpecError) as caught:
        check_loader_policy(spec, frozenset({"host:bash"}))
    assert caught.value.field == "env.LD_PRELOAD"
    assert str(caught.value) == (
        "JobSpec field 'env.LD_PRELOAD' = '/tmp/x.so': is a loader variable: it changes which "
        "libraries or Python modules the workload loads, and the runtime host:python3 does not "
        "allow loader variables. Remove it from the env (put the libraries in the experiment), "
        'or ask the coordinator\'s operator to allow them with [runtimes."host:python3"] '
        "allow_loader_env = true in coordinator.toml (the Node's node.toml must allow them for "
        "that runtime too)."
    )
    check_loader_policy(spec, frozenset({"host:python3"}))
    check_loader_policy(_spec({"SEED": "1"}), frozenset())


def test_a_jobspec_that_names_no_runtime_matches_no_allowance() -> None:
    spec = _spec({"PYTHONPATH": "/a"})
    assert spec.runtime_id == ""
    with pytest.raises(js.JobSpecError, match=r"the runtime \(no runtime named\)"):
        check_loader_policy(spec, frozenset({"host:bash", ""}))


def test_preview_judges_the_resolved_runtime_and_the_whole_env() -> None:
    config = parse_config(DEFAULT_CONFIG + ALLOW_BASH, PATH)
    assert config.loader_env_runtimes == frozenset({"host:bash"})
    # An empty runtime_id is the recipe's runtime: custom/custom runs on host:bash.
    resolved = resolve(_spec({"LD_LIBRARY_PATH": "/opt/lib"}), config, CATALOGUE)
    assert resolved.spec.runtime_id == "host:bash"
    assert resolved.spec.env == {"LD_LIBRARY_PATH": "/opt/lib"}
    # The same env on pytorch/process-group (host:python3) is refused.
    other = jobspec(gpus=0, profile="cpu", method_id="pytorch/process-group")
    other["env"] = {"LD_LIBRARY_PATH": "/opt/lib"}
    with pytest.raises(js.JobSpecError, match=r'runtimes\."host:python3"') as caught:
        resolve(js.parse(other), config, CATALOGUE)
    assert caught.value.field == "env.LD_LIBRARY_PATH"
    # Without a [runtimes] table nothing is allowed, the default coordinator.toml included.
    default = parse_config(DEFAULT_CONFIG, PATH)
    with pytest.raises(js.JobSpecError, match="runtime host:bash does not allow"):
        resolve(_spec({"LD_LIBRARY_PATH": "/opt/lib"}), default, CATALOGUE)
    # A loader variable a Profile's env brings in is judged like the JobSpec's own.
    profiled = DEFAULT_CONFIG.replace(
        '[profiles.cpu]\nseries = "cpu"\n',
        '[profiles.cpu]\nseries = "cpu"\nenv = { LD_AUDIT = "/a" }\n',
    )
    with pytest.raises(js.JobSpecError) as caught:
        resolve(_spec({}), parse_config(profiled, PATH), CATALOGUE)
    assert caught.value.field == "env.LD_AUDIT"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '[runtimes."host:bash"]\nallow_loader_env = "yes"\n',
            "[runtimes.\"host:bash\"] allow_loader_env = 'yes' must be true or false.",
        ),
        (
            '[runtimes."host:bash"]\nallow_loader = true\n',
            '[runtimes."host:bash"] has unknown key(s) allow_loader. Allowed keys are '
            "allow_loader_env.",
        ),
        (
            "[runtimes.python3]\nallow_loader_env = true\n",
            '[runtimes."python3"] does not name a runtime id. Write the id in quotes',
        ),
        ('runtimes = "host:bash"\n', "runtimes must hold tables"),
        ('[runtimes]\n"host:bash" = true\n', 'runtimes."host:bash" must be a table'),
    ],
)
def test_a_bad_runtimes_table_names_the_file_the_key_and_the_fix(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text + DEFAULT_CONFIG, PATH)
    assert str(caught.value).startswith(f"{PATH}: ")
    assert expected in str(caught.value)


def test_allow_loader_env_false_allows_nothing() -> None:
    config = parse_config(DEFAULT_CONFIG + ALLOW_BASH.replace("true", "false"), PATH)
    assert config.loader_env_runtimes == frozenset()
    assert attrs.asdict(config.runtimes["host:bash"]) == {
        "runtime_id": "host:bash",
        "allow_loader_env": False,
    }
