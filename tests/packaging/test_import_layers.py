"""Which package may import which, read from the sources with ``ast``, not by importing them.

Rules checked here (DESIGN.md, "Top-level layout"):
- The agent, the collector and the runner install and type-check without the coordinator: no
  module of theirs imports ``tuneplane.coordinator``, directly, inside a function, or through
  another TunePlane module it imports (the protocol's contract, ``tuneplane.proto.contract``,
  included).
- The runner is sealed into ``runner.pyz`` (agent/runner_pyz.py) and runs on an interpreter the
  agent does not control: it imports the standard library, psutil, and ``tuneplane.runner`` /
  ``tuneplane.report`` only. The ``tuneplane.report`` SDK runs inside the workload's own Python:
  the standard library only.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
# pyproject.toml's [tool.setuptools.package-dir], most specific first.
PACKAGE_DIRS = {
    "tuneplane.report": ROOT / "runner" / "report",
    "tuneplane.agent": ROOT / "agent",
    "tuneplane.coordinator": ROOT / "coordinator",
    "tuneplane.collector": ROOT / "collector",
    "tuneplane.runner": ROOT / "runner",
    "tuneplane.proto": ROOT / "proto",
}
COORDINATOR = "tuneplane.coordinator"
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


def within(module: str, packages: tuple[str, ...]) -> bool:
    """``module`` is one of ``packages`` or lies inside one."""
    return any(module == p or module.startswith(p + ".") for p in packages)


class Layout:
    """Installed module names <-> source files, by a package-dir mapping."""

    def __init__(self, dirs: Mapping[str, Path]) -> None:
        self.dirs = dirs

    def module_name(self, path: Path) -> str:
        """The installed name of ``path`` (``agent/wire.py``: ``tuneplane.agent.wire``)."""
        for package, folder in self.dirs.items():
            if path.is_relative_to(folder):
                parts = path.relative_to(folder).with_suffix("").parts
                if parts and parts[-1] == "__init__":
                    parts = parts[:-1]
                return ".".join((package, *parts))
        raise AssertionError(f"{path} lies in no TunePlane package folder")

    def source_of(self, module: str) -> Path | None:
        """The file that holds ``module``; None when no TunePlane source file does."""
        for package, folder in self.dirs.items():
            if within(module, (package,)):
                rest = module[len(package) :].split(".")[1:]
                base = folder.joinpath(*rest)
                for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                    if candidate.is_file():
                        return candidate
                return None
        return None

    def imported(self, path: Path) -> Iterator[tuple[int, str]]:
        """(line, module) for every import in ``path``, in functions too, relative ones
        resolved. ``from a.b import c`` yields ``a.b`` and ``a.b.c`` (``c`` may be a module)."""
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        here = self.module_name(path)
        package = here if path.name == "__init__.py" else here.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield node.lineno, alias.name
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    module = ".".join([*parts, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                yield node.lineno, module
                for alias in node.names:
                    if alias.name != "*":
                        yield node.lineno, f"{module}.{alias.name}"

    def coordinator_chains(self, starts: list[Path]) -> list[str]:
        """Every way a module of ``starts`` reaches tuneplane.coordinator, as ``a -> b -> c``."""
        found: list[str] = []
        seen: set[Path] = set()
        queue: list[tuple[Path, tuple[str, ...]]] = [
            (path, (self.module_name(path),)) for path in starts
        ]
        while queue:
            path, chain = queue.pop(0)
            if path in seen:
                continue
            seen.add(path)
            lines: set[int] = set()
            for line, module in self.imported(path):
                if within(module, (COORDINATOR,)):
                    if line not in lines:  # once per import statement
                        found.append(" -> ".join((*chain, f"{module} (line {line})")))
                    lines.add(line)
                    continue
                target = self.source_of(module) if module.startswith("tuneplane.") else None
                if target is not None and target not in seen:
                    queue.append((target, (*chain, self.module_name(target))))
        return found

    def imports_outside(
        self, paths: list[Path], third_party: tuple[str, ...], own: tuple[str, ...]
    ) -> list[str]:
        """Each import in ``paths`` of anything but the stdlib, ``third_party`` or ``own``."""
        return [
            f"{self.module_name(path)} imports {module} (line {line})"
            for path in paths
            for line, module in self.imported(path)
            if module.partition(".")[0] not in STDLIB
            and not within(module, third_party)
            and not within(module, own)
            and module != "tuneplane"
        ]


LAYOUT = Layout(PACKAGE_DIRS)


def sources(*folders: Path, without: Path | None = None) -> list[Path]:
    return sorted(
        p
        for folder in folders
        for p in folder.rglob("*.py")
        if without is None or not p.is_relative_to(without)
    )


def test_module_names_follow_the_package_dirs() -> None:
    assert LAYOUT.module_name(ROOT / "agent" / "wire.py") == "tuneplane.agent.wire"
    assert LAYOUT.module_name(ROOT / "runner" / "report" / "__init__.py") == "tuneplane.report"
    contract = ROOT / "proto" / "contract" / "jobspec.py"
    assert LAYOUT.module_name(contract) == "tuneplane.proto.contract.jobspec"
    assert LAYOUT.source_of("tuneplane.proto.contract.jobspec") == contract
    assert LAYOUT.source_of("tuneplane.proto.contract.jobspec.JobSpec") is None
    assert LAYOUT.source_of("attrs") is None


def test_the_walk_finds_a_coordinator_import_wherever_it_hides(tmp_path: Path) -> None:
    """The check itself, on a tree of its own: an import inside a function, ``from tuneplane
    import coordinator``, a relative import, and one reached only through another module."""
    dirs = {name: tmp_path / name.rpartition(".")[2] for name in PACKAGE_DIRS}
    for folder in dirs.values():
        folder.mkdir(parents=True, exist_ok=True)
    (dirs["tuneplane.proto"] / "contract").mkdir()
    agent, contract = dirs["tuneplane.agent"], dirs["tuneplane.proto"] / "contract"
    (agent / "lazy.py").write_text("def f():\n    from tuneplane.coordinator import jobspec\n")
    (agent / "clean.py").write_text("import attrs\nfrom . import lazy\n")
    (agent / "through.py").write_text("\nfrom tuneplane.proto.contract import leak\n")
    (contract / "leak.py").write_text("from tuneplane import coordinator\n")
    layout = Layout(dirs)

    assert layout.coordinator_chains([agent / "lazy.py"]) == [
        "tuneplane.agent.lazy -> tuneplane.coordinator (line 2)",
    ]
    assert layout.coordinator_chains([agent / "clean.py"]) == [
        "tuneplane.agent.clean -> tuneplane.agent.lazy -> tuneplane.coordinator (line 2)",
    ]
    assert layout.coordinator_chains([agent / "through.py"]) == [
        "tuneplane.agent.through -> tuneplane.proto.contract.leak -> tuneplane.coordinator (line 1)"
    ]
    assert layout.imports_outside([agent / "clean.py"], (), ("tuneplane.agent",)) == [
        "tuneplane.agent.clean imports attrs (line 1)"
    ]


def test_the_agent_collector_and_runner_never_import_the_coordinator() -> None:
    starts = sources(ROOT / "agent", ROOT / "collector", ROOT / "runner")
    assert len(starts) > 50
    chains = LAYOUT.coordinator_chains(starts)
    assert not chains, (
        "These imports make a Node need the coordinator; move what they use to "
        "tuneplane.proto.contract (a document the protocol carries) or to an agent module (a "
        "runtime helper the daemons share):\n" + "\n".join(chains)
    )


def test_the_protocol_contract_imports_no_daemon() -> None:
    contract = sources(ROOT / "proto" / "contract")
    assert len(contract) >= 4
    wrong = [
        f"{LAYOUT.module_name(path)} imports {module} (line {line})"
        for path in contract
        for line, module in LAYOUT.imported(path)
        if module.startswith("tuneplane.") and not within(module, ("tuneplane.proto",))
    ]
    assert not wrong, "\n".join(wrong)


def test_the_sealed_runner_imports_only_the_stdlib_psutil_and_itself() -> None:
    runner = sources(ROOT / "runner", without=ROOT / "runner" / "report")
    wrong = LAYOUT.imports_outside(runner, ("psutil",), ("tuneplane.runner", "tuneplane.report"))
    assert not wrong, (
        "runner.pyz carries only tuneplane.runner and tuneplane.report (agent/runner_pyz.py) "
        "and runs with the standard library and psutil:\n" + "\n".join(wrong)
    )


def test_the_report_sdk_imports_only_the_stdlib_and_itself() -> None:
    report = sources(ROOT / "runner" / "report")
    wrong = LAYOUT.imports_outside(report, (), ("tuneplane.report",))
    assert not wrong, "tuneplane.report runs inside the workload's own Python:\n" + "\n".join(wrong)
