"""The Catalogue: the recipes this coordinator publishes, bundled as JSON beside this module.

A recipe's digest is sha256 over its canonical JSON; ``recipe.lock.json`` pins it, and submit
refuses a lock whose digest the Catalogue no longer holds. A recipe with parameters declares how
they reach the workload (``pass_parameters``, see :mod:`.parameters`), and may name the entrypoint
element that is a file of the experiment (``entrypoint_file``), which Preview checks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import Any

import attrs

from .parameters import Passing, RecipeError, passing_of


@attrs.frozen
class Parameter:
    name: str
    type: str  # "str" | "int" | "float" | "bool"
    default: Any = None
    min: float | None = None
    max: float | None = None
    description: str = ""


@attrs.frozen
class Recipe:
    method_id: str
    version: str
    category: str
    description: str
    framework_name: str
    framework_version: str
    runtime_id: str
    # "member": one process per member; "process-group": one local process per assigned GPU.
    launcher: str
    entrypoint: tuple[str, ...]
    parameters: Mapping[str, Parameter]
    digest: str
    # How the parameters reach the workload (argv flags, TUNEPLANE_PARAM_* variables).
    passing: Passing
    raw: Mapping[str, Any] = attrs.field(repr=False, eq=False)
    # The entrypoint element that names a file of the experiment (``python3 {script}``: 1), which
    # Preview refuses when the experiment has no such file; None when the recipe names none.
    entrypoint_file: int | None = None


def recipe_digest(raw: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the recipe's canonical JSON."""
    text = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _recipe(raw: Mapping[str, Any]) -> Recipe:
    params = {
        name: Parameter(
            name=name,
            type=p["type"],
            default=p.get("default"),
            min=p.get("min"),
            max=p.get("max"),
            description=p.get("description", ""),
        )
        for name, p in raw.get("parameters", {}).items()
    }
    entrypoint = tuple(raw["entrypoint"])
    entrypoint_file = raw.get("entrypoint_file")
    if entrypoint_file is not None and (
        type(entrypoint_file) is not int or not 0 <= entrypoint_file < len(entrypoint)
    ):
        raise RecipeError(
            f"Recipe {raw['method_id']}: 'entrypoint_file' is {entrypoint_file!r}; give the index "
            f"of an entrypoint element (0..{len(entrypoint) - 1})."
        )
    return Recipe(
        method_id=raw["method_id"],
        version=raw["version"],
        category=raw["category"],
        description=raw.get("description", ""),
        framework_name=raw["framework"]["name"],
        framework_version=raw["framework"]["version"],
        runtime_id=raw["runtime_id"],
        launcher=raw["launcher"],
        entrypoint=entrypoint,
        parameters=params,
        digest=recipe_digest(raw),
        passing=passing_of(raw["method_id"], raw.get("pass_parameters"), raw.get("parameters", {})),
        entrypoint_file=entrypoint_file,
        raw=raw,
    )


@attrs.frozen
class Catalogue:
    recipes: Mapping[str, Recipe]

    @classmethod
    def bundled(cls) -> Catalogue:
        """The recipes shipped with this TunePlane (``coordinator/recipes/*.json``)."""
        found: dict[str, Recipe] = {}
        folder = resources.files(__package__ or "tuneplane.coordinator") / "recipes"
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".json"):
                recipe = _recipe(json.loads(entry.read_text(encoding="utf-8")))
                found[recipe.method_id] = recipe
        return cls(found)

    def get(self, method_id: str) -> Recipe | None:
        return self.recipes.get(method_id)

    def is_current(self, method_id: str, digest: str) -> bool:
        recipe = self.recipes.get(method_id)
        return recipe is not None and recipe.digest == digest

    def __iter__(self) -> Iterator[Recipe]:
        return iter(self.recipes.values())
