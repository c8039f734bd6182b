"""The retry that `tp job show --watch` and `tp logs --follow` share through an outage."""

from __future__ import annotations

import asyncio

import pytest

from tuneplane.coordinator.cli.api_errors import CoordinatorUnreachable, RequestRefused
from tuneplane.coordinator.cli.watch import Outage


def test_an_unreachable_coordinator_is_kept_as_a_sentence_and_cleared_on_an_answer() -> None:
    outage = Outage(0.5)
    answers: list[object] = [CoordinatorUnreachable("Cannot reach the coordinator."), 7]

    async def fetch() -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, int)
        return answer

    async def go() -> None:
        assert await outage.poll(fetch) is None
        assert outage.problem == "Cannot reach the coordinator. Retrying every 0.5 s."
        assert await outage.poll(fetch) == 7
        assert outage.problem == ""

    asyncio.run(asyncio.wait_for(go(), 10))


def test_a_refusal_is_not_an_outage() -> None:
    async def fetch() -> int:
        raise RequestRefused("PERMISSION_DENIED", "the Job belongs to alice.")

    with pytest.raises(RequestRefused):
        asyncio.run(asyncio.wait_for(Outage(0.5).poll(fetch), 10))
