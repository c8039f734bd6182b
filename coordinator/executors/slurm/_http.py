"""The HTTP edge every slurmrestd version shares: JWT headers, and failures translated once.

Rules: httpx is seen here and nowhere above; a transport failure is :class:`SlurmUnreachable`,
401/403 :class:`SlurmAuthRefused`, an answer that is not a JSON object
:class:`SlurmProtocolError`. Slurm's own ``errors`` list is returned for the version module to
judge, because what an error number means depends on the call.
"""

from __future__ import annotations

from typing import Any

import httpx

from ._errors import SlurmAuthRefused, SlurmProtocolError, SlurmUnreachable
from ._token import token_user

DEFAULT_TIMEOUT_S = 30.0


class RestTransport:
    """One slurmrestd base URL and one token, over one pooled httpx client."""

    def __init__(self, url: str, token: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.user = token_user(token)
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers={"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": token.strip()},
            timeout=timeout_s,
        )

    async def request(
        self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """The status and JSON object of ``method path``; raises the typed errors above."""
        try:
            response = await self._client.request(method, path, json=json, params=params)
        except httpx.TransportError as error:
            raise SlurmUnreachable(
                f"slurmrestd at {self.url} did not answer {method} {path} ({error!r}); check "
                "that it runs and listens there."
            ) from None
        if response.status_code in (401, 403):
            raise SlurmAuthRefused(
                f"slurmrestd at {self.url} refused the token for user {self.user!r} "
                f"({response.status_code} {response.text.strip()[:200]!r}); make a new one with "
                "`scontrol token` and check that slurmctld has AuthAltTypes=auth/jwt."
            )
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise SlurmProtocolError(
                f"slurmrestd at {self.url} answered {method} {path} with status "
                f"{response.status_code} and no JSON object ({response.text.strip()[:200]!r})."
            )
        return response.status_code, body

    async def aclose(self) -> None:
        await self._client.aclose()


def slurm_errors(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Slurm's ``errors`` entries of an answer (each a JSON object)."""
    errors = body.get("errors") or []
    return [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []


def error_number(entry: dict[str, Any]) -> int | None:
    """A Slurm error's number: v0.0.38 writes ``error_number`` on reads, ``error_code`` on
    submit."""
    for key in ("error_number", "error_code"):
        value = entry.get(key)
        if isinstance(value, int):
            return value
    return None


def describe(errors: list[dict[str, Any]]) -> str:
    """Slurm's words for its errors, joined: the description when there is one."""
    words = [str(e.get("description") or e.get("error") or e) for e in errors]
    return "; ".join(words) or "no reason given"
