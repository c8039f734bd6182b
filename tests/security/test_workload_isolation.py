"""A workload tries to reach the Node: its credentials, its journal, another member's files and
collector credential, the agent's environment. Under the account pool every read is refused by
the kernel (EACCES); under the bubblewrap sandbox none of it even exists (ENOENT). Nothing the
attacker tried changes the victim Job, the GPUs, the Node's files or its session.

Real processes throughout: a coordinator and an agent on loopback TLS, real Unix accounts
(root only), the distribution's bubblewrap.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.agent.jobs import job, journal, tp, wait_job
from tests.cli.tp_process import run_tp_as
from tests.faults.jobs import held_gpus, wait_state
from tests.support import accounts
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow

CANARY = "AGENT_ONLY_CANARY"
CANARY_VALUE = "the-agent-environment-must-not-leak"
# What a member's environment may hold besides TUNEPLANE_*: what TunePlane sets, the Job's env,
# and what bash (which runs train.sh) adds for itself.
ALLOWED_ENV = {
    "HOME", "LANG", "PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT",
    "NNODES", "NODE_RANK", "NPROC_PER_NODE", "JOB_SETTING", "PWD", "SHLVL", "_",
    # The interface that routes to the rendezvous, and where TensorBoard files are collected.
    "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TENSORBOARD_LOGDIR", "AIP_TENSORBOARD_LOG_DIR",
}  # fmt: skip

# The victim writes secrets into its work and output directories, then waits to be released.
VICTIM = """\
echo victim-secret > secret.txt
echo victim-secret > "$TUNEPLANE_OUT_DIR/secret.txt"
id -u > "$TUNEPLANE_OUT_DIR/uid"
for i in $(seq 1200); do [ -e release ] && exit 0; sleep 0.1; done
exit 3
"""

# The attacker tries every path it is given and records what the kernel said.
ATTACKER = """\
python3 - <<'PY'
import json, os
targets = json.loads(open("targets.json").read())
found = {}
for name, path in targets.items():
    try:
        if os.path.isdir(path):
            found[name] = "LISTED " + ",".join(sorted(os.listdir(path)))
        else:
            with open(path, "rb") as fh:
                found[name] = "READ " + fh.read(200).decode("utf-8", "replace")
    except OSError as exc:
        found[name] = "errno " + str(exc.errno)
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines()
              if ":\t" in line)
report = {"found": found, "env": dict(os.environ), "uid": os.getuid(), "gid": os.getgid(),
          "groups": os.getgroups(), "cwd": os.getcwd(),
          "no_new_privs": status["NoNewPrivs"].strip(), "cap_eff": status["CapEff"].strip(),
          "cap_prm": status["CapPrm"].strip()}
with open(os.path.join(os.environ["TUNEPLANE_OUT_DIR"], "attack.json"), "w") as fh:
    json.dump(report, fh)
PY
"""

WAITS_FOR_GO = """\
echo up > "$TUNEPLANE_OUT_DIR/up"
for i in $(seq 600); do [ -e go ] && exit 0; sleep 0.1; done
"""

TRAPS_TERM = """\
trap 'echo stopped-gracefully > "$TUNEPLANE_OUT_DIR/term"; exit 0' TERM
echo up > "$TUNEPLANE_OUT_DIR/up"
while true; do sleep 0.1; done
"""


def _project(coord: CoordinatorProcess, root: Path, files: dict[str, str]) -> Path:
    root.mkdir()
    tp(coord, "init", str(root), "--name", "iso", cwd=root)
    tp(coord, "new", "job", "--method", "custom/custom", cwd=root)
    for name, text in files.items():
        (root / "experiments" / "job" / name).write_text(text)
    return root


def _submit(coord: CoordinatorProcess, root: Path, *extra: str) -> str:
    out = tp(coord, "submit", "job", "--profile", "h200:1", "--yes", "--json", *extra, cwd=root)
    return str(json.loads(out.strip().splitlines()[-1])["run_id"])


def _member(agent: AgentProcess, run_id: str) -> dict[str, Any]:
    rows = [m for m in journal(agent, "members", "--json") if m["run_id"] == run_id]
    assert len(rows) == 1, rows
    member: dict[str, Any] = rows[0]
    return member


def _lease(agent: AgentProcess, member: dict[str, Any]) -> dict[str, Any]:
    path = agent.state_dir / "members" / member["member"] / "account.json"
    lease: dict[str, Any] = json.loads(path.read_text())
    return lease


def _started(
    coord: CoordinatorProcess, agent: AgentProcess, root: Path, script: str
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Submit ``script`` (one that writes ``up`` first) from a new project at ``root``, wait
    until it is running and has written ``up``; return its run id, member row and account lease.
    """
    run_id = _submit(coord, _project(coord, root, {"train.sh": script}))
    wait_state(coord, run_id, "running", 60)
    member = _member(agent, run_id)
    out = Path(member["out_dir"])
    wait_until("the workload to start", lambda: (out / "up").exists(), 60)
    return run_id, member, _lease(agent, member)


