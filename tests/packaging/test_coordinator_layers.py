"""The coordinator's layers, read from the sources with ``ast`` (DESIGN.md, "Top-level layout").

Rules checked here:
- ``coordinator/`` holds packages you can see, and each may import only the ones below it:
  the pure tier at the bottom, that is the decision modules at the top of the folder
  (admission, placement, queue plan, lifecycle, launch, ...) and ``values/`` (the shared value
  types), then ``wire/`` (their conversions to and from protobuf); ``store/`` (the only
  SQL); ``gateways/`` (what Nodes and collectors talk to) and ``api/`` (the RPC handlers, which
  may hand orders to the gateways' Node sessions); ``server/`` (the serve process, which wires
  them together); ``cli/`` and ``demo/``.
- ``tp``'s side of ``cli/`` (every module but the ``tuneplane-coordinator`` admin CLI,
  ``admin*.py``) imports only values, wire, the pure modules and itself: a researcher's machine
  never loads the store, a gateway or the server.
- SQL lives in ``store/`` alone: no other module imports a database driver or holds a string
  that is a SQL statement.
- No module is over :data:`MAX_LINES` lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.packaging.test_import_layers import LAYOUT, PACKAGE_DIRS, ROOT, Layout, sources

pytestmark = pytest.mark.timeout(60)

COORDINATOR = ROOT / "coordinator"
PACKAGE = "tuneplane.coordinator"
#: "Top" is a module directly in coordinator/, the pure decisions.
TOP = "top"
#: What each layer may import of the coordinator (besides itself).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "values": frozenset({TOP}),
    "wire": frozenset({"values", TOP}),
    TOP: frozenset({"values"}),
    "store": frozenset({TOP, "values"}),
    "gateways": frozenset({TOP, "values", "wire", "store"}),
    "api": frozenset({TOP, "values", "wire", "store", "gateways"}),
    # The web console answers what the gRPC Api answers, through the same handlers' rules.
    "console": frozenset({TOP, "values", "wire", "store", "gateways", "api"}),
    "server": frozenset({TOP, "values", "wire", "store", "gateways", "api", "console"}),
    "tp": frozenset({TOP, "values", "wire"}),
    "admin": frozenset(
        {TOP, "values", "wire", "store", "gateways", "api", "console", "server", "tp"}
    ),
    "demo": frozenset(
        {TOP, "values", "wire", "store", "gateways", "api", "console", "server", "tp", "admin"}
    ),
}
DRIVERS = ("aiosqlite", "asyncpg", "sqlite3")
SQL = re.compile(
    r"^\s*(SELECT\s|INSERT\s+INTO\s|UPDATE\s+\S+\s+SET\s|DELETE\s+FROM\s|CREATE\s+(TABLE|INDEX|"
    r"UNIQUE\s+INDEX|DATABASE|SCHEMA)\s|ALTER\s+TABLE\s|DROP\s+(TABLE|INDEX)\s)"
)
MAX_LINES = 420


def layer_of_module(module: str) -> str | None:
    """The layer of ``tuneplane.coordinator.<...>``; None outside the coordinator."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    rest = module[len(PACKAGE) + 1 :].split(".") if module != PACKAGE else []
    if not rest:
        return TOP
    if rest[0] == "cli":
        return "admin" if len(rest) > 1 and rest[1].startswith("admin") else "tp"
    if rest[0] in MAY_IMPORT:
        return rest[0]
    return TOP


def layer_of(path: Path, layout: Layout = LAYOUT) -> str:
    if path.name != "__init__.py" and layout.module_name(path).count(".") == 2:
        return TOP
    layer = layer_of_module(layout.module_name(path))
    assert layer is not None
    return layer


def coordinator_sources() -> list[Path]:
    return [p for p in sources(COORDINATOR) if "example" not in p.relative_to(COORDINATOR).parts]


def crossings(paths: list[Path], layout: Layout = LAYOUT) -> list[str]:
    """Each import statement that climbs from a layer to one it may not import, named by the
    most specific module it imports (``from ..store import fleet``: ``...store.fleet``)."""
    wrong: list[str] = []
    for path in paths:
        here = layer_of(path, layout)
        allowed = MAY_IMPORT[here] | {here}
        climbs: dict[int, str] = {}
        for line, module in layout.imported(path):
            there = layer_of_module(module)
            if module == PACKAGE or there is None or there in allowed:
                continue
            if layout.source_of(module) is None:
                continue  # a name inside a module (``...store.core.Store``): its module is judged
            if len(module) > len(climbs.get(line, "")):
                climbs[line] = module
        name = layout.module_name(path)
        for line, module in sorted(climbs.items()):
            wrong.append(
                f"{name} ({here}) imports {module} ({layer_of_module(module)}), line {line}"
            )
    return wrong


def test_the_layers_are_judged_by_module() -> None:
    assert layer_of(COORDINATOR / "launch.py") == TOP
    assert layer_of(COORDINATOR / "store" / "core.py") == "store"
    assert layer_of(COORDINATOR / "cli" / "tp.py") == "tp"
    assert layer_of(COORDINATOR / "cli" / "admin.py") == "admin"
    assert layer_of_module("tuneplane.agent.wire") is None


def test_the_check_finds_an_import_that_climbs(tmp_path: Path) -> None:
    """The check itself, on a tree of its own: the store importing a handler at the top and
    the serve process inside a function; a pure module importing values (allowed)."""
    dirs = {name: tmp_path / name.rpartition(".")[2] for name in PACKAGE_DIRS}
    coordinator = dirs[PACKAGE]
    for folder in ("store", "api", "server", "values"):
        (coordinator / folder).mkdir(parents=True)
        (coordinator / folder / "__init__.py").write_text("")
    for name in ("api/jobs.py", "server/serve.py", "values/jobs.py"):
        (coordinator / name).write_text("")
    bad = coordinator / "store" / "probe.py"
    bad.write_text("from ..api import jobs\n\n\ndef f():\n    from ..server.serve import serve\n")
    fine = coordinator / "launch.py"
    fine.write_text("from .values.jobs import Job\n")
    layout = Layout(dirs)

    assert crossings([bad, fine], layout) == [
        "tuneplane.coordinator.store.probe (store) imports "
        "tuneplane.coordinator.api.jobs (api), line 1",
        "tuneplane.coordinator.store.probe (store) imports "
        "tuneplane.coordinator.server.serve (server), line 5",
    ]


def test_every_layer_imports_only_the_layers_below_it() -> None:
    paths = coordinator_sources()
    assert len(paths) > 80
    wrong = crossings(paths)
    assert not wrong, "These imports climb the coordinator's layers:\n" + "\n".join(wrong)


def _sql_strings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.match(node.value):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    return found


def test_sql_lives_in_the_store_alone() -> None:
    outside = [p for p in coordinator_sources() if layer_of(p) != "store"]
    drivers = [
        f"{LAYOUT.module_name(p)} imports {module} (line {line})"
        for p in outside
        for line, module in LAYOUT.imported(p)
        if module.partition(".")[0] in DRIVERS
    ]
    statements = [s for p in outside for s in _sql_strings(p)]
    assert not drivers, "Only store/ talks to a database:\n" + "\n".join(drivers)
    assert not statements, "SQL outside store/:\n" + "\n".join(statements)
    inside = [s for p in coordinator_sources() if layer_of(p) == "store" for s in _sql_strings(p)]
    assert len(inside) > 100, "the SQL check no longer recognises the store's own statements"


def test_no_coordinator_module_is_over_the_limit() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in coordinator_sources()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by concern (at most {MAX_LINES} lines each): {long}"
