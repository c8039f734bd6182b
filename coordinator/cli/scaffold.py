"""``tp new``: the files a fresh experiment starts with.

Rules: a new experiment never overwrites anything (an existing directory is refused); the lock is
written from the Catalogue recipe exactly as ``tp recipe upgrade`` writes it, so a fresh
experiment is always current; the starter program runs as written.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml

from tuneplane.agent.atomic_file import write_atomic

from ..catalogue import Catalogue, Parameter, Recipe
from .project import (
    CONFIG_FILE,
    DEFAULT_GRACE_PERIOD_S,
    LOCK_FILE,
    Project,
    ProjectError,
    RecipeLock,
    check_name,
)

TRAIN_SH = """\
#!/usr/bin/env bash
# Runs once per member of the Job. Only $TUNEPLANE_OUT_DIR survives the Job: write results there.
set -euo pipefail

echo "experiment {experiment} starting on $(hostname)"
echo "writing outputs to ${{TUNEPLANE_OUT_DIR}}"
date -u +%Y-%m-%dT%H:%M:%SZ > "${{TUNEPLANE_OUT_DIR}}/finished-at.txt"
echo "experiment {experiment} done"
"""

TRAIN_PY = '''\
"""Entrypoint of experiment {experiment}: one process per assigned GPU.

The launcher sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which is what
torch.distributed.init_process_group(backend="nccl") reads. The recipe's parameters arrive as
flags (--steps, --learning_rate, from config.yaml or `tp submit --param`) and as
TUNEPLANE_PARAM_<NAME> variables. Only $TUNEPLANE_OUT_DIR survives the Job: write checkpoints
and results there.
"""

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    master = f"{{os.environ['MASTER_ADDR']}}:{{os.environ['MASTER_PORT']}}"
    print(f"rank {{rank}}/{{world_size}} (local {{local_rank}}) meets at {{master}}", flush=True)
    out_dir = Path(os.environ["TUNEPLANE_OUT_DIR"])
    result = {{
        "rank": rank, "world_size": world_size, "local_rank": local_rank,
        "steps": args.steps, "learning_rate": args.learning_rate,
    }}
    (out_dir / f"rank-{{rank}}.json").write_text(json.dumps(result) + "\\n")


if __name__ == "__main__":
    main()
'''

# What each method's experiment starts with besides config.yaml and the lock.
STARTERS: dict[str, tuple[str, str, int]] = {
    "custom/custom": ("train.sh", TRAIN_SH, 0o755),
    "pytorch/process-group": ("train.py", TRAIN_PY, 0o644),
}


def _yaml_scalar(value: Any) -> str:
    text: str = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return text.removesuffix("\n...\n").strip()


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _describe(param: Parameter) -> str:
    bits = [param.type]
    if param.min is not None or param.max is not None:
        low = "" if param.min is None else _number(param.min)
        high = "" if param.max is None else _number(param.max)
        bits.append(f"{low}..{high}")
    text = f"{param.description} " if param.description else ""
    return f"{text}({', '.join(bits)})"


def _passing_comment(recipe: Recipe) -> list[str]:
    """How the recipe's parameters reach the program, as config.yaml comment lines."""
    ways = []
    if recipe.passing.argv:
        flags = ", ".join(flag for _, flag in recipe.passing.argv)
        ways.append(f"as flags after the command ({flags})")
    if recipe.passing.env:
        ways.append("as TUNEPLANE_PARAM_<NAME> variables")
    if not ways:
        return []
    text = (
        f"They reach the program {' and '.join(ways)}; `tp submit --preview` shows exactly "
        "what each rank gets."
    )
    return ["# " + line for line in textwrap.wrap(text, 94)]


def config_text(experiment: str, recipe: Recipe) -> str:
    """The documented config.yaml ``tp new`` writes, with every recipe parameter at its default."""
    lines = [
        f"# Experiment {experiment}: method {recipe.method_id} (recipe {recipe.version}).",
        "# `tp submit` reads this file; its flags (--param, --env, --profile) override it.",
        "",
        "# Method parameters, typed by the recipe (`tp recipe ls` lists them).",
    ]
    if recipe.parameters:
        lines += _passing_comment(recipe)
        lines.append("parameters:")
        for param in recipe.parameters.values():
            lines.append(f"  # {_describe(param)}")
            lines.append(f"  {param.name}: {_yaml_scalar(param.default)}")
    else:
        lines.append("parameters: {}")
    lines += [
        "",
        "# Environment variables for the workload; values are strings, names must not start",
        "# with TUNEPLANE_.",
        "env: {}",
        "",
        "# The Profile `tp submit` uses when given no --profile: NAME or NAME:GPUS, e.g. h200:8.",
        "# profile: h200:1",
        "",
        "# Seconds each member gets between SIGTERM and SIGKILL when the Job is stopped.",
        f"grace_period_s: {DEFAULT_GRACE_PERIOD_S}",
        "",
    ]
    return "\n".join(lines)


def new_experiment(
    project: Project, experiment: str, method_id: str, catalogue: Catalogue
) -> list[Path]:
    """Create ``experiments/<experiment>/`` for ``method_id``; returns the files written."""
    check_name("experiment", experiment)
    recipe = catalogue.get(method_id)
    if recipe is None:
        raise ProjectError(
            f"The Catalogue has no recipe for method '{method_id}'; it publishes "
            f"{', '.join(sorted(catalogue.recipes))} (see `tp recipe ls`)."
        )
    folder = project.experiment_dir(experiment)
    if folder.exists():
        raise ProjectError(
            f"{project.shown(folder)} already exists; choose another experiment name "
            f"or use `tp recipe upgrade {experiment}` to refresh its lock."
        )
    written = []
    files: list[tuple[str, str, int]] = [
        (CONFIG_FILE, config_text(experiment, recipe), 0o644),
        (LOCK_FILE, RecipeLock.of(recipe).to_json(), 0o644),
    ]
    starter = STARTERS.get(method_id)
    if starter is not None:
        name, template, mode = starter
        files.append((name, template.format(experiment=experiment), mode))
    for name, text, mode in files:
        path = folder / name
        write_atomic(path, text.encode("utf-8"), mode, parents=True)
        written.append(path)
    return written
