"""coordinator/values/ is the bottom layer: importing any of its modules loads no gRPC, no
protocol code, no store and nothing that does IO (``tp`` commands that never call the
coordinator start fast, and the store never sees a generated type); and ``tp``'s client reads
replies through the wire modules without loading the store either."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

VALUES = Path(__file__).resolve().parents[2] / "coordinator" / "values"
# What a value module must never load, directly or through what it imports.
HEAVY = (
    "grpclib",
    "betterproto",
    "aiosqlite",
    "asyncpg",
    "sqlite3",
    "anyio",
    "trio",
    "tuneplane.proto.v1",
    "tuneplane.coordinator.store",
    "tuneplane.coordinator.wire",
)


def _loaded(module: str, heavy: tuple[str, ...]) -> list[str]:
    """Which of ``heavy`` a fresh interpreter has loaded after importing ``module``."""
    probe = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.split()


def test_every_value_module_loads_nothing_heavy() -> None:
    modules = sorted(p.stem for p in VALUES.glob("*.py") if p.stem != "__init__")
    assert modules, f"no value modules found in {VALUES}"
    loaded = {m: _loaded(f"tuneplane.coordinator.values.{m}", HEAVY) for m in modules}
    assert loaded == {m: [] for m in modules}


def test_tp_s_client_reads_replies_without_the_store() -> None:
    store = (
        "tuneplane.coordinator.store",
        "aiosqlite",
        "asyncpg",
        "tuneplane.coordinator.config",
    )
    for client in ("api_client", "metrics_client"):
        assert _loaded(f"tuneplane.coordinator.cli.{client}", store) == []
