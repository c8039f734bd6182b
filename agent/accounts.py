"""Which Unix account a member runs as: the Node's policy, the pool lease, the local lookup.

Rules: a member never runs as the agent's user when that user is root. In ``pool`` mode a member
leases one account of the pool for its whole life, and an account that any process still runs as
is never leased; the lease is the member's ``account.json``
(written atomically in its root-only member directory before anything is materialised), and an
account is held while its member is not in a terminal journal state, so an agent restart
re-establishes every lease from the journal and those files alone. Choosing is pure
(:func:`choose_pool_account`); looking accounts up is the only I/O here.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
from collections.abc import Collection, Iterable
from pathlib import Path

import attrs
import psutil

from .atomic_file import write_json_atomic
from .config import WorkloadPolicy

LEASE_FILE = "account.json"
_USER_NAME = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")


class AccountError(Exception):
    """No account can run the member; ``str()`` is the sentence sent back in PrepareReply."""


@attrs.frozen
class Account:
    """A local account: its name, ids and supplementary groups."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


@attrs.frozen
class Lease:
    """What ``account.json`` records for one member: who it runs as and where it works."""

    account: Account
    mode: str
    work_dir: Path

    @property
    def switches_user(self) -> bool:
        """False only in ``agent`` mode, where the member runs as the agent itself."""
        return self.mode != "agent"

    def to_json(self) -> dict[str, object]:
        return {
            "account": self.account.name,
            "uid": self.account.uid,
            "gid": self.account.gid,
            "groups": list(self.account.groups),
            "mode": self.mode,
            "work_dir": str(self.work_dir),
        }


def lookup(name: str) -> Account:
    """The local account ``name`` with its supplementary groups; AccountError when absent."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise AccountError(
            f"The account {name} does not exist on this Node; create it with "
            f"`useradd --system --no-create-home {name}` or change [accounts] in node.toml."
        ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise AccountError(
            f"The account {name} has uid {entry.pw_uid} and gid {entry.pw_gid}; a member never "
            "runs with uid or gid 0. Give it its own unprivileged ids or take it out of the pool."
        )
    groups = sorted(
        {g.gr_gid for g in grp.getgrall() if name in g.gr_mem and g.gr_gid != 0} - {entry.pw_gid}
    )
    return Account(name=name, uid=entry.pw_uid, gid=entry.pw_gid, groups=tuple(groups))


def user_account(owner: str) -> Account:
    """The local account named like the submitting TunePlane user (``user`` mode)."""
    if not owner:
        raise AccountError(
            "This Node runs members as their submitter's local account ([accounts] mode = "
            '"user") but the Prepare names no submitting user; upgrade the coordinator.'
        )
    if not _USER_NAME.match(owner):
        raise AccountError(
            f"The submitting user {owner!r} is not a valid local account name on this Node, so "
            'the member cannot run as that user; ask the operator to use mode = "pool".'
        )
    try:
        return lookup(owner)
    except AccountError as exc:
        if "does not exist" not in str(exc):
            raise
        raise AccountError(
            f"The submitting user {owner} has no local account on this Node, which runs members "
            'as their submitter\'s account ([accounts] mode = "user"); ask the operator to '
            f"create it (useradd {owner}) or submit to another Fleet."
        ) from None


def agent_account() -> Account:
    """The agent's own user (``agent`` mode): its ids as they are now."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    return Account(name=name, uid=uid, gid=gid, groups=tuple(sorted(set(os.getgroups()) - {gid})))


def choose_pool_account(pool: Iterable[str], held: Collection[str]) -> str | None:
    """The first pool account no live member holds, or None when every one is leased."""
    for name in pool:
        if name not in held:
            return name
    return None


def lease_for(
    policy: WorkloadPolicy, held: Collection[str], work_dir: Path, owner: str = ""
) -> Lease:
    """Pick the account a new member runs as under ``policy``; AccountError with a sentence.

    ``owner`` is the TunePlane user who submitted the Job (``user`` mode runs the member as the
    local account of that name; the other modes ignore it).
    """
    if policy.mode == "agent":
        return Lease(agent_account(), "agent", work_dir)
    if policy.mode == "user":
        return Lease(user_account(owner), "user", work_dir)
    if policy.mode != "pool":
        raise AccountError(
            f"The account mode {policy.mode!r} is not one this Node can run; set [accounts] "
            'mode = "pool" in node.toml.'
        )
    skipped = set(held)
    while (name := choose_pool_account(policy.pool, skipped)) is not None:
        account = lookup(name)
        if not busy(account):
            return Lease(account, "pool", work_dir)
        # Something still runs as it (outside any live member): never share an account.
        skipped.add(name)
    raise AccountError(
        f"Every account of this Node's pool ({len(policy.pool)}: {', '.join(policy.pool)}) "
        "runs a member or a leftover process already; add accounts to [accounts] in node.toml "
        "or wait for a member to end."
    )


def write_lease(member_dir: Path, lease: Lease) -> None:
    """Record the lease durably (0600, atomic) before the member's files are materialised."""
    member_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(member_dir, 0o700)
    write_json_atomic(member_dir / LEASE_FILE, lease.to_json(), 0o600)


def read_lease(member_dir: Path) -> Lease | None:
    """The member's recorded lease, or None when Prepare never got that far."""
    try:
        raw = json.loads((member_dir / LEASE_FILE).read_text())
        account = Account(
            name=str(raw["account"]),
            uid=int(raw["uid"]),
            gid=int(raw["gid"]),
            groups=tuple(int(g) for g in raw["groups"]),
        )
        return Lease(account, str(raw["mode"]), Path(raw["work_dir"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AccountError(
            f"The account lease {member_dir / LEASE_FILE} cannot be read ({exc}); the member "
            "cannot be launched, start a new attempt."
        ) from None


def chown_tree(root: Path, account: Account, mode: int = 0o700) -> None:
    """Give ``root`` and everything under it to ``account``; ``root`` itself gets ``mode``."""
    os.lchown(root, account.uid, account.gid)
    os.chmod(root, mode)
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            os.lchown(os.path.join(folder, name), account.uid, account.gid)


def reclaim(paths: Iterable[Path], account: Account) -> None:
    """Give ended members' folders still owned by ``account`` back to root (cheap to repeat).

    A member that ran had its folders handed back by its runner; this covers members refused or
    aborted before they ran, so the next member leasing the account cannot read their files.
    """
    for path in paths:
        try:
            if path.lstat().st_uid != account.uid:
                continue
        except FileNotFoundError:
            continue
        chown_tree(path, Account("root", 0, 0, ()), 0o700)


def busy(account: Account) -> bool:
    """Whether any process runs as ``account`` (one left by a runner that was killed, say)."""
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info["uids"]
        if uids is not None and account.uid in (uids.real, uids.effective):
            return True
    return False
