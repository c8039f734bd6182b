"""A real, throwaway Slurm cluster: munged, slurmctld, one slurmd per node and slurmrestd (JWT)
under one temporary folder, stopped by PID. It has one node, this machine, unless the caller
gives it hosts of their own (coordinator/demo/slurm_conf.py's SlurmHost). ``tuneplane demo
--slurm`` runs its Job on it, the tests (tests/support/slurm.py) and ``python -m bench slurm``
theirs.

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
- Readiness is polled with deadlines (every node idle in ``sinfo``, then slurmrestd answering
  on the controller's host), never a fixed sleep; a daemon that exits first fails the fixture
  with its log's tail.
- Missing binaries or a non-root run are :class:`SlurmUnavailable`, with a sentence naming the
  packages (the tests skip on it, or fail under ``CI=true``). Every daemon started is handed to
  the ``track`` hook and, once stopped, to ``untrack`` (the tests' last-resort reaper).
- Each node advertises ``GPUS_PER_NODE`` GPUs (GRES ``gpu`` of type ``GPU_TYPE``, and the node
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
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs

from .slurm_conf import FEATURE as FEATURE
from .slurm_conf import GPU_TYPE as GPU_TYPE
from .slurm_conf import GPUS_PER_NODE as GPUS_PER_NODE
from .slurm_conf import MIN_JOB_AGE_S as MIN_JOB_AGE_S
from .slurm_conf import PARTITION as PARTITION
from .slurm_conf import URGENT_PARTITION as URGENT_PARTITION
from .slurm_conf import SlurmHost as SlurmHost
from .slurm_conf import free_port, gres_conf, slurm_conf, slurmd_log, spool_dir

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


#: slurmrestd answers (its OpenAPI document, 200) at argv[1], for the token in TP_PROBE_TOKEN;
#: run on the controller's host, so it reaches 127.0.0.1 there.
_PROBE = """
import os, sys, urllib.error, urllib.request
request = urllib.request.Request(sys.argv[1], headers={
    "X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": os.environ["TP_PROBE_TOKEN"]})
try:
    with urllib.request.urlopen(request, timeout=2) as response:
        sys.exit(0 if response.status == 200 else 1)
except (OSError, urllib.error.URLError):
    sys.exit(1)
