"""The console's JSON API as an OpenAPI 3.1 document, generated from the route table the app
serves (:data:`API`), so the schema cannot list a route the app lacks or miss one it has.
"""

from __future__ import annotations

from typing import Any

import attrs

from tuneplane.proto.contract.control_protocol import release

PREFIX = "/api/v1"
SESSION_COOKIE = "tp_console"
CSRF_HEADER = "X-CSRF-Token"
INTEGER_QUERY = frozenset({"limit", "attempt", "from", "to", "buckets", "member", "max_bytes"})


@attrs.frozen
class ApiRoute:
    """One route of the JSON API: what the schema says of it, and its handler's name in the app."""

    method: str
    path: str  # under PREFIX, Starlette's {param} syntax
    handler: str
    summary: str
    query: tuple[tuple[str, str], ...] = ()  # (name, description)
    changes: bool = False  # state-changing: needs the CSRF header
    public: bool = False  # answered without a session
    media_type: str = "application/json"
    also_media: tuple[str, ...] = ()  # other answers it can give (``format=csv``)


_JOB_FILTERS = (
    ("project", "Only Jobs of this project."),
    ("state", "Only Jobs in this state."),
    ("owner", "Only Jobs of this owner."),
    ("limit", "How many Jobs, 1 to 1000 (default 100)."),
)
_LOG_QUERY = (
    ("attempt", "Which attempt (default 0: the latest)."),
    ("member", "Which member (its index; default 0)."),
    ("stream", "`stdout` (default) or `stderr`."),
    ("from", "The byte offset to read from (default 0: the oldest kept)."),
)

API: tuple[ApiRoute, ...] = (
    ApiRoute("get", "/openapi.json", "openapi", "This document.", public=True),
    ApiRoute(
        "get",
        "/session",
        "session",
        "Who is signed in, and the CSRF token their session's changes carry.",
    ),
    ApiRoute("get", "/fleets", "fleets", "Every Fleet, its Nodes counted and its GPUs per Series."),
    ApiRoute(
        "get",
        "/fleets/{name}",
        "fleet",
        "One Fleet and its Nodes: connectivity, scheduling state, GPUs by health and owner, "
        "credential expiry, last heartbeat.",
    ),
    ApiRoute(
        "get",
        "/jobs",
        "jobs",
        "The newest Jobs the caller may read (as `tp job ls`).",
        query=_JOB_FILTERS,
    ),
    ApiRoute(
        "get",
        "/jobs/events",
        "jobs_events",
        "Server-sent events: a `jobs` event with the filtered list (as GET /jobs) at first and "
        "whenever a Job enters it, leaves it or changes state (checked once a second).",
        query=_JOB_FILTERS,
        media_type="text/event-stream",
    ),
    ApiRoute(
        "get",
        "/jobs/{run_id}",
        "job",
        "One Job: its attempts and members (Node, GPUs, state, exit) and its telemetry delivery "
        "per member.",
    ),
    ApiRoute(
        "post",
        "/jobs/{run_id}/cancel",
        "cancel",
        'Cancel a Job (its owner or an admin, as CancelJob). Body: {"reason": "..."}, optional.',
        changes=True,
    ),
    ApiRoute(
        "post",
        "/jobs/{run_id}/retry",
        "retry",
        "Retry a Job that failed, was cancelled or was aborted (its owner or an admin, as "
        "RetryJob): it is queued for a new attempt. No body.",
        changes=True,
    ),
    ApiRoute(
        "get",
        "/jobs/{run_id}/decisions",
        "decisions",
        "The Job's decision log (admission, reservation, commit or abort, state changes, "
        "retries), oldest first: its newest 500 rows, `older` true when there are more.",
    ),
    ApiRoute(
        "get",
        "/jobs/{run_id}/logs",
        "logs",
        "One bounded read of a member's log as GetLogs reads it (`tp logs`): pieces of text with "
        "their byte offsets, `next_offset` to read on from, `complete` once the stream ended.",
        query=(*_LOG_QUERY, ("max_bytes", "At most this many bytes, 1 to 262144 (default).")),
    ),
    ApiRoute(
        "get",
        "/jobs/{run_id}/logs/events",
        "logs_events",
        "Server-sent events: following a member's log (`tp logs --follow`), a `log` event (as "
        "GET logs answers) per read that found bytes, at most one read of 262144 bytes a "
        "second, until the stream is complete.",
        query=_LOG_QUERY,
        media_type="text/event-stream",
    ),
    ApiRoute(
        "get",
        "/jobs/{run_id}/metrics/events",
        "metrics_events",
        "Server-sent events: a `metrics` event with each run's tags (points, last step) at "
        "first and whenever one grows (checked once a second), for a Charts page to read its "
        "charts again.",
        query=(("run", "Another run overlaid (repeatable, up to 7)."),),
        media_type="text/event-stream",
    ),
    ApiRoute(
        "get",
        "/jobs/{run_id}/events",
        "job_events",
        "Server-sent events: a `job` event with the Job whenever its state or its members' states "
        "change (checked once a second), until the Job ends.",
        media_type="text/event-stream",
    ),
    ApiRoute(
        "get",
        "/jobs/{run_id}/metrics",
        "metrics",
        "The Job's metric tags (as ListMetrics: every member merged), with point counts and "
        "last values.",
        query=(("attempt", "Which attempt (default: the latest with points)."),),
    ),
    ApiRoute(
        "get",
        "/jobs/{run_id}/series",
        "series",
        "One tag as at most `buckets` buckets (as QuerySeries), each with its first and last "
        "step, count, min, max and last; `from`/`to` narrow it to a step range (a zoom, at finer "
        "resolution). `format=csv` answers the same buckets as text/csv.",
        query=(
            ("tag", "The tag (required)."),
            ("from", "First step of the range (default: the series' first)."),
            ("to", "Last step of the range (default: the series' last)."),
            ("buckets", "At most this many buckets, 1 to 10000 (default 1000)."),
            ("attempt", "Which attempt (default: the latest with points)."),
            ("format", "`json` (default) or `csv`."),
        ),
        also_media=("text/csv",),
    ),
)


