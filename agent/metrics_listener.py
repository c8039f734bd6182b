"""The HTTP listener that serves Prometheus metrics, for the coordinator and for a Node.

Rules:
- Off unless the configuration file has a ``[metrics]`` table (``coordinator.toml``,
  ``node.toml``); it binds 127.0.0.1 unless ``host`` says otherwise.
- prometheus_client's own HTTP server serves the exposition from threads of its own, so a
  scrape never runs on the event loop (asyncio in the coordinator, Trio on a Node), and the
  event loop never parses HTTP. What a scrape reads must be memory only: counters and
  histograms, and collectors that turn a snapshot into gauges.
- The port is bound before the process does anything else, so a taken port stops it with one
  sentence and nothing changed.
- Shared runtime infrastructure: it lives in the agent, the lowest layer the coordinator also
  imports, so a Node needs nothing of the coordinator to serve its metrics.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import TYPE_CHECKING, Any

import attrs

from .host_port import join_host_port

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry

# prometheus_client (and its HTTP server) load when a listener starts or a registry is made, not
# when node.toml is read: the journal and status commands read the settings and serve nothing.

log = logging.getLogger(__name__)

#: The port the documentation gives the coordinator's listener (7443-7445 are its gRPC ports).
DEFAULT_COORDINATOR_PORT = 7446
#: The port the documentation gives a Node's listener.
DEFAULT_NODE_PORT = 7447


class MetricsConfigError(ValueError):
    """A ``[metrics]`` table cannot be used; ``str()`` names the key and the fix (the caller
    adds the file's name)."""


@attrs.frozen
class MetricsListener:
    """Where the metrics listener binds: ``port`` 0 lets the kernel pick a free one."""

    host: str
    port: int


def metrics_listener(table: Any, default_port: int) -> MetricsListener:
    """A ``[metrics]`` table, checked: ``port`` (default ``default_port``) and ``host``
    (default 127.0.0.1, an IP address). The table being there turns the listener on."""
    if not isinstance(table, dict):
        raise MetricsConfigError(
            f"'metrics' must be a table ([metrics] with port = {default_port}), not "
            f"{type(table).__name__}."
        )
    unknown = sorted(set(table) - {"host", "port"})
    if unknown:
        raise MetricsConfigError(
            f"[metrics] has unknown key(s) {', '.join(unknown)}. Known keys are host and port; "
            "remove or rename it."
        )
    port = table.get("port", default_port)
    if type(port) is not int or not 0 <= port <= 65535:
        raise MetricsConfigError(
            f"[metrics] port = {port!r} must be a whole number from 0 (a free port) to 65535, "
            f"e.g. port = {default_port}."
        )
    host = table.get("host", "127.0.0.1")
    try:
        if not isinstance(host, str):  # ip_address() would take 127 as 0.0.0.127
            raise TypeError(host)
        ipaddress.ip_address(host)
    except (ValueError, TypeError):
        raise MetricsConfigError(
            f"[metrics] host = {host!r} is not an IP address. Give the address to listen on, "
            'e.g. host = "127.0.0.1" (this machine only) or host = "0.0.0.0" (every interface).'
        ) from None
    return MetricsListener(host=str(host), port=port)


@attrs.define(eq=False)
class RunningListener:
    """A started metrics listener; :meth:`close` stops it (its threads are daemons)."""

    address: str
    _server: WSGIServer = attrs.field(alias="server")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        log.info("metrics listener stopped address=%s", self.address)


class MetricsListenError(ValueError):
    """The metrics listener cannot bind; ``str()`` says where and what to change."""


def start_listener(
    listener: MetricsListener, registry: CollectorRegistry, setting: str
) -> RunningListener:
    """Serve ``registry`` on ``listener``; ``setting`` names where the port is set (errors)."""
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(listener.port, listener.host, registry)
    except OSError as exc:
        raise MetricsListenError(
            f"The metrics listener cannot listen on {listener.host}:{listener.port} "
            f"({exc.strerror}). Change port in {setting} (0 picks a free port) or stop the "
            "process that holds it."
        ) from None
    address = join_host_port(str(server.server_address[0]), int(server.server_address[1]))
    log.info("metrics listener started address=%s", address)
    return RunningListener(address, server=server)


def new_registry() -> CollectorRegistry:
    """A registry with the process, platform and garbage-collector metrics every process has.

    Counters and histograms expose no ``*_created`` samples: they double the exposition and no
    rule of ours reads them.
    """
    from prometheus_client import (
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
        disable_created_metrics,
    )

    disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
