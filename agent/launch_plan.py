"""Which local processes one member starts, and with what environment (pure: no I/O, no clock).

Rules: the plan depends only on its arguments; ``base_env`` passes through untouched except for
the rendezvous variables the launcher owns, which always win. Ranks are dense: across the
members of an attempt the global ranks are exactly ``range(world_size)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs

from tuneplane.proto.contract.input_checks import loader_refusal

LAUNCHERS = ("member", "process-group")
DEFAULT_LANG = "C.UTF-8"


class LaunchPlanError(ValueError):
    """The launch cannot be planned. ``str()`` names the argument, what was wrong and the fix."""


class UnknownLauncher(LaunchPlanError):
    """The recipe names a launcher this agent does not know."""

    def __init__(self, launcher: str) -> None:
        self.launcher = launcher
        super().__init__(
            f"Launcher {launcher!r} is not known to this agent; it knows "
            f"{', '.join(repr(name) for name in LAUNCHERS)}. Fix the recipe's 'launcher' field "
            f"or upgrade the agent."
        )


@attrs.frozen
class ProcessSpec:
    """One local process of a member: what to exec, in which directory, with which environment.

    ``env`` is the process's whole environment (nothing else is inherited by the runner).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    local_rank: int


def refused_loader_variable(
    job_env: Mapping[str, str], runtime_name: str, allow_loader_env: bool
) -> str | None:
    """A sentence naming the first loader variable the Job may not set, or None.

    Loader variables (``LD_*``, ``PYTHONPATH`` and their kin: the one rule of
    ``input_checks.loader_refusal``) change what code the loader or the interpreter runs; a Job
    sets them only when its runtime's node.toml definition says allow_loader_env = true. The
    coordinator has its own say at Preview; this is the Node's, and it is final.
    """
    refused = loader_refusal(
        job_env,
        f"host:{runtime_name}",
        allow_loader_env,
        "ask this Node's operator to set allow_loader_env = true under "
        f"[runtimes.{runtime_name}] in node.toml",
    )
    return None if refused is None else f"The Job's {refused}"


def workload_env(
    job_env: Mapping[str, str],
    tuneplane_env: Mapping[str, str],
    runtime_path: str,
    home: str,
) -> dict[str, str]:
    """The whole base environment of a member's processes: an allow-list, nothing inherited.

    The Job's ``env`` first (LANG among it, or ``C.UTF-8``); then what TunePlane owns, which
    always wins: ``TUNEPLANE_*`` (the recipe's ``TUNEPLANE_PARAM_*`` among them, as the
    resolved JobSpec carries them), ``HOME`` (the member's work directory) and ``PATH`` (the
    runtime's definition in node.toml, never the agent's). The launcher adds ranks and the
    rendezvous; the runner adds the SDK to PYTHONPATH.
    """
    env = {"LANG": DEFAULT_LANG, **job_env}
    env.update(tuneplane_env)
    env["HOME"] = home
    env["PATH"] = runtime_path
    return env


def member_env(
    run_id: str,
    attempt: int,
    member_index: int,
    member_count: int,
    out_dir: Path,
    telemetry_dir: Path,
    tensorboard_dir: Path,
    parameter_env: Mapping[str, str],
) -> dict[str, str]:
    """TunePlane's own names in a member's environment, wherever it runs (a Node or a Slurm
    node): the recipe's parameters as the coordinator rendered them at Preview (the digest
    covers them), the member's identity, and where to write."""
    return {
        **parameter_env,
        "TUNEPLANE_RUN_ID": run_id,
        "TUNEPLANE_ATTEMPT": str(attempt),
        "TUNEPLANE_MEMBER_INDEX": str(member_index),
        "TUNEPLANE_MEMBER_COUNT": str(member_count),
        "TUNEPLANE_OUT_DIR": str(out_dir),
        "TUNEPLANE_TELEMETRY_DIR": str(telemetry_dir),
        # Where libraries look for a TensorBoard log directory (docs/telemetry.md, "Where to
        # write"); the collector follows all of $TUNEPLANE_OUT_DIR anyway.
        "TUNEPLANE_TENSORBOARD_DIR": str(tensorboard_dir),
        "TENSORBOARD_LOGDIR": str(tensorboard_dir),
        "AIP_TENSORBOARD_LOG_DIR": str(tensorboard_dir),
    }


