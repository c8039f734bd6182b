"""What every ``tp`` command shares: the global flags (:class:`Options`), calling the
coordinator they name, and finding the project the command runs in.

Rules: the connection is resolved only by commands that talk to the coordinator, and the modules
that talk to it (grpclib, betterproto, asyncio) are imported only when one does, so commands
that never talk to it (init, new, recipe) start quickly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import attrs

from .connection import RIDE_OUT_S, Endpoint, resolve_connection
from .project import Project, find_project

if TYPE_CHECKING:
    from .api_client import ApiClient

T = TypeVar("T")


@attrs.frozen
class Options:
    """The global flags; the connection is resolved only by commands that talk to the server."""

    context: Path | None
    coordinator: str | None
    ca: Path | None
    token_file: Path | None
    ride_out_s: float = RIDE_OUT_S

    def endpoint(self) -> Endpoint:
        return resolve_connection(
            self.context, self.coordinator, self.ca, self.token_file, self.ride_out_s
        )


def run(endpoint: Endpoint, work: Callable[[ApiClient], Awaitable[T]]) -> T:
    """Run ``work`` against the coordinator at ``endpoint``."""
    # Imported here: grpclib, betterproto and asyncio cost a tenth of a second at start, which
    # the commands that never talk to the coordinator (init, new, recipe) should not pay.
    import asyncio

    from .api_client import ApiClient

    async def go() -> T:
        async with ApiClient(endpoint) as api:
            return await work(api)

    return asyncio.run(go())


def here() -> Project:
    """The project the current directory is in."""
    return find_project(Path.cwd())
