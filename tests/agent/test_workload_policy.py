"""The workload policy as pure parts: node.toml's [accounts], [runtimes.*] and isolation, the
allow-listed environment, the loader-variable refusal, the pool choice and the bwrap command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import accounts as test_accounts
from tuneplane.agent import accounts, config, sandbox, workload_checks
from tuneplane.agent.image_store import default_image_root
from tuneplane.agent.inventory import Gpu
from tuneplane.agent.launch_plan import (
    refused_loader_variable,
    resolve_entrypoint,
    workload_env,
)


def _load(tmp_path: Path, text: str) -> config.WorkloadPolicy:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return config.workload_policy(config.load(path), path, euid=0)


def test_a_pool_by_names_or_by_prefix_and_count(tmp_path: Path) -> None:
    named = _load(tmp_path, '[accounts]\nmode = "pool"\npool = ["tp-a", "tp-b"]\n')
    assert (named.mode, named.pool, named.isolation) == ("pool", ("tp-a", "tp-b"), "none")
    counted = _load(tmp_path, '[accounts]\nmode = "pool"\nprefix = "tp-m"\ncount = 3\n')
    assert counted.pool == ("tp-m0", "tp-m1", "tp-m2") and not counted.defaulted


def test_without_accounts_root_gets_the_default_pool_and_others_run_as_themselves() -> None:
    as_root = config.workload_policy({}, None, euid=0)
    assert as_root.mode == "pool" and as_root.defaulted
    assert as_root.pool[0] == "tuneplane-member-0" and len(as_root.pool) == 8
    assert config.workload_policy({}, None, euid=1000).mode == "agent"


def test_a_root_agent_refuses_the_agent_mode_and_a_user_agent_refuses_pools() -> None:
    agent_mode = config.WorkloadPolicy("agent")
    assert "would run every workload as root" in (agent_mode.problem_running_as(0) or "")
    assert agent_mode.problem_running_as(1000) is None
    pool = config.WorkloadPolicy("pool", ("tp-a",))
    assert "needs the agent to run as root" in (pool.problem_running_as(1000) or "")
    assert pool.problem_running_as(0) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[accounts]\nmode = "everyone"\n', "'accounts.mode' is 'everyone'"),
        ('[accounts]\nmode = "pool"\n', 'mode = "pool" needs the accounts'),
        ('[accounts]\nmode = "pool"\npool = ["root"]\n', "never root"),
        ('[accounts]\nmode = "pool"\npool = ["a", "a"]\n', "more than once"),
        ('[accounts]\nmode = "pool"\nprefix = "a"\n', "needs both 'prefix' and 'count'"),
        ('[accounts]\nmode = "pool"\npool = ["a"]\nprefix = "b"\ncount = 1\n', "keep one way"),
        ('[accounts]\nmode = "agent"\npool = ["a"]\n', 'mode is "agent"'),
        ('[accounts]\nmode = "pool"\npool = "a"\n', "'accounts.pool' must be a list"),
        ('[accounts]\nmode = "pool"\npools = ["a"]\n', "unknown key 'accounts.pools'"),
        ('isolation = "docker"\n', "'isolation' is 'docker'"),
        ("accounts = 3\n", "'accounts' must be a table"),
        ('[runtimes.python3]\npath = "/usr/bin"\n', "has no 'interpreter'"),
        ('[runtimes.python3]\npath = "bin"\ninterpreter = "/usr/bin/python3"\n', "not absolute"),
        ('[runtimes.python3]\npath = "/usr/bin"\ninterpreter = "python3"\n', "absolute path"),
        (
            '[runtimes.python3]\npath = "/b"\ninterpreter = "/b/p"\nallow_loader_env = "yes"\n',
            "'runtimes.python3.allow_loader_env' must be true or false",
        ),
    ],
)
def test_bad_policies_are_refused_with_the_key_named(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(config.NodeConfigError, match=r"node\.toml") as caught:
        config.load(path)
    assert expected in str(caught.value)


def test_the_cli_refuses_a_bad_policy_with_its_sentence(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('isolation = "docker"\n')
    done = subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.cli", "--config", str(path), "doctor"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and "'isolation' is 'docker'" in done.stderr


def test_runtimes_come_from_node_toml_or_the_documented_default(tmp_path: Path) -> None:
    policy = _load(
        tmp_path,
        '[runtimes.python3]\npath = "/opt/py/bin:/usr/bin"\ninterpreter = "/opt/py/bin/python3"\n'
        "allow_loader_env = true\n",
    )
    chosen = policy.runtime("python3")
    assert (chosen.path, chosen.interpreter, chosen.allow_loader_env) == (
        "/opt/py/bin:/usr/bin", "/opt/py/bin/python3", True,
    )  # fmt: skip
    fallback = policy.runtime("bash")
    assert fallback.path == config.DEFAULT_RUNTIME_PATH and not fallback.configured
    assert fallback.interpreter in ("/usr/local/bin/bash", "/usr/bin/bash", "/bin/bash")
    assert not fallback.allow_loader_env


def test_the_environment_is_an_allow_list_where_tuneplane_wins() -> None:
    env = workload_env(
        {"SEED": "1", "PATH": "/evil", "HOME": "/root", "LANG": "de_DE.UTF-8"},
        {"TUNEPLANE_RUN_ID": "r-1"},
        "/usr/bin:/bin",
        "/work/r-1.1.0",
    )
    assert env == {
        "SEED": "1", "PATH": "/usr/bin:/bin", "HOME": "/work/r-1.1.0", "LANG": "de_DE.UTF-8",
        "TUNEPLANE_RUN_ID": "r-1",
    }  # fmt: skip
    assert workload_env({}, {}, "/bin", "/w")["LANG"] == "C.UTF-8"


@pytest.mark.parametrize(
    "name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "LD_AUDIT", "PYTHONHOME"]
)
def test_loader_variables_are_refused_unless_the_runtime_allows_them(name: str) -> None:
    refused = refused_loader_variable({"SEED": "1", name: "/x"}, "python3", allow_loader_env=False)
    assert refused == (
        f"The Job's env.{name} is a loader variable: it changes which libraries or Python "
        "modules the workload loads, and the runtime host:python3 does not allow loader "
        "variables. Remove it from the env (put the libraries in the experiment), or ask this "
        "Node's operator to set allow_loader_env = true under [runtimes.python3] in node.toml."
    )
    assert refused_loader_variable({name: "/x"}, "python3", allow_loader_env=True) is None
    assert refused_loader_variable({"SEED": "1"}, "python3", allow_loader_env=False) is None


def test_the_runtime_name_in_the_entrypoint_becomes_its_interpreter() -> None:
    assert resolve_entrypoint(("python3", "train.py"), "python3", "/opt/py/bin/python3") == (
        "/opt/py/bin/python3", "train.py",
    )  # fmt: skip
    assert resolve_entrypoint(("bash", "train.sh"), "python3", "/x") == ("bash", "train.sh")


def test_the_pool_gives_each_live_member_its_own_account() -> None:
    pool = ("a", "b", "c")
    assert accounts.choose_pool_account(pool, set()) == "a"
    assert accounts.choose_pool_account(pool, {"a", "c"}) == "b"
    assert accounts.choose_pool_account(pool, {"a", "b", "c"}) is None


def test_an_exhausted_pool_and_a_missing_account_are_sentences(tmp_path: Path) -> None:
    policy = config.WorkloadPolicy("pool", ("tp-a", "tp-b"))
    with pytest.raises(accounts.AccountError, match="Every account of this Node's pool"):
        accounts.lease_for(policy, {"tp-a", "tp-b"}, tmp_path)
    missing = config.WorkloadPolicy("pool", ("tuneplane-no-such-account-x",))
    with pytest.raises(accounts.AccountError, match="useradd --system --no-create-home"):
        accounts.lease_for(missing, set(), tmp_path)
    with pytest.raises(accounts.AccountError, match="never runs with uid or gid 0"):
        accounts.lookup("root")


def test_user_mode_runs_as_the_submitters_account_or_refuses_with_a_sentence(
    tmp_path: Path,
) -> None:
    policy = _load(tmp_path, '[accounts]\nmode = "user"\n')
    assert policy.mode == "user" and policy.pool == ()
    with pytest.raises(accounts.AccountError, match="names no submitting user"):
        accounts.lease_for(policy, set(), tmp_path, "")
    with pytest.raises(accounts.AccountError, match="not a valid local account name"):
        accounts.lease_for(policy, set(), tmp_path, "Alice Smith")
    with pytest.raises(accounts.AccountError, match="has no local account on this Node"):
        accounts.lease_for(policy, set(), tmp_path, "tuneplane-nobody-here")
    with pytest.raises(accounts.AccountError, match="never runs with uid or gid 0"):
        accounts.lease_for(policy, set(), tmp_path, "root")
    lease = accounts.lease_for(policy, set(), tmp_path, "nobody")
    assert (lease.mode, lease.account.name, lease.switches_user) == ("user", "nobody", True)


def test_a_lease_survives_a_restart_as_its_file(tmp_path: Path) -> None:
    lease = accounts.Lease(accounts.Account("tp-a", 1234, 1235, (20,)), "pool", tmp_path / "w")
    accounts.write_lease(tmp_path / "m", lease)
    assert accounts.read_lease(tmp_path / "m") == lease
    assert (tmp_path / "m" / accounts.LEASE_FILE).stat().st_mode & 0o777 == 0o600
    assert accounts.read_lease(tmp_path / "none") is None
    (tmp_path / "m" / accounts.LEASE_FILE).write_text("{")
    with pytest.raises(accounts.AccountError, match="cannot be read"):
        accounts.read_lease(tmp_path / "m")


def test_the_sandbox_hides_the_node_and_binds_only_the_members_own_folders() -> None:
    argv = sandbox.bwrap_argv(
        state_dir=Path("/var/lib/tuneplane-node"),
        work_root=Path("/var/lib/tuneplane-work"),
        out_root=Path("/data/out"),
        work_dir=Path("/var/lib/tuneplane-work/r-1.1.0"),
        out_dir=Path("/data/out/r-1/attempt-1/member-0"),
        devices=("/dev/nvidia1", "/dev/nvidiactl"),
    )
    text = " ".join(argv)
    assert argv[0] == sandbox.BWRAP and argv[-3:] == ("--", *sandbox.RESET_SIGTERM)
    assert "--ro-bind / /" in text and "--tmpfs /tmp" in text and "--dev /dev" in text
    for hidden in ("/var/lib/tuneplane-node", "/var/lib/tuneplane-work", "/data/out"):
        assert f"--tmpfs {hidden} " in text
    assert "--bind /var/lib/tuneplane-work/r-1.1.0 /var/lib/tuneplane-work/r-1.1.0" in text
    assert "--bind /data/out/r-1/attempt-1/member-0 /data/out/r-1/attempt-1/member-0" in text
    assert "--dev-bind /dev/nvidia1 /dev/nvidia1" in text and "/dev/nvidia0" not in text
    assert "--die-with-parent" not in argv and "--new-session" not in argv
    # Binds come after the tmpfs that hides their roots, or the tmpfs would cover them.
    assert text.index("--tmpfs /var/lib/tuneplane-work ") < text.index("--bind /var/lib")


def _gpu(index: int, minor: int | None) -> Gpu:
    return Gpu(index, f"GPU-{index}", "NVIDIA H200", "h200", 1, False, True, minor_number=minor)


def test_only_the_members_own_gpu_device_nodes_are_passed() -> None:
    present = {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm"}
    assert sandbox.gpu_devices([_gpu(1, 1)], present) == (
        "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
    )  # fmt: skip
    # The node is the card's minor number, which the driver may number apart from the index.
    assert sandbox.gpu_devices([_gpu(1, 3)], present)[0] == "/dev/nvidia3"
    assert sandbox.gpu_devices([_gpu(0, None)], present)[0] == "/dev/nvidia0"  # simulated
    assert sandbox.gpu_devices([], present) == ()
    assert sandbox.gpu_devices([_gpu(3, 3)], set()) == ()


def test_start_problems_refuse_root_members_and_roots_inside_the_state_dir(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    pool = config.WorkloadPolicy("pool", ("tp-a",))
    inside = workload_checks.start_problems(pool, state, state / "work", tmp_path / "out")
    assert len(inside) == (1 if os.geteuid() == 0 else 2)
    assert "--work-root" in inside[-1] and "inside the state directory" in inside[-1]
    beside = workload_checks.start_problems(pool, state, tmp_path / "work", tmp_path / "out")
    assert beside == ([] if os.geteuid() == 0 else [pool.problem_running_as(os.geteuid())])
    # The image cache too: a member's sandbox must reach its image's root.
    images = workload_checks.start_problems(
        pool, state, tmp_path / "work", tmp_path / "out", state / "images"
    )
    assert "--image-root" in images[-1] and "inside the state directory" in images[-1]
    assert default_image_root(state) == tmp_path / "tuneplane-images"
    assert workload_checks.warnings(pool) == []
    (warning,) = workload_checks.warnings(config.WorkloadPolicy("agent"))
    assert "members run as the agent's own user" in warning


def test_doctor_shows_the_policy_and_fails_on_what_would_be_unsafe(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        '[accounts]\nmode = "agent"\n[runtimes.python3]\npath = "/usr/bin"\n'
        'interpreter = "/nonexistent/python3"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.cli", "--config", str(path), "doctor",
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert any(line.startswith("warn  members run as the agent's own user") for line in lines)
    assert any(
        line.startswith("FAIL  runtime host:python3 (node.toml): interpreter /nonexistent/python3")
        for line in lines
    )
    if os.geteuid() == 0:
        assert any("would run every workload as root" in line for line in lines)


def test_doctor_runs_bubblewrap_when_the_sandbox_is_configured(tmp_path: Path) -> None:
    test_accounts.require(
        shutil.which("bwrap") is not None, "bubblewrap (apt-get install bubblewrap)"
    )
    path = tmp_path / "node.toml"
    mode = '[accounts]\nmode = "pool"\npool = ["nobody"]\n' if os.geteuid() == 0 else ""
    path.write_text('isolation = "bwrap"\n' + mode)
    done = subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.cli", "--config", str(path), "doctor",
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert f"ok    bubblewrap sandbox works ({sandbox.BWRAP})" in done.stdout.splitlines()
