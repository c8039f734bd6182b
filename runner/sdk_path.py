"""Where a workload finds ``tuneplane.report``: the folder the runner puts first on PYTHONPATH.

Rules: the SDK the workload imports is the one that shipped with this runner, never a guess.
``tuneplane`` is a namespace package, so the folder holding ``tuneplane/report`` is enough.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


class SdkNotFound(RuntimeError):
    """``tuneplane.report`` is not importable next to this runner."""


def report_package_dir() -> Path:
    """The directory of the ``tuneplane.report`` package this runner would import."""
    spec = importlib.util.find_spec("tuneplane.report")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise SdkNotFound(
            "tuneplane.report cannot be found next to the runner; rebuild runner.pyz so it "
            "includes the tuneplane.report package."
        )
    return Path(locations[0]).resolve()


def sdk_root(shim_dir: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes ``import tuneplane.report`` resolve.

    In an installed layout the package lives at ``<root>/tuneplane/report`` and ``<root>`` is the
    answer; inside the capsule's ``runner.pyz`` ``<root>`` is the zip file itself, which Python
    imports from when it is on PYTHONPATH. A source checkout maps ``runner/report`` to
    ``tuneplane.report`` (so its grandparent holds no ``tuneplane`` folder); then a
    ``<shim_dir>/tuneplane/report`` link to it is laid out once and ``shim_dir`` is the answer.
    """
    package = report_package_dir()
    if package.name == "report" and package.parent.name == "tuneplane":
        return package.parent.parent
    link = shim_dir / "tuneplane" / "report"
    if not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(package, link, target_is_directory=True)
    return shim_dir


def with_sdk_on_path(env: dict[str, str], root: Path) -> dict[str, str]:
    """``env`` with ``root`` first on PYTHONPATH (anything already there stays, after it)."""
    existing = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(root), existing) if p)}
