"""What ``run``, ``status`` and ``doctor`` say about the workload policy (accounts, runtimes,
bubblewrap, where members' files live).

Rules: ``run`` refuses to start on a policy that would run workloads as root or put their files
inside the state directory (:func:`start_problems`); ``status`` and ``doctor`` print the same
findings as warnings or failures, each a sentence with the fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from . import accounts, sandbox
from .config import WorkloadPolicy, workload_policy

BWRAP_CHECK_TIMEOUT_S = 20.0
VERSION_LIMIT_S = 10.0


@attrs.frozen
class Finding:
    """One line of ``doctor``: ``level`` is ``ok``, ``warn`` or ``FAIL``."""

    level: str
    text: str


def default_out_root(state_dir: Path) -> Path:
    """``$TUNEPLANE_OUT_DIR``'s root when none is set: beside the state dir, never inside it."""
    return state_dir.parent / "tuneplane-outputs"


def default_work_root(state_dir: Path) -> Path:
    """Where members' work directories live when none is set: beside the state dir."""
    return state_dir.parent / "tuneplane-work"


def policy_from(settings: Mapping[str, Any] | None, path: Path | None) -> WorkloadPolicy:
    """The policy node.toml (already checked by ``config.load``) sets for this agent's user."""
    return workload_policy(settings or {}, path, os.geteuid())


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def start_problems(
    policy: WorkloadPolicy,
    state_dir: Path,
    work_root: Path,
    out_root: Path,
    image_root: Path | None = None,
) -> list[str]:
    """Sentences for why the agent must not start with this policy (empty: it may)."""
    problems = []
    running_as = policy.problem_running_as(os.geteuid())
    if running_as:
        problems.append(running_as)
    if policy.mode != "agent":
        roots = [("--work-root", work_root), ("--out-root", out_root)]
        if image_root is not None:
            roots.append(("--image-root", image_root))
        for name, root in roots:
            if _inside(root, state_dir):
                problems.append(
                    f"{name} {root} is inside the state directory {state_dir}, which members "
                    f"must never reach; put it beside it, e.g. {state_dir.parent / root.name}."
                )
    return problems


def warnings(policy: WorkloadPolicy) -> list[str]:
    """What ``status`` and ``doctor`` warn about even though the agent runs."""
    if policy.mode == "agent":
        who = accounts.agent_account().name
        return [
            f"members run as the agent's own user {who}: they can read this Node's state "
            "directory and credentials. Run the agent as root with an account pool "
            "([accounts] in node.toml) to isolate them."
        ]
    return []


def _account_findings(policy: WorkloadPolicy) -> list[Finding]:
    found = [Finding("warn", text) for text in warnings(policy)]
    if policy.mode == "user":
        found.append(
            Finding(
                "ok",
                "accounts: each member runs as the local account named like its "
                "submitting TunePlane user (a user without one is refused at Prepare)",
            )
        )
    if policy.mode != "pool":
        return found
    missing: list[str] = []
    bad: list[str] = []
    for name in policy.pool:
        try:
            accounts.lookup(name)
        except accounts.AccountError as exc:
            (missing if "does not exist" in str(exc) else bad).append(str(exc))
    origin = "the default pool" if policy.defaulted else "the pool in node.toml"
    if missing or bad:
        absent = [n for n in policy.pool if any(f"account {n} " in m for m in missing)]
        text = f"account pool: {len(absent)} of {len(policy.pool)} accounts of {origin} are missing"
        if absent:
            text += (
                f" ({', '.join(absent)}); create them with `useradd --system --no-create-home "
                "NAME` or set [accounts] in node.toml"
            )
        found.append(Finding("FAIL", " ".join([text + ".", *bad])))
    else:
        listed = ", ".join(policy.pool)
        found.append(
            Finding("ok", f"account pool ({origin}): {len(policy.pool)} accounts, {listed}")
        )
    return found