def _processes_of(uid: int) -> list[str]:
    """What still runs as ``uid``: pid, name, status and parent of each (zombies included)."""
    found = []
    for proc in psutil.process_iter(["uids", "name", "status", "ppid", "cmdline"]):
        if proc.info["uids"] is not None and proc.info["uids"].real == uid:
            found.append(f"{proc.pid} {proc.info['name']} {proc.info['status']} "
                         f"ppid={proc.info['ppid']} {proc.info['cmdline']}")  # fmt: skip
    return found


@pytest.fixture(scope="module", params=["pool", "bwrap"])
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, CoordinatorProcess, AgentProcess]]:
    accounts.require_root()
    mode = str(request.param)
    if mode == "bwrap":
        has_bwrap = shutil.which("bwrap") is not None
        accounts.require(has_bwrap, "bubblewrap (apt-get install bubblewrap)")
    root = tmp_path_factory.mktemp(f"iso-{mode}")
    settings = 'isolation = "bwrap"\n' if mode == "bwrap" else ""
    with start_coordinator(root) as coord:
        agent = start_agent(
            root, coord, "node-a", "h200:2", env={CANARY: CANARY_VALUE}, node_toml=settings
        )
        try:
            agent.wait_connected()
            yield mode, coord, agent
        finally:
            agent.stop()


