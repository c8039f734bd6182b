"""What an agent's memory is made of before it does anything: the RSS of fresh interpreters that
only import (issue 13, goal 4).

Three figures, each the median of a few fresh processes, each read after the imports and a
collection: a bare interpreter; the modules the agent loads from others (the standard library
and its dependencies, exactly the set that importing the agent loads, without TunePlane's own);
and everything the agent imports. The first two are a floor no change to TunePlane's code can go
under; what the idle agent holds above the third is its state and its native libraries' work.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import attrs

#: The modules `tuneplane-node run` imports before it starts its work.
AGENT_MODULES = ("tuneplane.agent.cli", "tuneplane.agent.run_cli")
RUNS = 3

# Imports each name it is given (a name that cannot be imported alone, like ``typing.io``, is
# skipped: its parent brought it), then prints its RSS and every module it holds.
_CHILD = """
import gc, importlib, json, sys
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception:
        pass
gc.collect()
with open("/proc/self/status") as status:
    rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
print(json.dumps({"rss_kib": rss, "modules": sorted(sys.modules)}))
"""


@attrs.frozen
class Imported:
    what: str
    rss_mib: float
    modules: int


def _once(names: list[str]) -> tuple[float, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(names)],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    got = json.loads(out.stdout)
    return got["rss_kib"] / 1024, list(got["modules"])


def _median(what: str, names: list[str]) -> tuple[Imported, list[str]]:
    runs = [_once(names) for _ in range(RUNS)]
    modules = runs[-1][1]
    return Imported(what, statistics.median(r for r, _ in runs), len(modules)), modules


def _ours(name: str) -> bool:
    return name.startswith(("tuneplane", "__editable__")) or name == "__main__"


def import_floors() -> list[Imported]:
    """The bare interpreter, the agent's imports from others, and all of the agent's imports."""
    bare, _ = _median("a bare interpreter", [])
    agent, loaded = _median("everything the agent imports", list(AGENT_MODULES))
    others, _ = _median(
        "the agent's imports from others (stdlib and dependencies)",
        [name for name in loaded if not _ours(name)],
    )
    return [bare, others, agent]
