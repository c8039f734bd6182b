"""How ``tp`` shows things: rich tables for people, stable JSON for scripts.

Rules: ``--json`` output is built only from the attrs values here (field names follow the API
messages) with sorted keys, so scripts can rely on it; human output never hides state (an empty
list says so, an unknown time shows '-'); text from the server is printed without markup.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cattrs
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from ..catalogue import Catalogue, Recipe
from ..parameters import env_name
from ..values.jobs import Attempt, FirstFailure, ImagePreparation, Job, Preview, Receipt
from .render_launch import launch_json, launch_rows
from .submissions import Submission

_CONVERTER = cattrs.Converter()


def to_json(value: Any) -> str:
    """Stable JSON text of an attrs value (or plain data): sorted keys, two-space indent."""
    return json.dumps(_CONVERTER.unstructure(value), indent=2, sort_keys=True)


def json_line(data: dict[str, Any]) -> str:
    """One compact JSON object on one line, for outputs that stream several objects."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def console() -> Console:
    """stdout; when it is not a terminal, wide enough that a table never folds a run id."""
    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=200)
    return out


def when(ms: int) -> str:
    if ms <= 0:
        return "-"
    stamp = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%d %H:%M:%S UTC")


def pairs(rows: Sequence[tuple[str, str]]) -> Text:
    """Aligned ``key  value`` lines (no table padding, so they copy and grep cleanly)."""
    width = max(len(key) for key, _ in rows) + 2
    text = Text()
    for i, (key, value) in enumerate(rows):
        if i:
            text.append("\n")
        text.append(key.ljust(width), style="bold")
        text.append(value)
    return text


def heading(title: str) -> Text:
    return Text(title, style="bold")


# -- recipes ---------------------------------------------------------------------------------


def recipe_json(recipe: Recipe) -> dict[str, Any]:
    return {
        "method_id": recipe.method_id,
        "version": recipe.version,
        "category": recipe.category,
        "description": recipe.description,
        "framework": {"name": recipe.framework_name, "version": recipe.framework_version},
        "runtime_id": recipe.runtime_id,
        "launcher": recipe.launcher,
        "entrypoint": list(recipe.entrypoint),
        "entrypoint_file": recipe.entrypoint_file,
        # How the parameters reach the workload: flags in this order, and TUNEPLANE_PARAM_*.
        "pass_parameters": {
            "argv": [{"name": name, "flag": flag} for name, flag in recipe.passing.argv],
            "env": {name: env_name(name) for name in recipe.passing.env},
        },
        "digest": recipe.digest,
        "parameters": {
            name: {
                "type": p.type,
                "default": p.default,
                "min": p.min,
                "max": p.max,
                "description": p.description,
            }
            for name, p in recipe.parameters.items()
        },
    }


def recipes_table(catalogue: Catalogue) -> Table:
    table = Table()
    for column in ("METHOD ID", "VERSION", "CATEGORY", "FRAMEWORK", "RUNTIME", "PARAMETERS"):
        table.add_column(column)
    for recipe in catalogue:
        params = ", ".join(f"{p.name}:{p.type}" for p in recipe.parameters.values()) or "-"
        table.add_row(
            recipe.method_id,
            recipe.version,
            recipe.category,
            f"{recipe.framework_name} {recipe.framework_version}",
            recipe.runtime_id,
            params,
        )
    return table


# -- submit ----------------------------------------------------------------------------------


def preview_json(record: Submission, path: Path) -> dict[str, Any]:
    """The preview as scripts see it; the resolved JobSpec (with the files) stays in the file."""
    p = record.preview
    return {
        "kind": "preview",
        "preview_id": p.preview_id,
        "digest": p.digest,
        "runtime_id": _runtime_id(p),
        "summary": _CONVERTER.unstructure(p.summary),
        "created_at_ms": p.created_at_ms,
        "project": record.project,
        "experiment": record.experiment,
        "coordinator": record.coordinator,
        "file": str(path),
        # What every rank runs, as the coordinator resolved it (render_launch.py).
        **launch_json(p.resolved_jobspec_json),
    }


