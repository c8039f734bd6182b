"""The agent's bridge to asyncio libraries (aiosqlite, grpclib), hosted through trio-asyncio.

Rules: this module and the wire modules (:mod:`tuneplane.agent.wire`, ``wire_convert``,
``wire_control``) are the only agent modules that import asyncio or trio-asyncio. Trio code
calls asyncio coroutine functions through :func:`run_aio` inside one :func:`open_aio_host`
block, which the daemon (or a CLI command, or a test) opens once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import ParamSpec, TypeVar

import trio_asyncio

P = ParamSpec("P")
T = TypeVar("T")


@asynccontextmanager
async def open_aio_host() -> AsyncIterator[None]:
    """Host an asyncio event loop inside the current Trio run for the block's duration.

    The loop's nurseries wrap whatever the block raises in an exception group; a group holding
    a single exception is unwrapped so callers catch the typed error they expect.
    """
    try:
        async with trio_asyncio.open_loop():
            yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


async def run_aio(fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the asyncio coroutine function ``fn`` from Trio and return its result.

    Trio cancellation cancels the asyncio side; asyncio exceptions propagate unchanged.
    """
    result: T = await trio_asyncio.aio_as_trio(fn)(*args, **kwargs)
    return result
