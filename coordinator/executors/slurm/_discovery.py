"""Which slurmrestd OpenAPI version to speak: the newest one that both sides know.

Rules: the versions a server offers are read from its OpenAPI document (``/openapi/v3``): every
``/slurm/<version>/ping`` path is one. :data:`IMPLEMENTATIONS` lists what this coordinator
speaks; none in common is :class:`SlurmVersionUnsupported` with a sentence naming both lists.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from ._errors import SlurmProtocolError, SlurmVersionUnsupported
from ._http import DEFAULT_TIMEOUT_S, RestTransport
from ._protocol import SlurmRest
from ._v0038 import RestV0038

IMPLEMENTATIONS: dict[str, Callable[[RestTransport], SlurmRest]] = {"v0.0.38": RestV0038}
_PING = re.compile(r"^/slurm/(v\d+\.\d+\.\d+)/ping$")


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.removeprefix("v").split("."))


def offered_versions(openapi: dict[str, Any]) -> list[str]:
    """The versions an OpenAPI document serves (``/slurm/<version>/ping``), oldest first."""
    paths = openapi.get("paths")
    if not isinstance(paths, dict):
        raise SlurmProtocolError("slurmrestd's OpenAPI document has no 'paths' object.")
    found = {m[1] for path in paths if (m := _PING.match(str(path)))}
    return sorted(found, key=_key)


def choose_version(offered: Iterable[str], url: str = "slurmrestd") -> str:
    """The newest version in ``offered`` that :data:`IMPLEMENTATIONS` speaks."""
    offered = list(offered)
    common = [v for v in offered if v in IMPLEMENTATIONS]
    if not common:
        raise SlurmVersionUnsupported(
            f"{url} serves the Slurm OpenAPI versions {', '.join(offered) or 'none'}, and this "
            f"coordinator speaks only {', '.join(sorted(IMPLEMENTATIONS, key=_key))}; run a "
            "slurmrestd that loads one of those (its -s option lists the openapi/ plugins)."
        )
    return max(common, key=_key)


async def open_slurm_rest(url: str, token: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> SlurmRest:
    """A :class:`SlurmRest` for the slurmrestd at ``url``, in the newest version both speak;
    the caller closes it (``aclose``)."""
    transport = RestTransport(url, token, timeout_s)
    try:
        status, document = await transport.request("GET", "/openapi/v3")
        if status != 200:
            raise SlurmProtocolError(
                f"slurmrestd at {transport.url} answered /openapi/v3 with status {status}; "
                "it is not a slurmrestd this coordinator can read."
            )
        version = choose_version(offered_versions(document), transport.url)
    except BaseException:
        await transport.aclose()
        raise
    return IMPLEMENTATIONS[version](transport)
