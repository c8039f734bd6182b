"""Each command line loads only the command that runs (agent/cli_lazy.py).

An on-call engineer's ``tuneplane-node journal members`` reads SQLite and prints; it must not
pay for the daemon's gRPC stack, Trio, prometheus_client or NVML, and an admin's
``tuneplane-coordinator decisions`` must not load the server. Checked in real processes with
``the modules the process holds once the command has run.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

import tuneplane.collector as collector
from tuneplane.agent import cli as node_cli
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.cli_lazy import LazyGroup
from tuneplane.agent.journal import Journal
from tuneplane.coordinator.cli import admin

# Runs a command line as ``python -m`` would, then writes the modules the process imported.
_DRIVER = """
import json, runpy, sys
listing, module = sys.argv[1], sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exc:
    code = exc.code
with open(listing, "w") as out:
    json.dump(sorted(sys.modules), out)
sys.exit(code)
"""


def _imported(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    listing = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(listing), *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return done, set(json.loads(listing.read_text()))


def _loaded(modules: set[str], package: str) -> bool:
    return any(name == package or name.startswith(f"{package}.") for name in modules)


def _assert_loads_only(tmp_path: Path, argv: list[str], needs: str, never: list[str]) -> None:
    """Command line ``argv`` succeeds holding module ``needs`` and nothing under ``never``."""
    done, modules = _imported(tmp_path, *argv)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _loaded(modules, needs)
    for heavy in never:
        assert not _loaded(modules, heavy), f"{' '.join(argv[1:])} imported {heavy}"


async def test_journal_members_loads_no_daemon_part(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    async with open_aio_host():
        journal = await Journal.open(state_dir / "journal.db")
        await journal.close()
    _assert_loads_only(
        tmp_path,
        ["tuneplane.agent.cli", "journal", "members", "--json", "--state-dir", str(state_dir)],
        "tuneplane.agent.journal_cli",
        ["grpclib", "trio", "prometheus_client", "pynvml", "tuneplane.agent.daemon"],
    )


def test_coordinator_decisions_loads_no_server(tmp_path: Path) -> None:
    state_dir = tmp_path / "coordinator"
    init, _ = _imported(
        tmp_path, "tuneplane.coordinator.cli.admin", "init", "--state-dir", str(state_dir)
    )
    assert init.returncode == 0, init.stderr[-2000:]
    _assert_loads_only(
        tmp_path,
        ["tuneplane.coordinator.cli.admin", "decisions", "--json", "--state-dir", str(state_dir)],
        "tuneplane.coordinator.cli.admin_store",
        ["tuneplane.coordinator.server.serve", "tuneplane.coordinator.server.lead", "trio"],
    )


@pytest.mark.parametrize("group", [node_cli.main, admin.main], ids=["tuneplane-node", "admin"])
def test_every_named_command_loads_as_itself(group: click.Group) -> None:
    assert isinstance(group, LazyGroup)
    context = click.Context(group)
    names = group.list_commands(context)
    assert names, "the group names no command"
    for name in names:
        command = group.get_command(context, name)
        assert isinstance(command, click.Command) and command.name == name


def test_a_wrong_entry_is_a_programming_error_named_at_once() -> None:
    group = LazyGroup(name="t", lazy={"journal": "tuneplane.agent.status_cli:status_command"})
    with pytest.raises(TypeError, match="is not the click command 'journal'"):
        group.get_command(click.Context(group), "journal")


def test_the_collector_package_loads_every_name_it_declares() -> None:
    """tuneplane.collector's lazy names (PEP 562) and the names it declares for type checkers
    are one list: each declared name loads, and nothing loads that is not declared."""
    tree = ast.parse(Path(collector.__file__).read_text())
    declared = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    }
    assert declared == set(collector._EXPORTS)
    for name in sorted(declared):
        assert getattr(collector, name) is not None
