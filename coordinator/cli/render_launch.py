"""What a preview says every rank will run: the command and the environment, from the resolved
JobSpec the coordinator returned (``command`` and ``parameter_env`` are its, computed once at
Preview; the Node runs exactly them).

Rules: read only from the resolved JobSpec JSON, never recomputed here; a JobSpec that cannot be
read shows '?' rather than a guess.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from collections.abc import Mapping
from typing import Any

import attrs

from ..derivation import how_fetched, stored_source

# Set by the Node for each rank at launch (agent/launch_plan.py and agent/members_launch.py):
# known only once the Job is placed, so a preview names them instead of showing values.
AT_LAUNCH = (
    "by the Node, per rank: the rank and rendezvous variables of the recipe's launcher (RANK, "
    "LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, NNODES, MASTER_ADDR, MASTER_PORT), "
    "CUDA_VISIBLE_DEVICES, TUNEPLANE_RUN_ID, TUNEPLANE_ATTEMPT, TUNEPLANE_MEMBER_INDEX, "
    "TUNEPLANE_MEMBER_COUNT, TUNEPLANE_OUT_DIR, TUNEPLANE_TELEMETRY_DIR, "
    "TUNEPLANE_TENSORBOARD_DIR, TENSORBOARD_LOGDIR, AIP_TENSORBOARD_LOG_DIR, HOME and PATH; "
    "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (the interface that routes to the rendezvous) "
    "unless the Job's env sets them"
)
_WRAP = 84


@attrs.frozen
class Launch:
    """The command and environment each rank of a previewed Job gets."""

    command: tuple[str, ...]
    env: Mapping[str, str]
    runtime_id: str


def launch_of(resolved_jobspec_json: str) -> Launch | None:
    """The :class:`Launch` of a resolved JobSpec, or None when its JSON cannot be read."""
    try:
        data: Any = json.loads(resolved_jobspec_json)
        command = data.get("command") or data["entrypoint"]
        env = {**data.get("env", {}), **data.get("parameter_env", {})}
        runtime = data.get("runtime_id", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    return Launch(tuple(command), dict(sorted(env.items())), str(runtime))


def launch_rows(
    resolved_jobspec_json: str, node_names: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """``(key, value)`` lines for the preview: Command, Environment (one variable a line), what
    the run begins from (``node_names`` as for :func:`begins_from`), and what the Node adds per
    rank."""
    launch = launch_of(resolved_jobspec_json)
    if launch is None:
        return [("Command", "?"), ("Environment", "?")]
    rows = [("Command", shlex.join(launch.command))]
    program = launch.command[0] if launch.command else ""
    if launch.runtime_id.startswith("host:") and program == launch.runtime_id[5:]:
        rows.append(("", f"({program} is the Node's {launch.runtime_id} interpreter)"))
    lines = [f"{name}={shlex.quote(value)}" for name, value in launch.env.items()]
    rows.append(("Environment", lines[0] if lines else "(none from the Job)"))
    rows += [("", line) for line in lines[1:]]
    begins = begins_from(resolved_jobspec_json, node_names)
    if begins is not None:
        wrapped = textwrap.wrap(begins, _WRAP)
        rows.append(("Begins from", wrapped[0]))
        rows += [("", line) for line in wrapped[1:]]
    wrapped = textwrap.wrap(AT_LAUNCH, _WRAP)
    rows.append(("Set at launch", wrapped[0]))
    rows += [("", line) for line in wrapped[1:]]
    return rows


def begins_from(
    resolved_jobspec_json: str, node_names: Mapping[str, str] | None = None
) -> str | None:
    """The Derivation's source as Preview resolved it (``init_from_source``), in words, with
    where each Node gets it (:func:`~tuneplane.coordinator.derivation.how_fetched`); None
    without one or when it cannot be read."""
    src = stored_source(resolved_jobspec_json)
    if src is None:
        return None
    return (
        f"run {src.run_id} (attempt {src.attempt}, member {src.member_index}): "
        f"{src.files} files, {src.bytes} bytes, manifest sha256 {src.manifest_sha256}, "
        f"{how_fetched(src, node_names)}; each rank finds them at $TUNEPLANE_INIT_FROM_DIR"
    )


def launch_json(resolved_jobspec_json: str) -> dict[str, Any]:
    """``command`` (argv list) and ``env`` (the Job's variables and TUNEPLANE_PARAM_*) for
    ``tp submit --json``; both null when the JobSpec cannot be read."""
    launch = launch_of(resolved_jobspec_json)
    if launch is None:
        return {"command": None, "env": None}
    return {"command": list(launch.command), "env": dict(launch.env)}
