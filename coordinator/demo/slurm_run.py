"""``tuneplane demo --slurm``: the demo's Job on a throwaway Slurm cluster instead of Nodes.

Rules: the cluster (:mod:`.slurm`: munged, slurmctld, slurmd, slurmrestd under a temporary
folder) and a coordinator (:class:`~.cluster.LocalCluster`, no agents) start; a Fleet of kind
slurm is created on the cluster's partition with a shared folder under the workdir; the example
project's Job is submitted with the real ``tp`` and followed to its end, then its train/loss
curve is drawn from what the member's collector shipped from the Slurm node. Everything is
stopped by PID at the end, whatever happened.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from .cluster import COORDINATOR, ClusterError, LocalCluster, _run
from .slurm import SlurmCluster, SlurmUnavailable, slurm_cluster
from .watch import JobHistory, chart, find_run_id, watch

FLEET = "hpc"
#: The demo's Profile on the Slurm Fleet: the throwaway node's 2 GPUs, one member.
PROFILE = "slurm:2"
PROFILE_TOML = f'\n[profiles.slurm]\nseries = "h200"\nfleet = "{FLEET}"\n'


def _create_fleet(cluster: LocalCluster, slurm: SlurmCluster, workdir: Path) -> str:
    shared = workdir / "slurm-shared"
    shared.mkdir(exist_ok=True)
    token = workdir / "slurm.token"
    token.write_text(slurm.token() + "\n")
    token.chmod(0o600)
    return _run(
        [
            *COORDINATOR, "fleet", "create", FLEET, "--kind", "slurm",
            "--slurmrestd", slurm.rest_url, "--token-file", str(token),
            "--partition", slurm.partition, "--shared-dir", str(shared),
            "--python", sys.executable, "--spool-dir", str(workdir / "slurm-spool"),
            "--state-dir", str(cluster.coordinator_dir),
        ],
        "tuneplane-coordinator fleet create --kind slurm",
    ).strip()  # fmt: skip


def run_on_slurm(
    console: Console,
    workdir: Path,
    project: Path,
    experiment: str,
    profile: str,
    timeout: float,
    config: str,
) -> bool:
    """The demo's Job on a throwaway Slurm cluster; True when it succeeded and was charted."""
    try:
        cluster_cm = slurm_cluster()
        slurm = cluster_cm.__enter__()
    except SlurmUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    except AssertionError as exc:
        console.print(f"[red]the throwaway Slurm cluster did not start:[/] {exc}")
        return False
    ok = False
    try:
        console.print(
            f"Slurm: slurmctld, slurmd and slurmrestd ({slurm.rest_url}) under {slurm.root}, "
            f"partition {slurm.partition} on node {slurm.host}"
        )
        with LocalCluster(workdir, config=config + PROFILE_TOML) as cluster:
            try:
                cluster.start_coordinator()
                console.print(f"coordinator: api {cluster.endpoints['api']} (TLS)")
                console.print(_create_fleet(cluster, slurm, workdir))
                submit = ["submit", experiment, "--profile", profile, "--yes"]
                console.print(f"$ tp {' '.join(submit)}")
                done = cluster.tp(*submit, cwd=project)
                console.print(done.stdout.rstrip())
                if done.returncode != 0:
                    raise ClusterError(f"tp submit failed: {done.stderr.strip()}")
                history = JobHistory(console, cluster, find_run_id(done.stdout))
                ok = watch(history, timeout)
                if ok:
                    ok = chart(console, cluster, history.run_id, timeout)
                console.print(f"the Job's member folders: {workdir / 'slurm-shared'}")
            except ClusterError as exc:
                console.print(f"[red]demo failed:[/] {exc}")
                if cluster.coordinator is not None:
                    console.print(f"logs of the coordinator: {cluster.coordinator.log_path}")
            console.print("stopping the coordinator ...")
        if cluster.coordinator is not None and cluster.coordinator.alive():
            console.print("[red]the coordinator is still running[/]")
            ok = False
    finally:
        console.print("stopping the Slurm daemons ...")
        cluster_cm.__exit__(None, None, None)
    return ok
