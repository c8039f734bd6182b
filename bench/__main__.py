"""Run benchmarks by name: ``python -m bench telemetry``; all of bench/*.py when none is named."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

#: Benchmarks that run with another one named: the takeover figures are the coordinator's.
ALSO = {"coordinator": ("takeover",)}


def available() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(p.stem for p in here.glob("*.py") if not p.stem.startswith("_"))


def main(argv: list[str]) -> int:
    names = argv or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(
            f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(available())}",
            file=sys.stderr,
        )
        return 2
    # `coordinator` also runs `takeover` (kill -9 of the leader of two coordinators), once.
    for name in dict.fromkeys(n for m in names for n in (m, *ALSO.get(m, ()))):
        print(f"== {name}")
        module = importlib.import_module(f"bench.{name}")
        rc = module.main()
        if rc:
            return int(rc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
