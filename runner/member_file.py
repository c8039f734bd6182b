"""``member.json``: what the agent asks one runner to start (agent writes, runner reads).

Rules: the format is versioned (``format``); every path is absolute; unknown or missing keys are
errors that name the file and the field. ``account`` and ``sandbox`` are always written (``null``
means "run as the runner's own user" / "no sandbox"), so a file can never drop them by omission.
Stdlib only: this module ships inside ``runner.pyz``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .durable import read_json

MEMBER_FILE = "member.json"
FORMAT = 2


_KIND_NAMES = {
    int: "an integer",
    str: "a string",
    list: "a list",
    dict: "an object",
    bool: "true or false",
}


class MemberFileError(ValueError):
    """``member.json`` is missing or wrong. ``str()`` names the file, the field and the fix."""


@dataclasses.dataclass(frozen=True)
class ProcessEntry:
    """One local process: argv, its whole environment, its working directory, its local rank."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    local_rank: int


@dataclasses.dataclass(frozen=True)
class Account:
    """The unprivileged account the workload runs as; the runner switches to it before exec.

    ``reap``: when the member ends the runner kills everything the member left running (all its
    descendants) and hands ``release_paths`` (a pool account's folders) back to root before it
    records the exit, so the next member leasing the account finds nothing.
    """

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    reap: bool
    release_paths: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "uid": self.uid,
            "gid": self.gid,
            "groups": list(self.groups),
            "reap": self.reap,
            "release_paths": list(self.release_paths),
        }


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """The sandbox command every local process runs under: ``argv`` is put before its own."""

    argv: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MemberFile:
    """The member a runner starts; ``processes`` are started in order, one process group each."""

    run_id: str
    attempt: int
    member_index: int
    out_dir: str
    grace_period_s: int
    stdout_path: str
    stderr_path: str
    processes: tuple[ProcessEntry, ...]
    account: Account | None = None
    sandbox: Sandbox | None = None
    # The runner.pyz the workload imports tuneplane.report from (None: the runner's own).
    sdk_path: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "member_index": self.member_index,
            "out_dir": self.out_dir,
            "grace_period_s": self.grace_period_s,
            "stdout_path": self.stdout_path,
            "stderr_path": self.stderr_path,
            "processes": [
                {"argv": list(p.argv), "env": dict(p.env), "cwd": p.cwd, "local_rank": p.local_rank}
                for p in self.processes
            ],
            "account": self.account.to_json() if self.account else None,
            "sandbox": {"argv": list(self.sandbox.argv)} if self.sandbox else None,
            "sdk_path": self.sdk_path,
        }


