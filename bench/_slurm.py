"""A throwaway single-node Slurm cluster on this machine: the baseline some bench figures are held
against (issue 13).

Rules: the bench installs nothing. When ``slurmctld``, ``slurmd``, ``srun``, ``sbatch``,
``scancel``, ``sinfo`` and ``munged`` are all on PATH and the bench runs as root,
:func:`slurm_cluster` starts, under one temporary folder, a ``munged`` with its own key and socket,
then ``slurmctld`` and ``slurmd`` (foreground, as its children) on free ports with a ``slurm.conf``
of one node (this machine's CPUs) and one default partition, ``proctrack/linuxproc`` and
``task/none`` (no cgroups, no accounting), and waits (with a deadline, never a fixed sleep) for
``sinfo`` to show the node idle. Otherwise it prints one sentence naming what is missing and how
to install it, and yields None: the caller prints its own figures alone. A daemon that does not
start (exits, or the node is not idle in time) gets its log's tail printed and the same None. On
exit the three daemons are stopped by their PIDs (SIGTERM, then SIGKILL after a deadline) and
the folder is removed. Clients get the cluster's ``SLURM_CONF`` and none of the caller's
``SLURM_*`` variables, so a bench run inside a Slurm job never talks to that job's cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scancel", "sinfo", "squeue")
INSTALL = "apt-get install slurm-wlm munge"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
CLIENT_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 15
# Job ids per scancel call: far below any argv limit.
CANCEL_BATCH = 500


def missing() -> list[str]:
    """What this machine lacks to run the cluster (empty: nothing)."""
    lacking = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if os.geteuid() != 0:
        lacking.append("root (slurmd launches jobs as their users)")
    return lacking


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _real_memory_mb() -> int:
    """A modest RealMemory: at most 1 GiB, never more than the machine has."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return max(1, min(1024, total // 2))


