"""Preview files: ``.tuneplane-data/submissions/<preview id>.json``, one per preview.

Rules: the file is written atomically before ``tp`` reports the preview, and holds the retry key
generated with it; every ``tp submit --commit`` of that preview sends that same key, so a repeated
confirmation (after a timeout, a crash, a second terminal) gets the same Job receipt. The receipt
is added to the file once the coordinator has given it.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError

from tuneplane.agent.atomic_file import write_atomic

from ..values.jobs import Preview, Receipt
from .project import Project, ProjectError

SUBMISSIONS_DIR = "submissions"
FORMAT = "tuneplane/submission-v1"
_PREVIEW_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


@attrs.frozen
class Submission:
    """A preview as the coordinator returned it, with where it lives and the retry key."""

    format: str
    coordinator: str
    project: str
    experiment: str
    retry_key: str
    preview: Preview
    receipt: Receipt | None = None


_CONVERTER = cattrs.Converter(forbid_extra_keys=True)


def new_retry_key() -> str:
    """A key no other confirmation will use: 128 random bits."""
    return "rk-" + secrets.token_hex(16)


def path_for(project: Project, preview_id: str) -> Path:
    if not _PREVIEW_ID.match(preview_id):
        raise ProjectError(
            f"{preview_id!r} is not a preview id; copy it from `tp submit --preview`."
        )
    return project.data_dir / SUBMISSIONS_DIR / f"{preview_id}.json"


def save(path: Path, submission: Submission) -> None:
    data = _CONVERTER.unstructure(submission)
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    write_atomic(path, text.encode("utf-8"), 0o600, parents=True)


def load(path: Path) -> Submission:
    fix = "Preview again with `tp submit <experiment> --preview`."
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProjectError(f"The preview file {path} does not exist. {fix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ProjectError(f"The preview file {path} is not readable JSON ({exc}). {fix}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ProjectError(f"{path} is not a TunePlane preview file (no format {FORMAT!r}). {fix}")
    try:
        return _CONVERTER.structure(raw, Submission)
    except (ClassValidationError, ForbiddenExtraKeysError, TypeError, ValueError) as exc:
        detail = "; ".join(cattrs.transform_error(exc))
        raise ProjectError(f"The preview file {path} is damaged ({detail}). {fix}") from None


def locate(target: str, project: Project | None) -> Path:
    """``target`` is a preview file's path, or a preview id looked up in the project's records."""
    as_path = Path(target)
    if as_path.suffix == ".json" or "/" in target:
        return as_path
    if project is None:
        raise ProjectError(
            f"'{target}' is a preview id, but there is no project here to look it up in; run "
            "from inside the project or pass the preview file's path."
        )
    return path_for(project, target)