def resolve_entrypoint(
    entrypoint: tuple[str, ...], runtime: str, interpreter: str
) -> tuple[str, ...]:
    """The entrypoint with a bare runtime name (``python3`` for ``host:python3``) made absolute.

    Which program ``python3`` is belongs to the operator (node.toml), not to whichever PATH the
    process happens to get.
    """
    if entrypoint and entrypoint[0] == runtime:
        return (interpreter, *entrypoint[1:])
    return entrypoint


def _check(
    entrypoint: tuple[str, ...],
    member_index: int,
    member_count: int,
    master_port: int,
    gpu_uuids: tuple[str, ...],
) -> None:
    if not entrypoint:
        raise LaunchPlanError(
            "The entrypoint is empty; give the command to run, e.g. ('python3', 'train.py')."
        )
    if member_count < 1:
        raise LaunchPlanError(f"member_count is {member_count}; an attempt has at least 1 member.")
    if not 0 <= member_index < member_count:
        raise LaunchPlanError(
            f"member_index is {member_index} but member_count is {member_count}; the index must "
            f"be in 0..{member_count - 1}."
        )
    if not 1 <= master_port <= 65535:
        raise LaunchPlanError(f"master_port is {master_port}; give a TCP port in 1..65535.")
    if len(set(gpu_uuids)) != len(gpu_uuids) or any(not uuid for uuid in gpu_uuids):
        raise LaunchPlanError(
            f"gpu_uuids {gpu_uuids!r} holds an empty or repeated GPU UUID; assign each GPU once."
        )


def plan_processes(
    launcher: str,
    entrypoint: tuple[str, ...],
    gpu_uuids: tuple[str, ...],
    member_index: int,
    member_count: int,
    master_addr: str,
    master_port: int,
    base_env: Mapping[str, str],
    cwd: Path,
) -> tuple[ProcessSpec, ...]:
    """Plan the local processes of member ``member_index`` of ``member_count``.

    ``"member"``: one process that may run its own launcher (torchrun), told NNODES, NODE_RANK,
    NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT and CUDA_VISIBLE_DEVICES (all the member's GPUs,
    comma-separated; empty when it has none).

    ``"process-group"``: one process per GPU (one when there are none), each told RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, NNODES, MASTER_ADDR, MASTER_PORT and its
    own GPU as CUDA_VISIBLE_DEVICES. Every member of an attempt has the same number of GPUs (one
    homogeneous Resource Pool), so RANK = member_index * nproc + local_rank is dense.

    Raises :class:`UnknownLauncher` or :class:`LaunchPlanError` on bad arguments.
    """
    if launcher not in LAUNCHERS:
        raise UnknownLauncher(launcher)
    _check(entrypoint, member_index, member_count, master_port, gpu_uuids)
    rendezvous = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "NNODES": str(member_count),
        "NODE_RANK": str(member_index),
    }
    if launcher == "member":
        env = {
            **base_env,
            **rendezvous,
            "NPROC_PER_NODE": str(len(gpu_uuids)),
            "CUDA_VISIBLE_DEVICES": ",".join(gpu_uuids),
        }
        return (ProcessSpec(argv=entrypoint, env=env, cwd=str(cwd), local_rank=0),)

    nproc = max(len(gpu_uuids), 1)
    specs = []
    for local_rank in range(nproc):
        env = {
            **base_env,
            **rendezvous,
            "RANK": str(member_index * nproc + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(member_count * nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "CUDA_VISIBLE_DEVICES": gpu_uuids[local_rank] if gpu_uuids else "",
        }
        specs.append(ProcessSpec(argv=entrypoint, env=env, cwd=str(cwd), local_rank=local_rank))
    return tuple(specs)