def _conf(root: Path, host: str, cpus: int) -> str:
    return "\n".join(
        [
            "ClusterName=tpbench",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge.socket'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            # Finished and cancelled jobs leave slurmctld's table soon, so one measurement's
            # jobs do not weigh on the next.
            "MinJobAge=2",
            # Slurm's default table holds 10,000 jobs; the admissions bench queues more.
            "MaxJobCount=50000",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd.log'}",
            f"PlugStackConfig={root / 'plugstack.conf'}",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} "
            f"RealMemory={_real_memory_mb()} State=UNKNOWN",
            f"PartitionName=bench Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as error:
        return f"    (no log: {error})"
    return "\n".join(f"    {line}" for line in lines[-LOG_TAIL_LINES:]) or "    (empty log)"


class SlurmCluster:
    """The running cluster: its clients' environment and the measurements the bench takes."""

    def __init__(self, root: Path, host: str, cpus: int) -> None:
        self.root = root
        self.host = host
        self.cpus = cpus
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(root / "slurm.conf")
        self.held: list[str] = []

    def client(self, *args: str) -> str:
        """Run a Slurm client command against this cluster; its stdout."""
        done = subprocess.run(
            args, env=self.env, cwd=self.root, capture_output=True, text=True,
            timeout=CLIENT_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def srun(self, processes: int) -> float:
        """Seconds of ``srun -n<processes> [--overcommit] true``, from start to exit."""
        over = ["--overcommit"] if processes > 1 else []
        started = time.perf_counter()
        self.client("srun", f"-n{processes}", *over, "true")
        return time.perf_counter() - started

    def _sbatch(self) -> str:
        out = self.client("sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "true")
        return out.strip().split(";")[0]

    def sbatch_rate(self, jobs: int, parallel: int) -> float:
        """Jobs accepted per second by ``sbatch --hold --wrap true``: ``parallel`` submitters
        (1: a loop), ``jobs`` in all, after one unmeasured sbatch. Held, so they stay queued as
        the bench's admitted TunePlane Jobs do and none runs on this machine's CPUs meanwhile;
        every one (the unmeasured one too) stays until :meth:`cancel_held`."""
        self.held.append(self._sbatch())
        started = time.perf_counter()
        self.queue_held(jobs, parallel)
        return jobs / (time.perf_counter() - started)

    def queue_held(self, jobs: int, parallel: int = 8) -> None:
        """Submit ``jobs`` held jobs, ``parallel`` at a time, left queued until
        :meth:`cancel_held`."""
        if parallel <= 1:
            self.held.extend(self._sbatch() for _ in range(jobs))
        else:
            with ThreadPoolExecutor(parallel) as pool:
                self.held.extend(pool.map(lambda _: self._sbatch(), range(jobs)))

    def cancel_held(self) -> None:
        """Cancel every job :meth:`sbatch_rate` and :meth:`queue_held` left queued."""
        for i in range(0, len(self.held), CANCEL_BATCH):
            self.client("scancel", *self.held[i : i + CANCEL_BATCH])
        self.held.clear()

    def pending(self) -> int:
        """Jobs pending now (squeue)."""
        return len(self.client("squeue", "-h", "-t", "PD", "-o", "%i").split())

    def node_state(self) -> str:
        return self.client("sinfo", "-h", "-n", self.host, "-o", "%T").strip()


class _Daemons:
    """The processes this module started, stopped by PID in reverse order."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        with open(self.root / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(
                args, env=env, cwd=self.root, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.procs.append((name, proc))

    def exited(self) -> str | None:
        """The first daemon that has exited, if any."""
        return next((name for name, proc in self.procs if proc.poll() is not None), None)

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self, name: str) -> str:
        """The tail of a daemon's log file, or of its output when it wrote no log."""
        log, out = self.root / f"{name}.log", self.root / f"{name}.out"
        path = log if log.exists() and log.stat().st_size else out
        return f"  {path.name}:\n{_tail(path)}"


def _start(root: Path, daemons: _Daemons) -> SlurmCluster | None:
    host = socket.gethostname().split(".")[0]
    cluster = SlurmCluster(root, host, os.cpu_count() or 1)
    # munged wants every folder above its socket searchable by all, and its key private.
    root.chmod(0o711)
    key = root / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    (root / "plugstack.conf").write_text("")
    (root / "slurm.conf").write_text(_conf(root, host, cluster.cpus))
    daemons.start(
        "munged",
        [
            "munged", "--foreground", f"--socket={root / 'munge.socket'}",
            f"--key-file={key}", f"--pid-file={root / 'munged.pid'}",
            f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munged.seed'}",
        ],
        cluster.env,
    )  # fmt: skip
    if not _wait(lambda: (root / "munge.socket").exists(), daemons):
        _failed("munged", daemons)
        return None
    conf = str(root / "slurm.conf")
    daemons.start("slurmctld", ["slurmctld", "-D", "-i", "-f", conf], cluster.env)
    daemons.start("slurmd", ["slurmd", "-D", "-f", conf, "-N", host], cluster.env)

    def idle() -> bool:
        try:
            return cluster.node_state() == "idle"
        except (RuntimeError, subprocess.TimeoutExpired):
            return False

    if not _wait(idle, daemons):
        _failed(daemons.exited() or "slurmd", daemons, also="slurmctld")
        return None
    try:  # an idle node that cannot launch (credentials, slurmstepd) fails here, not mid-bench
        cluster.srun(1)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"Slurm baseline skipped: srun -n1 true failed on the throwaway cluster: {error}")
        print(daemons.logs("slurmd"))
        return None
    return cluster


def _wait(ready: Callable[[], bool], daemons: _Daemons) -> bool:
    """Poll ``ready`` until it holds (True), a daemon exits or the deadline passes (False)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemons.exited() is not None:
            return False
        if ready():
            return True
        time.sleep(0.1)
    return False


def _failed(name: str, daemons: _Daemons, also: str = "") -> None:
    exited = daemons.exited()
    why = f"{exited} exited" if exited else f"not ready within {READY_TIMEOUT_S:g} s"
    print(f"Slurm baseline skipped: the throwaway cluster did not start ({why}).")
    for which in dict.fromkeys([name, also]):
        if which:
            print(daemons.logs(which))


@contextmanager
def slurm_cluster() -> Iterator[SlurmCluster | None]:
    """A throwaway single-node Slurm cluster, or None (with the reason printed) when this
    machine cannot run one; stopped and removed on exit."""
    lacking = missing()
    if lacking:
        print(
            f"Slurm baseline skipped: this machine lacks {', '.join(lacking)}; to compare "
            f"against real Slurm, install it as root with `{INSTALL}` (Debian, Ubuntu) and run "
            "the bench as root."
        )
        yield None
        return
    root = Path(tempfile.mkdtemp(prefix="tp-bench-slurm-"))
    daemons = _Daemons(root)
    try:
        cluster = _start(root, daemons)
        sys.stdout.flush()
        yield cluster
    finally:
        daemons.stop()
        shutil.rmtree(root, ignore_errors=True)