def test_a_workload_reaches_nothing_of_the_node(
    node: tuple[str, CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    mode, coord, agent = node
    victim_id = _submit(coord, _project(coord, tmp_path / "victim", {"train.sh": VICTIM}))
    wait_state(coord, victim_id, "running", 60)
    victim = _member(agent, victim_id)
    victim_lease = _lease(agent, victim)
    victim_out, victim_work = Path(victim["out_dir"]), Path(victim_lease["work_dir"])
    wait_until("the victim's secrets", lambda: (victim_out / "uid").exists(), 60)
    state = agent.state_dir
    token_before = agent.control_token()
    gpus_before = [g for g in held_gpus(agent) if g["member"] == victim["member"]]
    control = state / "members" / victim["member"]

    targets = {
        "control credential": str(state / "credentials" / "control.token"),
        "journal": str(state / "journal.db"),
        "state directory": str(state),
        "victim member.json": str(control / "member.json"),
        "victim stdout": str(control / "stdout.log"),
        "victim collector credential": str(state / "collectors" / victim["member"] / "credential"),
        "victim work secret": str(victim_work / "secret.txt"),
        "victim work dir": str(victim_work),
        "victim output secret": str(victim_out / "secret.txt"),
        "victim output dir": str(victim_out),
    }
    files = {"train.sh": ATTACKER, "targets.json": json.dumps(targets)}
    attacker_root = _project(coord, tmp_path / "attacker", files)
    attacker_id = _submit(coord, attacker_root, "--env", "JOB_SETTING=from-the-job")
    done = wait_job(coord, attacker_id, 90)
    assert done["state"] == "succeeded", done
    attacker = _member(agent, attacker_id)
    report = json.loads((Path(attacker["out_dir"]) / "attack.json").read_text())

    # Every attempt was refused by the kernel, none read. In the sandbox the state directory
    # is an empty tmpfs: nothing under it exists.
    expected = errno.ENOENT if mode == "bwrap" else errno.EACCES
    for name, outcome in report["found"].items():
        if mode == "bwrap" and name == "state directory":
            assert outcome == "LISTED ", f"{name}: {outcome}"
        else:
            assert outcome == f"errno {expected}", f"{name}: {outcome}"
    # It ran as its own pool account: not root, not the victim's, in no root group.
    lease = _lease(agent, attacker)
    assert lease["mode"] == "pool" and lease["account"] in agent.pool
    assert report["uid"] == lease["uid"] != 0 and report["uid"] != victim_lease["uid"]
    assert report["gid"] != 0 and 0 not in report["groups"]
    # No capability left, and no exec can bring privileges back (setuid programs included).
    assert report["no_new_privs"] == "1"
    assert int(report["cap_eff"], 16) == 0 and int(report["cap_prm"], 16) == 0
    assert report["cwd"] == lease["work_dir"] and not lease["work_dir"].startswith(str(state))
    # Its environment is the allow-list, nothing of the agent's.
    names = set(report["env"])
    assert {n for n in names - ALLOWED_ENV if not n.startswith("TUNEPLANE_")} == set()
    assert CANARY not in report["env"] and CANARY_VALUE not in json.dumps(report["env"])
    assert report["env"]["JOB_SETTING"] == "from-the-job"
    assert report["env"]["HOME"] == lease["work_dir"]
    assert report["env"]["PATH"] == "/usr/local/bin:/usr/bin:/bin"

    # Nothing changed for the victim, its GPU or the Node.
    assert job(coord, victim_id)["state"] == "running"
    assert _member(agent, victim_id)["state"] == "running"
    assert (victim_out / "secret.txt").read_text() == "victim-secret\n"
    assert (victim_work / "secret.txt").read_text() == "victim-secret\n"
    assert agent.control_token() == token_before
    assert [g for g in held_gpus(agent) if g["member"] == victim["member"]] == gpus_before
    assert agent.status().get("connected")

    # The victim ends normally; its account is taken back: no process left, files back to root.
    (victim_work / "release").touch()
    assert wait_job(coord, victim_id, 60)["state"] == "succeeded"
    assert _processes_of(int(victim_lease["uid"])) == []
    assert victim_work.stat().st_uid == 0 and victim_out.stat().st_uid == 0


def test_directories_are_private_to_the_member_account(
    node: tuple[str, CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    _, coord, agent = node
    run_id, member, lease = _started(coord, agent, tmp_path / "p", WAITS_FOR_GO)
    work, out = Path(lease["work_dir"]), Path(member["out_dir"])
    for folder in (work, out):
        info = folder.stat()
        assert (info.st_uid, info.st_mode & 0o777) == (lease["uid"], 0o700), folder
    control = agent.state_dir / "members" / member["member"]
    for folder in (agent.state_dir, control, agent.state_dir / "credentials"):
        info = folder.stat()
        assert (info.st_uid, info.st_mode & 0o777) == (0, 0o700), folder
    assert (control / "account.json").stat().st_mode & 0o777 == 0o600
    # Above its own folders, members can pass but not list: no other Job's name shows.
    for folder in (agent.work_root, agent.out_root, out.parent, out.parent.parent):
        info = folder.stat()
        assert (info.st_uid, info.st_mode & 0o777) == (0, 0o711), folder
    (work / "go").touch()
    assert wait_job(coord, run_id, 60)["state"] == "succeeded"


def test_cancel_reaches_the_workload_with_its_grace_period(
    node: tuple[str, CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    _, coord, agent = node
    run_id, member, lease = _started(coord, agent, tmp_path / "p", TRAPS_TERM)
    out, uid = Path(member["out_dir"]), int(lease["uid"])
    tp(coord, "job", "cancel", run_id)
    assert wait_job(coord, run_id, 60)["state"] == "cancelled"
    assert (out / "term").read_text() == "stopped-gracefully\n"
    assert _processes_of(uid) == []
    assert not any(g["member"] == member["member"] for g in held_gpus(agent))


def test_a_loader_variable_in_the_jobs_env_is_refused(
    node: tuple[str, CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    _, coord, agent = node
    files = {"train.sh": 'touch "$TUNEPLANE_OUT_DIR/ran"\n'}
    root = _project(coord, tmp_path / "p", files)
    token_before = agent.control_token()
    try:
        run_id = _submit(coord, root, "--env", "LD_PRELOAD=/tmp/evil.so")
    except AssertionError as refused:
        # The coordinator may refuse it at Preview already; then no Node ever saw it.
        assert "LD_PRELOAD" in str(refused)
        return
    done = wait_job(coord, run_id, 60)
    assert done["state"] in ("aborted", "failed"), done
    member = _member(agent, run_id)
    assert member["state"] == "aborted" and "LD_PRELOAD" in member["reason"]
    assert not (Path(member["out_dir"]) / "ran").exists()
    assert not any(g["member"] == member["member"] for g in held_gpus(agent))
    assert agent.control_token() == token_before


def test_a_member_survives_an_agent_crash_and_is_reattached(
    node: tuple[str, CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    _, coord, agent = node
    run_id, _, lease = _started(coord, agent, tmp_path / "p", WAITS_FOR_GO)
    work = Path(lease["work_dir"])
    agent.kill()
    agent.start()
    agent.wait_connected()
    assert _member(agent, run_id)["state"] == "running"
    assert job(coord, run_id)["state"] == "running"
    (work / "go").touch()
    done = wait_job(coord, run_id, 60)
    assert done["state"] == "succeeded", done


WHO_AM_I = 'id -un > "$TUNEPLANE_OUT_DIR/who"\nid -u > "$TUNEPLANE_OUT_DIR/uid"\n'


def _submit_as(coord: CoordinatorProcess, root: Path, token: Path) -> str:
    """Submit the project at ``root`` with the user token in ``token``; return its run id."""
    done = run_tp_as(
        coord, token, "submit", "job", "--profile", "h200:1", "--yes", "--json", cwd=root
    )
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout.strip().splitlines()[-1])["run_id"])


def test_user_mode_runs_each_job_as_its_submitters_local_account(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    accounts.require_root()
    root = tmp_path_factory.mktemp("iso-user")
    (local,) = accounts.make_pool(1)
    settings = '[accounts]\nmode = "user"\n'
    with start_coordinator(root) as coord:
        agent = start_agent(root, coord, "node-u", "h200:2", node_toml=settings)
        try:
            agent.wait_connected()
            # A TunePlane user with a local account of the same name: the Job runs as it.
            token = coord.user_token_file(local, root)
            mine = _project(coord, root / "mine", {"train.sh": WHO_AM_I})
            run_id = _submit_as(coord, mine, token)
            assert wait_job(coord, run_id, 60)["state"] == "succeeded"
            member = _member(agent, run_id)
            out = Path(member["out_dir"])
            assert (out / "who").read_text().strip() == local
            assert _lease(agent, member)["mode"] == "user"
            # Its files stay the user's own after the Job.
            assert out.stat().st_uid == int((out / "uid").read_text())
            # A user with no local account here is refused at Prepare, and nothing changed.
            stranger = coord.user_token_file("nolocalaccount", root)
            theirs = _project(coord, root / "theirs", {"train.sh": WHO_AM_I})
            refused_id = _submit_as(coord, theirs, stranger)
            assert wait_job(coord, refused_id, 60)["state"] in ("aborted", "failed")
            refused = _member(agent, refused_id)
            assert refused["state"] == "aborted"
            assert "nolocalaccount has no local account on this Node" in refused["reason"]
            assert not Path(refused["out_dir"]).exists()
            assert held_gpus(agent) == []
        finally:
            agent.stop()
