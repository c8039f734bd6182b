"""A row of the append-only decision log, as ``tuneplane-coordinator decisions`` prints it.

Rules: frozen attrs values only (see :mod:`..values`); ``detail`` is the row's JSON, parsed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs


@attrs.frozen
class DecisionRow:
    """One row of the append-only decision log."""

    id: int
    at_ms: int
    kind: str
    run_id: str | None
    attempt: int | None
    member_index: int | None
    node_id: str | None
    detail: Mapping[str, Any]

    def detail_text(self) -> str:
        """The detail as ``key=<JSON value>`` pairs, as people read it (the CLI, the console)."""
        return " ".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in self.detail.items())
