"""``tuneplane demo``: a real coordinator and two real agents on loopback run the bundled example.

Everything here is what a person would do by hand (init, serve, token create, enroll, run, tp
submit), done as real processes with a fresh dev CA, so the demo proves the product rather than
imitating it. It exits 0 only when the Job succeeded and every process stopped cleanly.

With ``--store postgresql`` the coordinator keeps its state in an embedded PostgreSQL the demo
starts first and stops last (:mod:`tuneplane.coordinator.demo.postgres`); by default in SQLite
files in its state directory. ``--ha`` (on the embedded PostgreSQL) adds a standby coordinator and
kills the leader with SIGKILL while the Job runs (:mod:`tuneplane.coordinator.demo.ha`); the
demo still exits 0 only when the Job succeeded, through the coordinator that took over.

As root, members never run as root: the agents run them as the documented default pool
(node-a: ``tuneplane-member-0`` .. ``3``, node-b: ``tuneplane-member-4`` .. ``7``); the demo
creates the ones that are missing, exactly as docs/operator.md tells a sysadmin to, and removes
those it created (and only those) when it ends. As any other user, members run as that user.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from importlib import resources
from pathlib import Path

import click
from rich.console import Console

from . import accounts, postgres, slurm_run
from . import ha as ha_run
from .cluster import (
    MEMBER_ROOT_PREFIX,
    SPARE_MEMBER_PARENT,
    ClusterError,
    LocalCluster,
    running_as_root,
)
from .slurm_run import run_on_slurm
from .watch import JobHistory, chart, find_run_id, watch

MARKER = ".tuneplane-demo"
# In the marker: the member root a run put outside the workdir, removed with the workdir.
MEMBERS_LINE = "members: "
# In the marker: the folder in /var/tmp a root run kept the embedded PostgreSQL's data in.
POSTGRES_LINE = "postgres: "
AGENTS = ("node-a", "node-b")
# The demo's coordinator serves its web console on a free loopback port (endpoints.json says which).
CONSOLE_TOML = '\n[console]\nlisten = "127.0.0.1:0"\n'


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
@click.option(
    "--profile", default=None, help="The Job's Profile (default: h200:4; with --slurm, slurm:2)."
)
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for the Job.")
@click.option(
    "--store",
    type=click.Choice(["sqlite", "postgresql"]),
    default=None,
    help="Where the coordinator keeps its state: SQLite files in its state directory (the "
    "default), or an embedded PostgreSQL the demo starts and stops "
    f"(`{postgres.INSTALL}`).",
)
@click.option(
    "--ha",
    is_flag=True,
    help="Two coordinators on an embedded PostgreSQL (implies --store postgresql): the demo "
    "kills the leader with SIGKILL while the Job runs, and the standby takes over.",
)
@click.option(
    "--keep",
    is_flag=True,
    help="When the Job has ended, keep the coordinator (and so its web console) and the agents "
    "running until Ctrl-C, so a person can look.",
)
@click.option(
    "--slurm",
    is_flag=True,
    help="Run the Job on a throwaway Slurm cluster (munged, slurmctld, slurmd and slurmrestd "
    "under a temporary folder; as root, with Debian's slurm-wlm, slurmrestd, "
    "slurm-wlm-jwt-plugin and munge) through a Fleet of kind slurm, instead of two agents.",
)
def demo(
    workdir: Path,
    experiment: str,
    profile: str | None,
    timeout: float,
    store: str | None,
    ha: bool,
    keep: bool,
    slurm: bool,
) -> None:
    """Start a coordinator and two agents on loopback and run the example Job end to end."""
    console = Console()
    if ha and store == "sqlite":
        raise click.UsageError(
            "--ha needs coordinators sharing a PostgreSQL store; drop --store sqlite (--ha "
            "starts an embedded PostgreSQL)."
        )
    if slurm and (ha or store or keep):
        raise click.UsageError("--slurm runs on SQLite and ends with the Job; drop --ha, "
                               "--store and --keep.")  # fmt: skip
    if slurm:
        workdir = workdir.resolve()
        prepare_workdir(workdir)
        Console().rule("TunePlane demo on Slurm")
        project = _example_project(workdir / "project")
        ok = run_on_slurm(Console(), workdir, project, experiment, profile or slurm_run.PROFILE,
                          timeout, CONSOLE_TOML)  # fmt: skip
        Console().print("[green]demo succeeded[/]" if ok else "[red]demo failed[/]")
        sys.exit(0 if ok else 1)
    profile = profile or "h200:4"
    store = "postgresql" if ha else store or "sqlite"
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
            ok = _on_postgres(console, workdir, experiment, profile, timeout, ha, keep)
        else:
            ok = _run_demo(console, workdir, experiment, profile, timeout, keep=keep)
    finally:
        ok = _remove_accounts(console, created) and ok
    console.print("[green]demo succeeded[/]" if ok else "[red]demo failed[/]")
    sys.exit(0 if ok else 1)


def _on_postgres(
    console: Console,
    workdir: Path,
    experiment: str,
    profile: str,
    timeout: float,
    ha: bool,
    keep: bool,
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
            ok = _run_demo(console, workdir, experiment, profile, timeout, server.url, ha, keep)
        finally:
            if server.stop():
                console.print("stopped the embedded PostgreSQL")
            else:
                console.print(f"[red]the embedded PostgreSQL in {server.data} still runs[/]")
                ok = False
    finally:
        ok = _remove_accounts(console, created) and ok
    return ok


def console_line(cluster: LocalCluster) -> str:
    """Where the demo's console is and how to sign in to it (``endpoints.json`` names it)."""
    state = cluster.coordinator_dir
    return (
        f"console: {cluster.endpoints['console']}/ (sign in with the token in "
        f"{state / 'admin.token'}; its certificate is from the demo's CA, "
        f"{state / 'tls' / 'ca.pem'})"
    )


