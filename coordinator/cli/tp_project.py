"""``tp init``, ``tp new`` and ``tp recipe``: make a project and its experiments, and keep their
recipe locks current with the Catalogue bundled with this tp.

Rules: the same exit codes and error sentences as the rest of ``tp`` (errors propagate to
``tp.main``); none of these commands talks to the coordinator.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..catalogue import Catalogue
from . import render
from .project import LOCK_FILE, init_project, upgrade_lock
from .scaffold import new_experiment
from .tp_common import here


@click.command(name="init")
@click.argument("directory", required=False, type=click.Path(path_type=Path, file_okay=False))
@click.option("--name", help="Project name (default: the directory's name).")
def init(directory: Path | None, name: str | None) -> None:
    """Make DIRECTORY (default: here) a project by writing tuneplane.yaml."""
    folder = directory or Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    project = init_project(folder, name)
    click.echo(f"Initialised project {project.name} in {project.root} (tuneplane.yaml).")
    click.echo("Next: tp new <experiment> --method custom/custom")


@click.command(name="new")
@click.argument("experiment")
@click.option(
    "--method",
    "method_id",
    required=True,
    metavar="FRAMEWORK/METHOD",
    help="Method id from `tp recipe ls`, e.g. custom/custom.",
)
def new(experiment: str, method_id: str) -> None:
    """Create experiments/EXPERIMENT/ for a method, with its config and recipe lock."""
    project = here()
    for path in new_experiment(project, experiment, method_id, Catalogue.bundled()):
        click.echo(f"wrote {project.shown(path)}")
    click.echo(f"Next: tp submit {experiment} --profile <profile>[:<gpus>] --preview")


@click.group(name="recipe")
def recipe() -> None:
    """The Catalogue's recipes and your experiments' locks on them."""


@recipe.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def recipe_ls(as_json: bool) -> None:
    """List the recipes of the Catalogue bundled with this tp."""
    catalogue = Catalogue.bundled()
    if as_json:
        data = {"recipes": [render.recipe_json(r) for r in catalogue]}
        click.echo(render.to_json(data))
    else:
        out = render.console()
        click.echo("Catalogue bundled with this tp:")
        out.print(render.recipes_table(catalogue))


@recipe.command("upgrade")
@click.argument("experiment")
@click.option(
    "--method",
    "method_id",
    metavar="FRAMEWORK/METHOD",
    help="Move the experiment to this method (also writes a missing lock).",
)
def recipe_upgrade(experiment: str, method_id: str | None) -> None:
    """Rewrite EXPERIMENT's recipe.lock.json to the Catalogue's current recipe."""
    project = here()
    old, new_lock = upgrade_lock(project, experiment, Catalogue.bundled(), method_id)
    shown = project.shown(project.experiment_dir(experiment) / LOCK_FILE)
    if old == new_lock:
        click.echo(f"{shown} is already current ({new_lock.method_id} {new_lock.recipe_version}).")
        return
    if old is None:
        click.echo(f"wrote {shown} for {new_lock.method_id} {new_lock.recipe_version}.")
        return
    click.echo(f"upgraded {shown}:")
    for line in old.differences(new_lock):
        click.echo(f"  {line}")
