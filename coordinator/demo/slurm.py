"""A real, throwaway single-node Slurm cluster: munged, slurmctld, slurmd and slurmrestd (JWT)
under one temporary folder, stopped by PID. ``tuneplane demo --slurm`` runs its Job on it, the
tests (tests/support/slurm.py) and ``python -m bench slurm`` theirs.

Rules:
- Everything the daemons read or write (slurm.conf, gres.conf, the munge and JWT keys, state,
  spool, logs, sockets) is under the fixture's own folder, made with ``tempfile.mkdtemp`` in the
  system's temporary directory (slurmrestd runs as ``nobody`` and must pass through it; pytest's
  own folders are 0700 root) and removed at teardown. Clients get that ``slurm.conf`` through
  ``SLURM_CONF`` and none of the caller's ``SLURM_*`` variables; nothing under /etc is read for
  Slurm or written.
- The daemons run as root (slurmd launches jobs as their users) except slurmrestd, which refuses
  root and is started with ``-u nobody``; it authenticates clients by JWT (``SLURM_JWT=daemon``,
  ``AuthAltTypes=auth/jwt`` with a key under the folder). Tokens come from ``scontrol token``.
- Readiness is polled with deadlines (the node idle in ``sinfo``, then slurmrestd answering a
  ping), never a fixed sleep; a daemon that exits first fails the fixture with its log's tail.
- Missing binaries or a non-root run are :class:`SlurmUnavailable`, with a sentence naming the
  packages (the tests skip on it, or fail under ``CI=true``). Every daemon started is handed to
  the ``track`` hook and, once stopped, to ``untrack`` (the tests' last-resort reaper).
- The node advertises ``GPUS_PER_NODE`` GPUs (GRES ``gpu`` of type ``GPU_TYPE``, and the node
  feature ``FEATURE``) whose ``File=`` are empty files under
  the folder: Slurm drops a GPU without a File, logs that these are not devices, and counts them;
  with ``task/none`` nothing opens them. Node listings see GPUs on a machine that has none.
- slurmrestd loads only the ``openapi/v0.0.3x`` plugins (``-s``): the ``dbv0.0.3x`` ones need
  slurmdbd, which this cluster does not run, and stop slurmrestd at start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import httpx

#: What the cluster runs; Debian's slurm-wlm (slurmctld, slurmd, slurm-client), slurmrestd and
#: munge install them (the noxfile's ``wanted`` installs the same packages under CI). The
#: bench's clusters without slurmrestd (bench/_slurm.py) need the first list alone.
BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "srun", "sbatch", "scancel",
            "squeue")  # fmt: skip
REST_BINARIES = ("slurmrestd",)
JWT_PLUGIN = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm/auth_jwt.so")
INSTALL = "apt-get install slurm-wlm slurmrestd slurm-wlm-jwt-plugin munge"
INSTALL_WITHOUT_REST = "apt-get install slurm-wlm munge"
REST_USER = "nobody"
REST_PLUGINS = "openapi/v0.0.36,openapi/v0.0.37,openapi/v0.0.38"
PARTITION = "tp"
GPUS_PER_NODE = 2
#: The node's GPUs are the gpu GRES of this type, and it has this node feature.
GPU_TYPE = "h200"
FEATURE = "tpnode"
#: How long slurmctld keeps an ended job (the tests read their ends; the bench wants them gone).
MIN_JOB_AGE_S = 300
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
CLIENT_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 25


Hook = Callable[["subprocess.Popen[bytes]"], None]


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the throwaway cluster; ``str()`` says what is missing."""


def missing(rest: bool = True) -> str | None:
    """What this machine lacks to run the throwaway cluster (with slurmrestd unless ``rest`` is
    False), as a phrase; None when nothing."""
    wanted = (*BINARIES, *REST_BINARIES) if rest else BINARIES
    lacking = [binary for binary in wanted if shutil.which(binary) is None]
    if rest and not JWT_PLUGIN.exists():
        lacking.append(str(JWT_PLUGIN))
    if lacking:
        what = "with slurmrestd and JWT " if rest else ""
        return (
            f"a local Slurm {what}({', '.join(lacking)} missing); install them as root with "
            f"`{INSTALL if rest else INSTALL_WITHOUT_REST}`"
        )
    if os.geteuid() != 0:
        return "root (slurmd launches jobs as their users)"
    return None