class _Reader:
    """Checks one JSON object field by field so every error names its field."""

    def __init__(self, source: Path, raw: object, where: str) -> None:
        self.source = source
        self.where = where
        if not isinstance(raw, dict):
            self.fail(where or "<root>", raw, "is not a JSON object")
        self.raw: dict[str, Any] = raw

    def fail(self, field: str, value: object, why: str) -> NoReturn:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise MemberFileError(
            f"{self.source}: field '{field}' = {shown} {why}. The agent writes this file; "
            f"remove the member directory and let the agent prepare the member again."
        )

    def field(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def take(self, name: str, kind: type) -> Any:
        if name not in self.raw:
            self.fail(self.field(name), None, "is missing")
        value = self.raw[name]
        if type(value) is not kind:
            self.fail(self.field(name), value, f"is not {_KIND_NAMES[kind]}")
        return value

    def path(self, name: str) -> str:
        value: str = self.take(name, str)
        if not Path(value).is_absolute():
            self.fail(self.field(name), value, "is not an absolute path")
        return value

    def nullable(self, name: str) -> Any:
        if name not in self.raw:
            self.fail(self.field(name), None, "is missing (write null for none)")
        return self.raw[name]

    def no_extra(self, allowed: Sequence[str]) -> None:
        extra = sorted(set(self.raw) - set(allowed))
        if extra:
            self.fail(self.field(extra[0]), self.raw[extra[0]], "is not a known field")


def _process(source: Path, raw: object, index: int) -> ProcessEntry:
    r = _Reader(source, raw, f"processes[{index}]")
    r.no_extra(("argv", "env", "cwd", "local_rank"))
    argv = r.take("argv", list)
    if not argv or not all(isinstance(a, str) for a in argv):
        r.fail(r.field("argv"), argv, "is not a non-empty list of strings")
    env = r.take("env", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        r.fail(r.field("env"), env, "is not a mapping of strings to strings")
    local_rank = r.take("local_rank", int)
    if local_rank != index:
        r.fail(r.field("local_rank"), local_rank, f"is not {index} (its position in the list)")
    return ProcessEntry(argv=tuple(argv), env=dict(env), cwd=r.path("cwd"), local_rank=local_rank)


def _account(source: Path, raw: object) -> Account | None:
    if raw is None:
        return None
    r = _Reader(source, raw, "account")
    r.no_extra(("name", "uid", "gid", "groups", "reap", "release_paths"))
    uid, gid = r.take("uid", int), r.take("gid", int)
    for name, value in (("uid", uid), ("gid", gid)):
        if value <= 0:
            r.fail(r.field(name), value, "is not the id of an unprivileged account (above 0)")
    groups = r.take("groups", list)
    if not all(type(g) is int and g > 0 for g in groups):
        r.fail(r.field("groups"), groups, "is not a list of group ids above 0")
    paths = r.take("release_paths", list)
    if not all(isinstance(p, str) and Path(p).is_absolute() for p in paths):
        r.fail(r.field("release_paths"), paths, "is not a list of absolute paths")
    return Account(
        name=r.take("name", str),
        uid=uid,
        gid=gid,
        groups=tuple(groups),
        reap=r.take("reap", bool),
        release_paths=tuple(paths),
    )


def _sandbox(source: Path, raw: object) -> Sandbox | None:
    if raw is None:
        return None
    r = _Reader(source, raw, "sandbox")
    r.no_extra(("argv",))
    argv = r.take("argv", list)
    if not argv or not all(isinstance(a, str) for a in argv) or not argv[0].startswith("/"):
        r.fail(r.field("argv"), argv, "is not a list of strings starting with an absolute path")
    return Sandbox(argv=tuple(argv))


def parse_member_file(source: Path, raw: object) -> MemberFile:
    """Check ``raw`` (the decoded JSON of ``source``) and return it as a :class:`MemberFile`."""
    r = _Reader(source, raw, "")
    r.no_extra([f.name for f in dataclasses.fields(MemberFile)] + ["format"])
    if r.take("format", int) != FORMAT:
        r.fail("format", r.raw["format"], f"is not {FORMAT}, the format this runner reads")
    processes = r.take("processes", list)
    if not processes:
        r.fail("processes", processes, "is empty; a member starts at least one local process")
    grace = r.take("grace_period_s", int)
    if grace < 0:
        r.fail("grace_period_s", grace, "is negative")
    return MemberFile(
        run_id=r.take("run_id", str),
        attempt=r.take("attempt", int),
        member_index=r.take("member_index", int),
        out_dir=r.path("out_dir"),
        grace_period_s=grace,
        stdout_path=r.path("stdout_path"),
        stderr_path=r.path("stderr_path"),
        processes=tuple(_process(source, p, i) for i, p in enumerate(processes)),
        account=_account(source, r.nullable("account")),
        sandbox=_sandbox(source, r.nullable("sandbox")),
        sdk_path=_sdk_path(r),
    )


def _sdk_path(r: _Reader) -> str | None:
    value = r.nullable("sdk_path")
    if value is not None and (not isinstance(value, str) or not Path(value).is_absolute()):
        r.fail("sdk_path", value, "is not null or an absolute path")
    return value if value is None else str(value)


def read_member_file(member_dir: Path) -> MemberFile:
    """Read and check ``<member_dir>/member.json``; raises :class:`MemberFileError`."""
    source = member_dir / MEMBER_FILE
    try:
        raw = read_json(source)
    except FileNotFoundError:
        raise MemberFileError(
            f"{source} does not exist; the agent writes it before starting the runner. "
            f"Check the member directory path."
        ) from None
    except (OSError, ValueError) as exc:
        raise MemberFileError(
            f"{source} cannot be read as JSON ({exc}); remove the member directory and let the "
            f"agent prepare the member again."
        ) from None
    return parse_member_file(source, raw)
