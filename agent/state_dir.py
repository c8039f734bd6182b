"""The Node state directory: node.json, the control credential, the status file, the journal path.

Rules: the directory is 0700 and the credential file 0600 in a 0700 ``credentials/``; every file
here is written atomically (:mod:`tuneplane.agent.atomic_file`) so a crash leaves the old or the
new version, never half of one. Errors name the file and say how to fix it.

Credential rotation (see docs/security.md): a successor is written whole to
``credentials/control.token.next`` (fsync), then renamed over ``control.token`` (fsync of the
directory). Reading the credential first finishes a rename a crash interrupted, so the agent
always starts with the newest credential it stored; the coordinator accepts both until the new
one is confirmed. ``credentials/control.json`` holds its issue and expiry times, never its value.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import attrs

from .atomic_file import fsync_dir, write_atomic, write_json_atomic

NODE_FILE = "node.json"
CA_FILE = "ca.pem"
CREDENTIALS_DIR = "credentials"
CONTROL_TOKEN = "control.token"
CONTROL_TOKEN_NEXT = "control.token.next"
CONTROL_LIFE = "control.json"
JOURNAL_FILE = "journal.db"
STATUS_FILE = "status.json"
MEMBERS_DIR = "members"


class StateDirError(Exception):
    """The state directory is missing something or holds something wrong; ``str()`` says what."""


class NotEnrolled(StateDirError):
    """node.json or the control credential is missing: run ``tuneplane-node enroll`` first."""


class AlreadyEnrolled(StateDirError):
    """The state directory already belongs to a Node; a new Node needs an empty one."""


@attrs.frozen
class NodeConfig:
    """What ``enroll`` wrote to node.json."""

    node_id: str
    fleet: str
    coordinator: str
    name: str
    ca: str
    enrolled_at_ms: int
    # Control addresses ``coordinator`` replaced when the coordinator announced a new one,
    # newest first; dialed when it is unreachable (agent/control_address.py).
    previous_coordinators: tuple[str, ...] = ()
    # Every coordinator sharing the store (high availability), the leader first, as the last
    # Welcome or ``enroll --coordinator A --coordinator B`` named them; dialed after
    # ``coordinator`` (agent/control_address.py). Empty until a list is named.
    coordinators: tuple[str, ...] = ()


@attrs.frozen
class CredentialLife:
    """When the control credential was issued and expires (epoch ms; 0: not known)."""

    issued_at_ms: int = 0
    expires_at_ms: int = 0


@attrs.frozen
class StateDir:
    root: Path

    @property
    def node_file(self) -> Path:
        return self.root / NODE_FILE

    @property
    def ca_path(self) -> Path:
        return self.root / CA_FILE

    @property
    def credentials_dir(self) -> Path:
        return self.root / CREDENTIALS_DIR

    @property
    def control_token(self) -> Path:
        return self.credentials_dir / CONTROL_TOKEN

    @property
    def control_token_next(self) -> Path:
        return self.credentials_dir / CONTROL_TOKEN_NEXT

    @property
    def control_life(self) -> Path:
        return self.credentials_dir / CONTROL_LIFE

    @property
    def journal_path(self) -> Path:
        return self.root / JOURNAL_FILE

    @property
    def status_path(self) -> Path:
        return self.root / STATUS_FILE

    @property
    def members_dir(self) -> Path:
        return self.root / MEMBERS_DIR

    def create(self) -> None:
        """Make the directory tree with private permissions (idempotent)."""
        for folder in (self.root, self.credentials_dir, self.members_dir):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(folder, 0o700)

    def load_node(self) -> NodeConfig:
        """node.json as written by enroll. Raises :class:`NotEnrolled` when it is absent."""
        try:
            raw = json.loads(self.node_file.read_text())
        except FileNotFoundError:
            raise NotEnrolled(
                f"{self.node_file} does not exist: this state directory is not enrolled. Run "
                f"`tuneplane-node enroll --state-dir {self.root} --coordinator HOST:PORT --ca "
                "FILE --token TOKEN` first."
            ) from None
        except (OSError, ValueError) as exc:
            raise StateDirError(
                f"{self.node_file} cannot be read ({exc}); restore it from a backup or re-enroll "
                "this machine as a new Node."
            ) from None
        try:
            return NodeConfig(
                node_id=str(raw["node_id"]),
                fleet=str(raw["fleet"]),
                coordinator=str(raw["coordinator"]),
                name=str(raw["name"]),
                ca=str(raw["ca"]),
                enrolled_at_ms=int(raw["enrolled_at_ms"]),
                previous_coordinators=tuple(str(a) for a in raw.get("previous_coordinators", ())),
                coordinators=tuple(str(a) for a in raw.get("coordinators", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StateDirError(
                f"{self.node_file} lacks or mangles the field {exc}; re-enroll this machine as a "
                "new Node."
            ) from None

    def save_node(self, node: NodeConfig) -> None:
        write_json_atomic(self.node_file, attrs.asdict(node), 0o644)

    def read_credential(self) -> str:
        """The control credential, after finishing a rotation a crash left half done."""
        self.promote_next_credential()
        try:
            token = self.control_token.read_text().strip()
        except OSError as exc:
            raise NotEnrolled(
                f"The control credential {self.control_token} cannot be read ({exc.strerror}); "
                "re-enroll this machine with a new join token."
            ) from None
        if not token:
            raise NotEnrolled(
                f"The control credential {self.control_token} is empty; re-enroll this machine."
            )
        return token

    def save_credential(self, token: str, life: CredentialLife | None = None) -> None:
        """Replace the credential (enrolment); a half-done rotation's successor is dropped."""
        self.create()
        write_atomic(self.control_token, (token + "\n").encode(), 0o600)
        self.control_token_next.unlink(missing_ok=True)
        if life is not None:
            self.save_credential_life(life)

    def save_next_credential(self, token: str) -> None:
        """Step one of a rotation: the successor, whole and fsynced, beside the current one."""
        write_atomic(self.control_token_next, (token + "\n").encode(), 0o600)

    def promote_next_credential(self) -> bool:
        """Step two: the successor replaces the current credential (atomic rename, dir fsync).

        True when there was one to promote. An empty or unreadable successor (it cannot be: it is
        written atomically) is left alone so the current credential keeps working.
        """
        try:
            if not self.control_token_next.read_text().strip():
                return False
        except OSError:
            return False
        os.replace(self.control_token_next, self.control_token)
        fsync_dir(self.credentials_dir)
        return True

    def save_credential_life(self, life: CredentialLife) -> None:
        write_json_atomic(self.control_life, attrs.asdict(life), 0o600)

    def load_credential_life(self) -> CredentialLife | None:
        """What the coordinator last said about the credential's lifetime; None if never told."""
        try:
            raw = json.loads(self.control_life.read_text())
            return CredentialLife(int(raw["issued_at_ms"]), int(raw["expires_at_ms"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def permission_problems(self) -> list[str]:
        """Sentences for every file or folder whose permissions let others read secrets."""
        problems = []
        for path, want in (
            (self.root, 0o700),
            (self.credentials_dir, 0o700),
            (self.control_token, 0o600),
        ):
            try:
                mode = stat.S_IMODE(path.stat().st_mode)
            except FileNotFoundError:
                problems.append(f"{path} is missing.")
                continue
            if mode & 0o077:
                problems.append(
                    f"{path} has mode {mode:04o}; others can read it. Run chmod {want:04o} {path}."
                )
        return problems

    def member_dir(self, key: str) -> Path:
        return self.members_dir / key


def read_status(path: Path) -> dict[str, Any] | None:
    """The daemon's last status file, or ``None`` when there is none (never started)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