def receipt_json(receipt: Receipt) -> dict[str, Any]:
    data: dict[str, Any] = _CONVERTER.unstructure(receipt)
    return {"kind": "receipt", **data}


def _runtime_id(preview: Preview) -> str | None:
    """runtime_id of the resolved JobSpec (an image pinned by digest), or None when unreadable."""
    try:
        runtime = json.loads(preview.resolved_jobspec_json)["runtime_id"]
    except (ValueError, KeyError, TypeError):
        return None
    return runtime if isinstance(runtime, str) else None


def _runtime(preview: Preview) -> str:
    """The Runtime line: the resolved runtime, and the tag an image was pinned from."""
    runtime = _runtime_id(preview) or "?"
    tag = preview.summary.image_tag
    return f"{runtime} (tag {tag!r} pinned at Preview)" if tag else runtime


def _total_gpus(preview: Preview) -> int | None:
    """resources.gpus of the resolved JobSpec, or None when it cannot be read."""
    try:
        gpus = json.loads(preview.resolved_jobspec_json)["resources"]["gpus"]
    except (ValueError, KeyError, TypeError):
        return None
    return gpus if isinstance(gpus, int) else None


def _gpu_shape(preview: Preview) -> str:
    s = preview.summary
    if s.members:
        product = s.members * s.gpus_per_member
        return f"{s.gpus_per_member} per member x {s.members} members = {product}"
    total = _total_gpus(preview)
    shown = "?" if total is None else str(total)
    if s.gpus_per_member:
        return f"{shown} in total, {s.gpus_per_member} per member"
    return f"{shown} in total, split over members at placement"


def preview_view(preview: Preview, experiment: str, project: str, saved: str) -> RenderableType:
    s = preview.summary
    rows = [
        ("Preview", preview.preview_id),
        ("Experiment", f"{experiment} (project {project})"),
        ("Fleet", f"{s.fleet or '-'} (backend {s.backend or '-'})"),
        ("Profile", s.profile or "-"),
        ("Series", s.series or "-"),
        ("GPUs", _gpu_shape(preview)),
        ("Runtime", _runtime(preview)),
        *launch_rows(preview.resolved_jobspec_json),
        ("Digest", preview.digest),
        ("Saved", saved),
    ]
    return pairs(rows)


def receipt_line(receipt: Receipt) -> str:
    """One sentence with the run id as its first word that starts with 'run'."""
    if receipt.created:
        how = "admitted now"
    else:
        how = "already admitted by an earlier identical confirmation; no new Job was created"
    admitted = when(receipt.admitted_at_ms)
    return f"Job {receipt.run_id} {how} (preview {receipt.preview_id}, {admitted})."


# -- jobs ------------------------------------------------------------------------------------


def jobs_table(jobs: list[Job]) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("RUN ID", "PROJECT", "EXPERIMENT", "STATE", "PROFILE", "FLEET", "OWNER"):
        table.add_column(column, no_wrap=True)
    table.add_column("CREATED", no_wrap=True)
    for job in jobs:
        table.add_row(
            job.run_id,
            job.project,
            job.experiment,
            job.state,
            job.profile or "-",
            job.fleet or "-",
            job.owner or "-",
            when(job.created_at_ms),
        )
    return table


def _attempt_heading(attempt: Attempt) -> Text:
    rdv = f", rendezvous {attempt.master_addr}:{attempt.master_port}" if attempt.master_addr else ""
    since = when(attempt.created_at_ms)
    return heading(f"Attempt {attempt.number}: {attempt.state} (since {since}{rdv})")


