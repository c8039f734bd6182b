"""Where the daemon tells the Node's metrics what happened, without loading prometheus_client.

Rules:
- The daemon calls :data:`HOOKS` where something is observed (a journal commit, a heartbeat
  acknowledged, a reconnect). Each hook does nothing until :func:`tuneplane.agent.metrics.serving`
  binds it to its counter or histogram, which happens only when node.toml has ``[metrics]``:
  with no listener nobody can scrape, so nothing needs counting, and prometheus_client (with
  http.server, urllib.request and wsgiref) never loads into the agent (issue 13, goal 4: the
  idle agent's memory).
- A hook is a plain synchronous call on the Trio loop: cheap and never raising.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs


def _nothing() -> None:
    """A Node without ``[metrics]`` counts nothing: no one can scrape it."""


def _no_seconds(seconds: float) -> None:
    """A Node without ``[metrics]`` times nothing: no one can scrape it."""


@attrs.define(eq=False)
class MetricHooks:
    """What the metrics are told; the defaults are what a Node without ``[metrics]`` does."""

    #: How long one journal COMMIT took, in seconds.
    journal_commit: Callable[[float], None] = _no_seconds
    #: A heartbeat's round trip, in seconds.
    heartbeat_rtt: Callable[[float], None] = _no_seconds
    #: A control session ended and is dialled again.
    reconnect: Callable[[], None] = _nothing


#: The process's hooks: one metrics listener per process, as there is one registry.
HOOKS = MetricHooks()


def set_hooks(hooks: MetricHooks) -> MetricHooks:
    """Make ``hooks`` what the daemon calls from now on; returns what it called before."""
    before = attrs.evolve(HOOKS)
    for field in attrs.fields(MetricHooks):
        setattr(HOOKS, field.name, getattr(hooks, field.name))
    return before