def _parameters(route: ApiRoute) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for part in route.path.split("/"):
        if part.startswith("{") and part.endswith("}"):
            found.append(
                {"name": part[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
            )
    for name, description in route.query:
        kind = "integer" if name in INTEGER_QUERY else "string"
        found.append(
            {"name": name, "in": "query", "required": False, "description": description,
             "schema": {"type": kind}}
        )  # fmt: skip
    if route.changes:
        found.append(
            {"name": CSRF_HEADER, "in": "header", "required": True, "schema": {"type": "string"},
             "description": "The csrf_token of GET /api/v1/session."}
        )  # fmt: skip
    return found


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of :data:`API`."""
    error = {
        "description": "Refused; `error` is a sentence that says why and what to do.",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}},
                    "required": ["error"],
                }
            }
        },
    }
    paths: dict[str, dict[str, Any]] = {}
    for route in API:
        operation: dict[str, Any] = {
            "operationId": route.handler,
            "summary": route.summary,
            "parameters": _parameters(route),
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {t: {"schema": {}} for t in (route.media_type, *route.also_media)},
                },
            },
        }
        if not route.public:
            operation["security"] = [{"session": []}]
            operation["responses"]["401"] = error
            operation["responses"]["403"] = error
            operation["responses"]["404"] = error
        if route.changes or route.query:
            operation["responses"]["400"] = error
        if route.media_type == "text/event-stream":
            operation["responses"]["429"] = error  # the console's streams are all taken
        paths.setdefault(PREFIX + route.path, {})[route.method] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "TunePlane console API",
            "version": release(),
            "description": "Sign in at /sign-in with a user token; the session cookie then "
            "authorizes these calls, with the same rules as tp.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {
                "session": {"type": "apiKey", "in": "cookie", "name": SESSION_COOKIE}
            }
        },
    }