def _keep_open(console: Console, cluster: LocalCluster, run_id: str) -> None:
    """Until Ctrl-C (or the coordinator ending by itself): the console stays up to look at."""
    coordinator = cluster.coordinator
    if coordinator is None or not coordinator.alive():
        console.print("[red]--keep: the coordinator is not running, nothing to keep open[/]")
        return
    console.print(console_line(cluster), soft_wrap=True)
    console.print(f"the Job's page: {cluster.endpoints['console']}/jobs/{run_id}")
    console.print("--keep: the coordinator and agents stay up; press Ctrl-C to stop them")
    try:
        coordinator.popen.wait()
    except KeyboardInterrupt:
        console.print("Ctrl-C")
        return
    console.print(f"[red]the coordinator exited by itself ({coordinator.popen.returncode})[/]")


def _run_demo(
    console: Console,
    workdir: Path,
    experiment: str,
    profile: str,
    timeout: float,
    store_url: str = "",
    ha: bool = False,
    keep: bool = False,
) -> bool:
    """The demo on a cluster in ``workdir``; with ``ha`` a standby too, and the leader killed
    while the Job runs (:mod:`.ha`); with ``keep`` everything stays up until Ctrl-C once the Job
    has ended."""
    ok = False
    with LocalCluster(workdir, store_url=store_url, config=CONSOLE_TOML) as cluster:
        try:
            _note_member_root(console, cluster)
            cluster.start_coordinator()
            console.print(
                f"coordinator: api {cluster.endpoints['api']}, control "
                f"{cluster.endpoints['control']}, telemetry {cluster.endpoints['telemetry']} (TLS)"
            )
            console.print(console_line(cluster), soft_wrap=True)
            if ha:
                ha_run.start_standby(cluster)
                console.print(
                    f"standby: {ha_run.STANDBY} on the same store, standing by (it refuses "
                    "connections until it takes the lease over)"
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
            if ha:
                ha_run.wait_nodes_know(cluster, 2)
                console.print("both Nodes know both coordinators (the leader's Welcome lists them)")
            project = _example_project(workdir / "project")
            paced = ["--env", ha_run.PACED] if ha else []
            submit = ["submit", experiment, "--profile", profile, *paced, "--yes"]
            console.print(f"$ tp {' '.join(submit)}")
            done = cluster.tp(*submit, cwd=project)
            console.print(done.stdout.rstrip())
            if done.returncode != 0:
                raise ClusterError(f"tp submit failed: {done.stderr.strip()}")
            history = JobHistory(console, cluster, find_run_id(done.stdout))
            if ha:
                ha_run.ride_out(console, cluster, history)
            ok = watch(history, timeout)
            if ok:
                ok = chart(console, cluster, history.run_id, timeout)
            if keep:
                _keep_open(console, cluster, history.run_id)
        except ClusterError as exc:
            console.print(f"[red]demo failed:[/] {exc}")
            agents = [a.process for a in cluster.agents]
            for proc in [cluster.coordinator, *cluster.others, *agents]:
                if proc is not None:
                    console.print(f"logs of {proc.name}: {proc.log_path}")
        console.print("stopping agents and coordinator ...")
    stray = [a.name for a in cluster.agents if a.process.alive()]
    coordinators = [cluster.coordinator, *cluster.others]
    stray += [p.name for p in coordinators if p is not None and p.alive()]
    if stray:
        console.print(f"[red]processes still running:[/] {', '.join(stray)}")
        ok = False
    return ok
