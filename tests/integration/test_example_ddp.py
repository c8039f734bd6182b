"""The PyTorch DDP example (examples/pytorch-ddp) runs as a researcher runs it: copied as it is,
submitted with `tp` to a real coordinator as 2 members x 2 GPUs (four gloo ranks on two Nodes),
and the loss curve its rank 0 writes with torch's own SummaryWriter, into a directory of its
own under $TUNEPLANE_OUT_DIR, is in `tp metrics` exactly once, with no wrapper and no TunePlane
import in the script.

The Nodes run `host:python3` as an operator would give researchers torch: a [runtimes.python3]
of node.toml naming a virtual environment that has it (here one that sees this test run's torch).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import tp, wait_job
from tests.collector.tb_writers import tensorboard_scalars
from tests.support import accounts
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pytorch-ddp"
STEPS = 30
LOSS = "tb/train/loss"  # the run directory (tb, under $TUNEPLANE_OUT_DIR) before the tag


def _torch_site_packages() -> Path:
    """The folder this test run imports torch from; skips (fails under CI=true) without it."""
    spec = importlib.util.find_spec("torch")
    accounts.require(
        spec is not None and spec.origin is not None,
        "torch: run the tests with `nox -s tests`, which installs its CPU wheel from the "
        "PyTorch index",
    )
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent.parent


def _others_can_run(path: Path) -> bool:
    """Whether an unrelated account can reach and execute ``path`` (every folder above it 'x')."""
    real = path.resolve()
    folders_ok = all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)
    return folders_ok and bool(real.stat().st_mode & stat.S_IXOTH)


def _base_interpreter() -> Path:
    """A Python of this test run's version that the members' accounts can run.

    Members run as other accounts when the test runs as root, and this run's own interpreter may
    live where they cannot go (a pyenv under /root); the distribution's one then serves, as long
    as it is the same version (torch's compiled modules are built for one).
    """
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [Path(sys._base_executable)]  # type: ignore[attr-defined]
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        candidates.append(Path(folder) / version)
    for candidate in candidates:
        if candidate.exists() and (not accounts.is_root() or _others_can_run(candidate)):
            return candidate
    accounts.require(
        False, f"a {version} interpreter that the members' accounts can run (install {version})"
    )
    raise AssertionError("unreachable")


def _torch_runtime(root: Path) -> Path:
    """A virtual environment under ``root`` that sees this run's torch: its python3."""
    site = _torch_site_packages()
    venv = root / "torch-runtime"
    made = subprocess.run(
        [str(_base_interpreter()), "-m", "venv", "--without-pip", str(venv)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    (venv_site,) = (venv / "lib").glob("python3*/site-packages")
    # A .pth line puts the folder on sys.path (its own .pth files, this checkout's editable
    # install among them, are not read): torch and what it imports, nothing of TunePlane.
    (venv_site / "torch-from-tests.pth").write_text(f"{site}\n")
    return venv / "bin" / "python3"


@pytest.fixture(scope="module")
def two_nodes(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, AgentProcess, AgentProcess]]:
    root = tmp_path_factory.mktemp("ddp")
    python = _torch_runtime(accounts.traversable_root("ddp-runtime"))
    runtime = (
        f'[runtimes.python3]\npath = "{python.parent}:/usr/bin:/bin"\ninterpreter = "{python}"\n'
    )
    with start_coordinator(root) as coord:
        agents = [start_agent(root, coord, name, "h200:2", node_toml=runtime) for name in "ab"]
        try:
            for agent in agents:
                agent.wait_connected()
            yield coord, agents[0], agents[1]
        finally:
            for agent in agents:
                if agent.alive():
                    agent.stop()


def _tuneplane_imports(script: Path) -> list[str]:
    """The modules of ``tuneplane`` that ``script`` imports: none, for the example."""
    names: list[str] = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return [name for name in names if name.split(".")[0] == "tuneplane"]


def _what_happened(coord: CoordinatorProcess, run_id: str) -> str:
    """`tp job show` and every member's output, for a Job that did not succeed."""
    shown = [tp(coord, "job", "show", run_id)]
    for member in ("0", "1"):
        for stream in ("--stdout", "--stderr"):
            output = tp(coord, "logs", run_id, "--member", member, stream)
            shown.append(f"member {member} {stream[2:]}:\n{output}")
    return "\n".join(shown)


def _tp_json(coord: CoordinatorProcess, *args: str) -> Any:
    return json.loads(tp(coord, *args, "--json"))


def test_the_ddp_example_shows_its_summarywriter_curves_in_tp_metrics(
    two_nodes: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = two_nodes
    assert not _tuneplane_imports(EXAMPLE / "experiments" / "ddp" / "train.py")
    project = tmp_path / "pytorch-ddp"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns(".tuneplane-data", "runs"))

    # As the README says: the Profile (h200:4) comes from config.yaml, two members of two GPUs.
    out = tp(
        coord, "submit", "ddp", "--members", "2", "--param", f"steps={STEPS}", "--yes", "--json",
        cwd=project,
    )  # fmt: skip
    preview, receipt = (json.loads(line) for line in out.strip().splitlines())
    assert preview["command"] == ["python3", "train.py", "--steps", str(STEPS),
                                  "--learning_rate", "0.05"]  # fmt: skip
    run_id = receipt["run_id"]

    done = wait_job(coord, run_id, 120)
    assert done["state"] == "succeeded", _what_happened(coord, run_id)
    members = done["attempts"][0]["members"]
    assert {m["node_id"] for m in members} == {a.node_id, b.node_id}
    assert all(len(m["gpu_indexes"]) == 2 for m in members)
    assert "training on 4 ranks, cpu, backend gloo" in tp(coord, "logs", run_id, "--member", "0")

    def delivered() -> Any:
        shown = _tp_json(coord, "metrics", run_id, "--delivery")["members"]
        return shown if len(shown) == 2 and all(m["drained"] for m in shown) else None

    for member in wait_until("both collectors to deliver everything", delivered, timeout=60):
        assert member["data_loss_warnings"] == 0, member

    tags = {t["tag"]: t["points"] for t in _tp_json(coord, "metrics", run_id)["tags"]}
    written = {tag: n for tag, n in tags.items() if not tag.startswith("system/")}
    assert written == {
        LOSS: STEPS,
        "tb/train/learning_rate": STEPS,
        "tb/train/samples_per_s": STEPS,
        "tb/hparams/hparam/final_loss": 1,
    }
    # Exactly once: one point per optimizer step, steps 1..STEPS, each in its own bucket, and
    # the curve TensorBoard's own reader reads from the event files rank 0 wrote.
    series = _tp_json(coord, "metrics", run_id, "--tag", LOSS, "--max-points", "1000")
    buckets = series["buckets"]
    assert [(bk["first_step"], bk["count"]) for bk in buckets] == [
        (step, 1) for step in range(1, STEPS + 1)
    ]
    (member0,) = (m for m in members if m["index"] == 0)
    read = tensorboard_scalars(Path(member0["out_dir"]) / "tb")["train/loss"]
    assert [(bk["first_step"], bk["last"]) for bk in buckets] == [(s, v) for s, _, v in read]
    assert buckets[-1]["last"] < buckets[0]["last"], "the loss must go down"

    # The hparams the script gave add_hparams reach `tp job show`.
    (record,) = _tp_json(coord, "job", "show", run_id)["hparams"]
    assert record["member_index"] == 0 and record["source"].startswith("tb/hparams/")
    assert record["hparams"] == {
        "learning_rate": 0.05,
        "steps": float(STEPS),
        "batch_size": 64.0,
        "world_size": 4.0,
        "backend": "gloo",
    }