def _members_table(attempt: Attempt, node_names: Mapping[str, str]) -> Table:
    table = Table()
    for column in ("MEMBER (RANK)", "NODE", "GPUS", "STATE", "EXIT", "OUT DIR"):
        table.add_column(column)
    for m in attempt.members:
        table.add_row(
            str(m.index),
            node_text(m.node_id, node_names),
            ",".join(str(g) for g in m.gpu_indexes) or "-",
            m.state + (f" ({preparation_text(m.preparation)})" if m.preparation else ""),
            exit_text(m.has_exit, m.exit_code, m.signal),
            m.out_dir or "-",
        )
    if not attempt.members:
        table.add_row("(no members placed yet)", "", "", "", "", "")
    return table


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def preparation_text(p: ImagePreparation) -> str:
    """A preparing member's image pull as the STATE column shows it, for example
    ``pulling image:registry.example/team/pytorch@sha256:…: 312.0 MiB of 1024.0 MiB, 2 of 9
    layers``."""
    return (
        f"{p.phase} {p.image}: {_mib(p.bytes_done)} of {_mib(p.bytes_total)}, "
        f"{p.layers_done} of {p.layers_total} layers"
    )


def node_text(node_id: str, node_names: Mapping[str, str]) -> str:
    """A Node as listed next to others: its id, then its display name when known."""
    if not node_id:
        return "-"
    name = node_names.get(node_id, "")
    return f"{node_id} ({name})" if name else node_id


def job_view(job: Job) -> list[RenderableType]:
    """The Job as ``tp job show`` prints it; each member's Node is shown by id and name."""
    node_names = {m.node_id: m.node_name for a in job.attempts for m in a.members if m.node_name}
    derivation = f"began from run {job.init_from}" if job.init_from else "none"
    parts: list[RenderableType] = [
        pairs(
            [
                ("Job", job.run_id),
                ("State", job.state),
                ("Reason", job.state_reason or "-"),
                ("Project", job.project),
                ("Experiment", job.experiment),
                ("Method", job.method_id),
                ("Owner", job.owner or "-"),
                ("Fleet", job.fleet or "-"),
                ("Profile", job.profile or "-"),
                ("Runtime", job.runtime_id or "-"),
                ("Derivation", derivation),
                ("Preview", f"{job.preview_id} ({job.digest})"),
                ("Created", when(job.created_at_ms)),
            ]
        )
    ]
    parts.append(heading("State history"))
    history = Table()
    for column in ("AT", "STATE", "REASON"):
        history.add_column(column)
    for change in job.history:
        history.add_row(when(change.at_ms), change.state, Text(change.reason or "-"))
    parts.append(history)
    if not job.attempts:
        parts.append(Text("No attempts yet: the Job is waiting to be placed."))
    for attempt in job.attempts:
        parts += [_attempt_heading(attempt), _members_table(attempt, node_names)]
    if job.first_failure is not None:
        parts += _first_failure_view(job.run_id, job.first_failure, node_names)
    return parts


def exit_text(has_exit: bool, exit_code: int, signal: int) -> str:
    """How a member ended, as the EXIT column shows it: a code, a signal or '-'."""
    if not has_exit:
        return "-"
    return f"signal {signal}" if signal else str(exit_code)


def _first_failure_view(
    run_id: str, f: FirstFailure, node_names: Mapping[str, str]
) -> list[RenderableType]:
    how = exit_text(f.has_exit, f.exit_code, f.signal)
    rows = [
        ("Member", f"{f.member_index} of attempt {f.attempt} (it failed first)"),
        ("Node", node_text(f.node_id, node_names)),
        ("Exit", f"{how} ({f.state})"),
        ("Why", f.what),
        ("At", when(f.at_ms)),
    ]
    more = " (older lines cut)" if f.stderr_cut else ""
    everything = f"tp logs {run_id} --member {f.member_index} --stderr"
    title = f"Its stderr, last lines{more}; all of it: {everything}"
    parts: list[RenderableType] = [heading("First failure"), pairs(rows), heading(title)]
    parts.append(Text(f.stderr_tail.rstrip("\n") if f.stderr_tail else "(its stderr is empty)"))
    return parts
