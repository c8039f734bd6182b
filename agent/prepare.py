"""Prepare steps: check the requested GPUs, materialise and verify the member's files, pick a port.

Rules: each step either succeeds or raises :class:`PrepareRefused` with a sentence that goes back
to the coordinator in PrepareReply.reason. Materialising is idempotent (the same Prepare writes
the same bytes again) and every file is written atomically, then read back and checked against
its sha256 digest. The runner the agent starts is the copy in the root-only member directory;
the copy in the workload's work directory only serves its ``tuneplane.report`` imports.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import attrs

from tuneplane.proto.contract.input_checks import InputRefused, check_file_name

from . import runner_pyz
from .atomic_file import DirSync, make_dirs, make_parents, write_atomic
from .inventory import Inventory
from .journal_records import MemberKey
from .runner_pyz import CAPSULE_DIR as CAPSULE_DIR
from .runner_pyz import WORK_DIR as WORK_DIR

CAPSULE_JSON = "capsule.json"
JOBSPEC_FILE = "jobspec.json"


class PrepareRefused(Exception):
    """This Node cannot prepare the member; ``str()`` is the reason sent to the coordinator."""


def check_gpus(
    key: MemberKey,
    requested: tuple[int, ...],
    sent_uuids: tuple[str, ...],
    inventory: Inventory,
    owners: Mapping[str, MemberKey],
    unnamed_owners: Mapping[int, MemberKey] | None = None,
) -> tuple[str, ...]:
    """Check a Prepare's GPUs against this Node now; return their UUIDs, in the same order.

    Every requested GPU exists, is asked for once, still has the UUID the coordinator placed
    it by (``sent_uuids``; empty from an older coordinator, which gets the health check only),
    is healthy, and is owned by nobody else: ``owners`` by UUID, ``unnamed_owners`` by index
    for reservations an older agent made without a UUID.
    """
    if len(set(requested)) != len(requested):
        raise PrepareRefused(f"GPU indexes {list(requested)} name a GPU more than once.")
    if sent_uuids and len(sent_uuids) != len(requested):
        raise PrepareRefused(
            f"The Prepare names {len(requested)} GPU indexes but {len(sent_uuids)} GPU UUIDs; "
            "the coordinator must send one UUID per index."
        )
    uuids = []
    for position, index in enumerate(requested):
        gpu = inventory.gpu(index)
        if gpu is None:
            raise PrepareRefused(
                f"GPU {index} does not exist on this Node (it has {len(inventory.gpus)} GPUs, "
                f"source {inventory.gpu_source})."
            )
        sent = sent_uuids[position] if sent_uuids else ""
        # A card NVML cannot identify any more (lost) has uuid "": it fails as unhealthy.
        if sent and gpu.uuid and sent != gpu.uuid:
            raise PrepareRefused(mapping_changed(index, sent, gpu.uuid, inventory))
        if not gpu.healthy or not gpu.uuid:
            name = gpu.uuid or sent or "UUID unreadable"
            raise PrepareRefused(f"GPU {index} ({name}) is unhealthy: {gpu.health_reason}.")
        owner = owners.get(gpu.uuid) or (unnamed_owners or {}).get(index)
        if owner is not None and owner != key:
            raise PrepareRefused(f"GPU {index} is busy: member {owner} owns it ({gpu.uuid}).")
        uuids.append(gpu.uuid)
    return tuple(uuids)


def mapping_changed(index: int, expected: str, now: str, inventory: Inventory) -> str:
    """The sentence for a GPU index that names another card than the one it was placed by."""
    moved = next((g.index for g in inventory.gpus if g.uuid == expected), None)
    where = (
        f"that card is GPU {moved} now"
        if moved is not None
        else "that card is not in this Node's inventory any more"
    )
    return (
        f"GPU {index} was placed as {expected} but this Node's GPU {index} is {now} now "
        f"({where}); the GPU order changed, so the Job must be placed again."
    )


def check_launch(
    gpu_indexes: tuple[int, ...], gpu_uuids: tuple[str, ...], inventory: Inventory
) -> str | None:
    """Why a committed member must not start on ``inventory`` (fresh), or None when it may.

    Each GPU must still be present, still be the card it was prepared on (its journaled UUID;
    a member an older agent prepared without one gets the health check only) and be healthy.
    """
    for position, index in enumerate(gpu_indexes):
        expected = gpu_uuids[position] if position < len(gpu_uuids) else ""
        gpu = inventory.gpu(index)
        if gpu is None:
            return (
                f"GPU {index} ({expected or 'UUID unknown'}) is no longer present on this Node "
                f"(it has {len(inventory.gpus)} GPUs, source {inventory.gpu_source})."
            )
        if expected and gpu.uuid and gpu.uuid != expected:
            return mapping_changed(index, expected, gpu.uuid, inventory)
        if not gpu.healthy or not gpu.uuid:
            return (
                f"GPU {index} ({gpu.uuid or expected or 'UUID unreadable'}) became unhealthy "
                f"after it was prepared: {gpu.health_reason}."
            )
    return None


def _safe_relative(name: str, what: str) -> PurePosixPath:
    """The coordinator's one file-name rule (also applied by ``tp`` and at Preview), again here:
    a Prepare from a coordinator that skipped it must still never write outside the work dir."""
    try:
        return check_file_name(name, f"The {what} name")
    except InputRefused as exc:
        raise PrepareRefused(str(exc)) from None


def _digest_matches(data: bytes, expected: str) -> bool:
    algorithm, sep, value = expected.partition(":")
    if not sep:
        algorithm, value = "sha256", expected
    return algorithm == "sha256" and hashlib.sha256(data).hexdigest() == value.lower()


def _write_checked(path: Path, data: bytes, digest: str | None, what: str, synced: DirSync) -> None:
    make_parents(path, synced)
    write_atomic(path, data, 0o644, dir_sync=synced)
    if digest is not None and not _digest_matches(path.read_bytes(), digest):
        raise PrepareRefused(
            f"The {what} {path.name} does not match its digest {digest} after writing; the "
            "coordinator must send the capsule again."
        )


def materialise(
    member_dir: Path,
    jobspec_json: str,
    capsule_files: Mapping[str, bytes],
    capsule_digests: Mapping[str, str],
    source_files: Mapping[str, str],
    work_dir: Path | None = None,
) -> Path:
    """Write the member's JobSpec, capsule, runner and experiment files; return the work dir.

    Layout: ``<member_dir>/jobspec.json``; ``<work_dir>/`` (the workload's cwd, holding the
    experiment files; ``<member_dir>/work`` when not given) and ``<work_dir>/.tuneplane/capsule/``
    (the Job Capsule: the sealed files plus this Node's ``runner.pyz`` and ``runner.sha256``);
    and ``<member_dir>/work/.tuneplane/capsule/runner.pyz``, the copy the agent starts, which a
    workload never can write.
    """
    if set(capsule_files) != set(capsule_digests):
        missing = sorted(set(capsule_digests) ^ set(capsule_files))
        raise PrepareRefused(
            f"The capsule files and their digests do not name the same files (differ on "
            f"{', '.join(missing)}); the coordinator must seal the capsule again."
        )
    for name, data in capsule_files.items():
        if name in (runner_pyz.RUNNER_PYZ, runner_pyz.RUNNER_DIGEST):
            raise PrepareRefused(
                f"The capsule file {name} is a name the Node writes itself (its runner); the "
                "coordinator must not seal a file by that name."
            )
        if not _digest_matches(data, capsule_digests[name]):
            raise PrepareRefused(
                f"The capsule file {name} arrived with content that does not match its digest "
                f"{capsule_digests[name]}."
            )
    # Every name is checked before the first byte is written: a refused Prepare leaves nothing.
    for name in source_files:
        _safe_relative(name, "experiment file")
    for name in capsule_files:
        _safe_relative(name, "capsule file")
    work = work_dir if work_dir is not None else member_dir / WORK_DIR
    # One fsync per directory, once every file is written: nothing is promised before this
    # returns (Prepare answers after it), so that is as durable as one per file.
    synced = DirSync()
    make_dirs(work, synced)
    write_atomic(member_dir / JOBSPEC_FILE, jobspec_json.encode(), 0o644, dir_sync=synced)
    for name, content in source_files.items():
        rel = _safe_relative(name, "experiment file")
        try:
            data = base64.b64decode(content, validate=True)
        except ValueError:
            raise PrepareRefused(f"The experiment file {name} is not valid base64.") from None
        _write_checked(work / rel, data, None, "experiment file", synced)
    for name, data in capsule_files.items():
        rel = _safe_relative(name, "capsule file")
        _write_checked(
            work / CAPSULE_DIR / rel, data, capsule_digests[name], "capsule file", synced
        )
    try:
        make_dirs(work / CAPSULE_DIR, synced)
        runner_pyz.materialise(work / CAPSULE_DIR, synced)
        if work != member_dir / WORK_DIR:
            sealed = runner_pyz.capsule_dir(member_dir)
            make_dirs(sealed, synced)
            runner_pyz.materialise(sealed, synced)
    except runner_pyz.RunnerPyzError as exc:
        raise PrepareRefused(str(exc)) from None
    synced.flush()
    return work


@attrs.frozen
class CapsuleLaunch:
    """What the sealed ``capsule.json`` says to start: the launcher and the filled entrypoint."""

    launcher: str
    entrypoint: tuple[str, ...]


def read_capsule(work: Path) -> CapsuleLaunch:
    """Read the launch from the materialised ``capsule.json`` (sealed and digest-checked).

    The capsule, not this agent's own Catalogue, says how to launch, so a coordinator with a
    newer recipe and an older agent can never disagree silently.
    """
    path = work / CAPSULE_DIR / CAPSULE_JSON
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise PrepareRefused(
            f"The Job Capsule has no {CAPSULE_JSON}; the coordinator must seal one into Prepare."
        ) from None
    except (OSError, ValueError) as exc:
        raise PrepareRefused(f"The capsule file {path} cannot be read: {exc}.") from None
    launcher = raw.get("launcher") if isinstance(raw, dict) else None
    entrypoint = raw.get("entrypoint") if isinstance(raw, dict) else None
    if not isinstance(launcher, str) or not launcher:
        raise PrepareRefused(f"The capsule file {path} names no 'launcher'.")
    if (
        not isinstance(entrypoint, list)
        or not entrypoint
        or not all(isinstance(a, str) for a in entrypoint)
    ):
        raise PrepareRefused(f"The capsule file {path} has no 'entrypoint' list of strings to run.")
    return CapsuleLaunch(launcher, tuple(entrypoint))


def pick_port(address: str) -> int:
    """A TCP port free on ``address`` right now, for member 0 to host the rendezvous."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError as exc:
            raise PrepareRefused(
                f"No TCP port can be bound on this Node's address {address} ({exc.strerror})."
            ) from None
        return int(sock.getsockname()[1])


def node_address(coordinator_host: str, coordinator_port: int) -> str:
    """The local address this Node uses to reach the coordinator (what other members can reach).

    A UDP ``connect`` only chooses a route; it sends nothing.
    """
    family = socket.AF_INET6 if ":" in coordinator_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((coordinator_host, coordinator_port))
            return str(sock.getsockname()[0])
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