def _runtime_findings(policy: WorkloadPolicy) -> list[Finding]:
    """One line per runtime: its interpreter resolved with its PATH, executable, its version."""
    found = []
    names = sorted(set(policy.runtimes) | {"python3"})
    for name in names:
        runtime = policy.runtime(name)
        origin = "node.toml" if runtime.configured else "the default"
        loader = (
            f", loader variables allowed (a Job's env may set LD_*, PYTHONPATH ... when "
            f"coordinator.toml allows them for host:{name} too)"
            if runtime.allow_loader_env
            else ""
        )
        text = f"runtime host:{name} ({origin}): interpreter {runtime.interpreter}"
        where = resolve_interpreter(runtime.interpreter, runtime.path)
        fix = f"set interpreter in [runtimes.{name}] of node.toml or install it"
        if where is None or not os.access(where, os.X_OK):
            text += (
                f", PATH {runtime.path}{loader}; {runtime.interpreter} is not an executable "
                f"file, {fix}"
            )
            found.append(Finding("FAIL", text))
            continue
        try:
            version = interpreter_version(where, runtime.path)
        except RuntimeError as exc:
            found.append(Finding("FAIL", f"{text}, PATH {runtime.path}{loader}; {exc}, {fix}"))
            continue
        shown = "" if where == runtime.interpreter else f" ({where})"
        found.append(Finding("ok", f"{text}{shown}, {version}, PATH {runtime.path}{loader}"))
    return found


def resolve_interpreter(interpreter: str, path: str) -> str | None:
    """The interpreter's file: as given when absolute, else looked up in the runtime's PATH."""
    if os.sep in interpreter:
        return interpreter if os.path.isfile(interpreter) else None
    return shutil.which(interpreter, path=path)


def interpreter_version(interpreter: str, path: str, limit_s: float = VERSION_LIMIT_S) -> str:
    """The first line ``INTERPRETER --version`` prints, run with the runtime's PATH.

    Raises :class:`RuntimeError` with a sentence when it fails, hangs past ``limit_s`` or says
    nothing."""
    try:
        done = subprocess.run(
            [interpreter, "--version"], capture_output=True, text=True, timeout=limit_s,
            env={"PATH": path, "LANG": "C"}, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"`{interpreter} --version` did not answer within {limit_s:g} s"
        ) from None
    except OSError as exc:
        raise RuntimeError(f"`{interpreter} --version` cannot be run ({exc.strerror})") from None
    lines = (done.stdout + done.stderr).strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"`{interpreter} --version` exited with {done.returncode} "
            f"({lines[0] if lines else 'no output'})"
        )
    return lines[0].strip()


def bwrap_finding(policy: WorkloadPolicy) -> Finding:
    """Run ``bwrap … true`` as a member would (a pool account, no new privileges)."""
    argv = [sandbox.BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--tmpfs", "/tmp", "--unshare-pid", "--unshare-ipc", "--", "true"]  # fmt: skip
    as_user: dict[str, Any] = {}
    if policy.mode == "pool":
        try:
            account = accounts.lookup(policy.pool[0])
            as_user = {"user": account.uid, "group": account.gid, "extra_groups": []}
        except accounts.AccountError:
            as_user = {}
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=BWRAP_CHECK_TIMEOUT_S, check=False,
            **as_user,
        )  # fmt: skip
    except FileNotFoundError:
        return Finding(
            "FAIL",
            f'isolation = "bwrap" but {sandbox.BWRAP} is not installed; install the '
            "distribution's bubblewrap (apt-get install bubblewrap).",
        )
    except subprocess.TimeoutExpired:
        return Finding(
            "FAIL", f"bubblewrap did not finish `true` within {BWRAP_CHECK_TIMEOUT_S:g} s."
        )
    if done.returncode != 0:
        return Finding(
            "FAIL",
            f"bubblewrap cannot start a sandbox ({done.stderr.strip() or done.returncode}); "
            "check that unprivileged user namespaces are enabled.",
        )
    return Finding("ok", f"bubblewrap sandbox works ({sandbox.BWRAP})")


def doctor_findings(
    policy: WorkloadPolicy, state_dir: Path, work_root: Path, out_root: Path
) -> list[Finding]:
    """Every workload-policy line of ``tuneplane-node doctor``."""
    found = [Finding("FAIL", p) for p in start_problems(policy, state_dir, work_root, out_root)]
    found += _account_findings(policy)
    found += _runtime_findings(policy)
    if policy.isolation == "bwrap":
        found.append(bwrap_finding(policy))
    else:
        found.append(Finding("ok", 'isolation: none (set isolation = "bwrap" for a sandbox)'))
    return found