"""


#: Run on a host of its own: set its host name, give it a cgroup root again, then exec the
#: command. ``ip netns exec`` mounts a fresh /sys, where /sys/fs/cgroup is an empty folder, and
#: slurmd's cgroup plugin stops at start without a cgroup v1 root whose ``systemd`` is a cgroup
#: file system. That is mounted again, the machine's own named hierarchy (proctrack/linuxproc
#: and task/none create no cgroup in it).
_ON_HOST = (
    'hostname "$0" && if [ "$(stat -fc %T /sys/fs/cgroup)" = sysfs ]; then '
    "mount -t tmpfs -o mode=755 cgroup_root /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
    "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd; "
    'fi && exec "$@"'
)


def on_host(host: SlurmHost | None, argv: list[str]) -> list[str]:
    """``argv`` run on ``host``: as it is on this machine (None, or a host without a prefix);
    otherwise under the host's prefix, in a UTS namespace of its own whose host name is the
    host's name (``unshare`` and ``sh`` exec, so the pid is the command's own)."""
    if host is None or not host.prefix:
        return argv
    return [*host.prefix, "unshare", "--uts", "sh", "-c", _ON_HOST, host.name, *argv]


def _ignore(proc: subprocess.Popen[bytes]) -> None:
    return None


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as error:
        return f"(no log: {error})"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


@attrs.define(eq=False)
class _Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    out: Path  # what it printed (its log too, for a daemon without a log file)


@attrs.define(eq=False)
class SlurmCluster:
    """The running cluster: its machines, its clients' environment, slurmrestd's URL and
    tokens. Clients and slurmrestd run on the controller's host; ``rest_url`` is reached from
    there (the machine itself, unless the controller has a prefix)."""

    root: Path
    controller: SlurmHost
    nodes: tuple[SlurmHost, ...]
    rest_port: int
    env: dict[str, str]
    daemons: list[_Daemon] = attrs.field(factory=list)
    track: Hook = _ignore
    untrack: Hook = _ignore

    @property
    def host(self) -> str:
        """The first node's name (a one-node cluster's only node)."""
        return self.nodes[0].name

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
        """Run a Slurm client command against this cluster, on the controller's host; its
        stdout."""
        done = subprocess.run(
            [*self.controller.prefix, *args], env=self.env, cwd=self.root, capture_output=True,
            text=True, timeout=CLIENT_TIMEOUT_S,
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

    def start(
        self, name: str, args: list[str], env: dict[str, str], host: SlurmHost | None = None,
        log: Path | None = None,
    ) -> _Daemon:  # fmt: skip
        """Start daemon ``name`` (on ``host``: this machine when None); ``log`` is where it
        writes its log (its captured output when None)."""
        out = self.root / f"{name}.out"
        with out.open("ab") as sink:
            proc = subprocess.Popen(
                on_host(host, args), env=env, cwd=self.root, stdin=subprocess.DEVNULL,
                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.track(proc)
        daemon = _Daemon(name, proc, log or out, out)
        self.daemons.append(daemon)
        return daemon

    def daemon(self, name: str) -> _Daemon:
        return next(d for d in self.daemons if d.name == name)

    def logs(self) -> str:
        """The tail of each daemon's log, and of what it printed when that is not empty (a
        daemon that stops before it opens its log says why there)."""
        parts = []
        for d in self.daemons:
            parts.append(f"--- {d.name} ({d.log.name}):\n{_tail(d.log)}")
            if d.out != d.log and d.out.exists() and d.out.stat().st_size:
                parts.append(f"--- {d.name} ({d.out.name}):\n{_tail(d.out)}")
        return "\n".join(parts)

    def _check_alive(self) -> None:
        for d in self.daemons:
            if d.proc.poll() is not None:
                raise AssertionError(
                    f"{d.name} exited with {d.proc.returncode} while the cluster started:\n"
                    f"{self.logs()}"
                )

    def start_rest(self) -> None:
        """Start slurmrestd (again, after :meth:`stop_rest`) on the controller's host and wait
        until it answers there."""
        env = dict(self.env, SLURM_JWT="daemon")
        self.start(
            "slurmrestd",
            ["slurmrestd", "-f", str(self.conf), "-a", "rest_auth/jwt", "-s", REST_PLUGINS,
             "-u", REST_USER, f"127.0.0.1:{self.rest_port}"],
            env, self.controller,
        )  # fmt: skip
        probe_env = dict(self.env, TP_PROBE_TOKEN=self.token())
        url = f"{self.rest_url}/openapi/v3"
        probe = [*self.controller.prefix, sys.executable, "-c", _PROBE, url]

        def answers() -> bool:
            self._check_alive()
            done = subprocess.run(probe, env=probe_env, capture_output=True, timeout=30)
            return done.returncode == 0

        wait_until(f"slurmrestd on {self.rest_url}", answers, READY_TIMEOUT_S)

    def stop_rest(self, first: signal.Signals = signal.SIGTERM) -> None:
        """Stop slurmrestd alone (``first``, then SIGKILL; SIGKILL first is a crash), leaving
        the cluster running."""
        rest = [d for d in self.daemons if d.name == "slurmrestd"]
        _stop(rest, self.untrack, first)
        for d in rest:
            self.daemons.remove(d)

    def stop(self) -> None:
        _stop(list(reversed(self.daemons)), self.untrack)
        self.daemons.clear()


def _stop(daemons: list[_Daemon], untrack: Hook, first: signal.Signals = signal.SIGTERM) -> None:
    """Send ``first`` to every daemon, then wait for each, SIGKILL past the deadline; by PID
    only."""
    for d in daemons:
        if d.proc.poll() is None:
            d.proc.send_signal(first)
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
    (root / "state").mkdir()
    for node in cluster.nodes:
        spool_dir(root, node.name).mkdir(parents=True)
    (root / "plugstack.conf").write_text("")
    cluster.conf.write_text(slurm_conf(
        root, cluster.controller, cluster.nodes, os.cpu_count() or 1, _memory_mb(), rest,
        min_job_age_s, max_job_count,
    ))  # fmt: skip
    cluster.conf.chmod(0o644)
    # Slurm drops a GPU without a File; empty files under the folder stand in for device nodes
    # (nothing opens them: task/none constrains no devices).
    (root / "dev").mkdir()
    for index in range(GPUS_PER_NODE):
        (root / "dev" / f"gpu{index}").touch()
    gres = root / "gres.conf"
    gres.write_text(gres_conf(cluster.nodes, root / "dev"))
    gres.chmod(0o644)
    cluster.start(
        "munged",
        ["munged", "--foreground", f"--socket={root / 'munge.socket'}", f"--key-file={key}",
         f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
         f"--seed-file={root / 'munged.seed'}"],
        cluster.env, log=root / "munged.log",
    )  # fmt: skip

    def munge_ready() -> bool:
        cluster._check_alive()
        return (root / "munge.socket").exists()

    wait_until("munged's socket", munge_ready, READY_TIMEOUT_S)
    conf = str(cluster.conf)
    # munged's socket is a path, so daemons on other hosts (network namespaces) reach it too.
    cluster.start("slurmctld", ["slurmctld", "-D", "-i", "-f", conf], cluster.env,
                  cluster.controller, root / "slurmctld.log")  # fmt: skip
    for node in cluster.nodes:
        name = "slurmd" if len(cluster.nodes) == 1 else f"slurmd {node.name}"
        cluster.start(name, ["slurmd", "-D", "-f", conf, "-N", node.name], cluster.env, node,
                      slurmd_log(root, node.name))  # fmt: skip
    names = {node.name for node in cluster.nodes}

    def idle() -> bool:
        cluster._check_alive()
        try:
            listed = cluster.client("sinfo", "-h", "-N", "-o", "%N %T")
        except (AssertionError, subprocess.TimeoutExpired):
            return False
        states = dict(line.split() for line in listed.splitlines() if line.strip())
        for name, state in states.items():
            if state.startswith(("drain", "inval", "down")):
                # slurmctld refused the node's registration; waiting longer changes nothing.
                raise AssertionError(
                    f"the Slurm node {name} is {state!r}, not idle:\n{cluster.logs()}"
                )
        return set(states) == names and all(state == "idle" for state in states.values())

    wait_until("every Slurm node to be idle", idle, READY_TIMEOUT_S)
    if rest:
        cluster.start_rest()


@contextmanager
def slurm_cluster(
    track: Hook = _ignore, untrack: Hook = _ignore, *, rest: bool = True,
    min_job_age_s: int = MIN_JOB_AGE_S, max_job_count: int = 0,
    controller: SlurmHost | None = None, nodes: Sequence[SlurmHost] = (),
) -> Iterator[SlurmCluster]:  # fmt: skip
    """A running throwaway cluster, with slurmrestd unless ``rest`` is False
    (:class:`SlurmUnavailable` when this machine cannot run one); every daemon stopped by PID
    and the folder removed on exit. A daemon that does not start is an AssertionError with
    the daemons' logs.

    By default the controller and the one node are this machine (its host name, 127.0.0.1);
    ``controller`` and ``nodes`` put them on other hosts (network namespaces of their own, say:
    the tests' multi-node cluster), which must reach each other by address. munged runs on this
    machine: its socket is a path every host's daemons open."""
    lacking = missing(rest)
    if lacking is not None:
        raise SlurmUnavailable(f"The throwaway Slurm cluster needs {lacking}.")
    root = Path(tempfile.mkdtemp(prefix="tp-slurm-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    here = SlurmHost(socket.gethostname().split(".")[0], "127.0.0.1")
    cluster = SlurmCluster(
        root=root, controller=controller or here, nodes=tuple(nodes) or (here,),
        rest_port=free_port(), env=env, track=track, untrack=untrack,
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