def wait_until(what: str, check: Callable[[], bool], timeout: float) -> None:
    """Poll ``check()`` until it holds; AssertionError naming ``what`` past ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def _ignore(proc: subprocess.Popen[bytes]) -> None:
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as error:
        return f"(no log: {error})"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


def slurm_conf(
    root: Path, host: str, cpus: int, memory_mb: int, rest: bool = True,
    min_job_age_s: int = MIN_JOB_AGE_S, max_job_count: int = 0,
) -> str:  # fmt: skip
    """The cluster's slurm.conf: one node, one default partition, JWT as the alternative
    authentication (for slurmrestd, when ``rest``), no cgroups and no accounting (as root on a
    plain machine). ``max_job_count`` 0 keeps Slurm's default (10,000 jobs)."""
    jwt = [
        "AuthAltTypes=auth/jwt",
        f"AuthAltParameters=jwt_key={root / 'jwt.key'}",
    ]
    return "\n".join(
        [
            "ClusterName=tptest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge.socket'}",
            *(jwt if rest else []),
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "GresTypes=gpu",
            "MpiDefault=none",
            "ReturnToService=2",
            # Finished jobs stay in slurmctld's table long enough for a test to read their end.
            f"MinJobAge={min_job_age_s}",
            *([f"MaxJobCount={max_job_count}"] if max_job_count else []),
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd.log'}",
            f"PlugStackConfig={root / 'plugstack.conf'}",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} "
            f"Gres=gpu:{GPU_TYPE}:{GPUS_PER_NODE} Features={FEATURE} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@attrs.define(eq=False)
class _Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@attrs.define(eq=False)
class SlurmCluster:
    """The running cluster: its clients' environment, slurmrestd's URL and tokens."""

    root: Path
    host: str
    rest_port: int
    env: dict[str, str]
    daemons: list[_Daemon] = attrs.field(factory=list)
    track: Hook = _ignore
    untrack: Hook = _ignore

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def partition(self) -> str:
        return PARTITION

    def client(self, *args: str) -> str:
        """Run a Slurm client command against this cluster; its stdout."""
        done = subprocess.run(
            args, env=self.env, cwd=self.root, capture_output=True, text=True,
            timeout=CLIENT_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
            )
        return done.stdout

    def token(self, user: str = "root", lifespan_s: int = 3600) -> str:
        """A JWT for ``user`` from ``scontrol token``."""
        out = self.client("scontrol", "token", f"username={user}", f"lifespan={lifespan_s}")
        for line in out.splitlines():
            if line.startswith("SLURM_JWT="):
                return line.removeprefix("SLURM_JWT=").strip()
        raise AssertionError(f"scontrol token printed no SLURM_JWT line: {out!r}")

    def start(self, name: str, args: list[str], env: dict[str, str]) -> _Daemon:
        out = self.root / f"{name}.out"
        with out.open("ab") as sink:
            proc = subprocess.Popen(
                args, env=env, cwd=self.root, stdin=subprocess.DEVNULL, stdout=sink,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.track(proc)
        log = self.root / f"{name}.log"
        daemon = _Daemon(name, proc, log if name in ("munged", "slurmctld", "slurmd") else out)
        self.daemons.append(daemon)
        return daemon

    def daemon(self, name: str) -> _Daemon:
        return next(d for d in self.daemons if d.name == name)

    def logs(self) -> str:
        return "\n".join(f"--- {d.name} ({d.log.name}):\n{_tail(d.log)}" for d in self.daemons)

    def _check_alive(self) -> None:
        for d in self.daemons:
            if d.proc.poll() is not None:
                raise AssertionError(
                    f"{d.name} exited with {d.proc.returncode} while the cluster started:\n"
                    f"{self.logs()}"
                )

    def start_rest(self) -> None:
        """Start slurmrestd (again, after :meth:`stop_rest`) and wait until it answers."""
        env = dict(self.env, SLURM_JWT="daemon")
        self.start(
            "slurmrestd",
            ["slurmrestd", "-f", str(self.conf), "-a", "rest_auth/jwt", "-s", REST_PLUGINS,
             "-u", REST_USER, f"127.0.0.1:{self.rest_port}"],
            env,
        )  # fmt: skip
        token = self.token()

        def answers() -> bool:
            self._check_alive()
            try:
                response = httpx.get(
                    f"{self.rest_url}/openapi/v3",
                    headers={"X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": token},
                    timeout=2,
                )
            except httpx.TransportError:
                return False
            return response.status_code == 200

        wait_until(f"slurmrestd on {self.rest_url}", answers, READY_TIMEOUT_S)

    def stop_rest(self) -> None:
        """Stop slurmrestd alone (SIGTERM, then SIGKILL), leaving the cluster running."""
        rest = [d for d in self.daemons if d.name == "slurmrestd"]
        _stop(rest, self.untrack)
        for d in rest:
            self.daemons.remove(d)

    def stop(self) -> None:
        _stop(list(reversed(self.daemons)), self.untrack)
        self.daemons.clear()


def _stop(daemons: list[_Daemon], untrack: Hook) -> None:
    """SIGTERM every daemon, then wait for each, SIGKILL past the deadline; by PID only."""
    for d in daemons:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
    for d in daemons:
        try:
            d.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
        untrack(d.proc)


def _memory_mb() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return max(1, min(1024, total // 2))


def _start(cluster: SlurmCluster, rest: bool, min_job_age_s: int, max_job_count: int) -> None:
    root = cluster.root
    # munged wants every folder above its socket searchable by all and its key private;
    # slurmrestd (as nobody) reads slurm.conf.
    root.chmod(0o711)
    key = root / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    jwt = root / "jwt.key"
    jwt.write_bytes(os.urandom(32))
    jwt.chmod(0o600)
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    (root / "plugstack.conf").write_text("")
    cluster.conf.write_text(slurm_conf(root, cluster.host, os.cpu_count() or 1, _memory_mb(),
                                       rest, min_job_age_s, max_job_count))  # fmt: skip
    cluster.conf.chmod(0o644)
    gres = root / "gres.conf"
    # Slurm drops a GPU without a File; empty files under the folder stand in for device nodes
    # (nothing opens them: task/none constrains no devices).
    (root / "dev").mkdir()
    for index in range(GPUS_PER_NODE):
        (root / "dev" / f"gpu{index}").touch()
    files = f"{root / 'dev'}/gpu[0-{GPUS_PER_NODE - 1}]"
    gres.write_text(f"NodeName={cluster.host} Name=gpu Type={GPU_TYPE} File={files}\n")
    gres.chmod(0o644)
    cluster.start(
        "munged",
        ["munged", "--foreground", f"--socket={root / 'munge.socket'}", f"--key-file={key}",
         f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
         f"--seed-file={root / 'munged.seed'}"],
        cluster.env,
    )  # fmt: skip

    def munge_ready() -> bool:
        cluster._check_alive()
        return (root / "munge.socket").exists()

    wait_until("munged's socket", munge_ready, READY_TIMEOUT_S)
    conf = str(cluster.conf)
    cluster.start("slurmctld", ["slurmctld", "-D", "-i", "-f", conf], cluster.env)
    cluster.start("slurmd", ["slurmd", "-D", "-f", conf, "-N", cluster.host], cluster.env)

    def idle() -> bool:
        cluster._check_alive()
        try:
            state = cluster.client("sinfo", "-h", "-n", cluster.host, "-o", "%T").strip()
        except (AssertionError, subprocess.TimeoutExpired):
            return False
        if state.startswith(("drain", "inval", "down")):
            # slurmctld refused the node's registration; waiting longer changes nothing.
            raise AssertionError(f"the Slurm node is {state!r}, not idle:\n{cluster.logs()}")
        return state == "idle"

    wait_until("the Slurm node to be idle", idle, READY_TIMEOUT_S)
    if rest:
        cluster.start_rest()


@contextmanager
def slurm_cluster(
    track: Hook = _ignore, untrack: Hook = _ignore, *, rest: bool = True,
    min_job_age_s: int = MIN_JOB_AGE_S, max_job_count: int = 0,
) -> Iterator[SlurmCluster]:  # fmt: skip
    """A running throwaway cluster, with slurmrestd unless ``rest`` is False
    (:class:`SlurmUnavailable` when this machine cannot run one); every daemon stopped by PID
    and the folder removed on exit. A daemon that does not start is an AssertionError with
    the daemons' logs."""
    lacking = missing(rest)
    if lacking is not None:
        raise SlurmUnavailable(f"The throwaway Slurm cluster needs {lacking}.")
    root = Path(tempfile.mkdtemp(prefix="tp-slurm-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    cluster = SlurmCluster(
        root=root, host=socket.gethostname().split(".")[0], rest_port=_free_port(), env=env,
        track=track, untrack=untrack,
    )  # fmt: skip
    try:
        try:
            _start(cluster, rest, min_job_age_s, max_job_count)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{cluster.logs()}") from None
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
