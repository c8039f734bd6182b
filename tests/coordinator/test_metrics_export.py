"""The coordinator's metrics where they are computed: coordinator.toml's [metrics], the RPC
latency wrapper (every outcome gets a code), and the store's gauges read from a real store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status

from tests.support.store_backend import current
from tuneplane.agent.metrics_listener import MetricsListener
from tuneplane.coordinator.config import DEFAULT_CONFIG, ConfigError, parse_config
from tuneplane.coordinator.counters import REGISTRY
from tuneplane.coordinator.server.metrics_export import method_label, timed_handlers
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.gauges import LIVE_JOB_STATES, StoreGauges, read_gauges

PATH = Path("/etc/tuneplane/coordinator.toml")


def test_metrics_are_off_by_default_and_loopback_on_7446_when_asked() -> None:
    assert parse_config(DEFAULT_CONFIG, PATH).metrics is None
    on = parse_config(DEFAULT_CONFIG + "\n[metrics]\n", PATH)
    assert on.metrics == MetricsListener("127.0.0.1", 7446)
    wide = parse_config(DEFAULT_CONFIG + '\n[metrics]\nhost = "0.0.0.0"\nport = 0\n', PATH)
    assert wide.metrics == MetricsListener("0.0.0.0", 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[metrics]\nport = "7446"\n', "[metrics] port = '7446' must be a whole number"),
        ("[metrics]\nport = 65536\n", "[metrics] port = 65536 must be a whole number"),
        ("[metrics]\nhost = 127\n", "[metrics] host = 127 is not an IP address"),
        ("[metrics]\nhosts = 1\n", "[metrics] has unknown key(s) hosts"),
    ],
)
def test_wrong_metrics_settings_are_refused_naming_the_key(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(DEFAULT_CONFIG + "\n" + text, PATH)
    assert str(refused.value).startswith(f"{PATH}: ") and expected in str(refused.value)


def test_the_method_label_is_service_and_method() -> None:
    assert method_label("/tuneplane.v1.Api/Commit") == "Api/Commit"
    assert method_label("/tuneplane.v1.Control/Connect") == "Control/Connect"


class _Service:
    def __init__(self, outcome: BaseException | None) -> None:
        self.outcome = outcome

    async def handle(self, stream: Any) -> None:
        if self.outcome is not None:
            raise self.outcome

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Probe/Call": Handler(self.handle, Cardinality.UNARY_UNARY, None, None)
        }


def _count(code: str) -> float:
    """How many Probe/Call calls ended with ``code``, as a scrape would read it."""
    found = REGISTRY.get_sample_value(
        "tuneplane_coordinator_rpc_duration_seconds_count",
        {"method": "Probe/Call", "code": code},
    )
    return found or 0.0


async def test_every_outcome_of_a_call_is_observed_with_its_code() -> None:
    outcomes: list[tuple[BaseException | None, str]] = [
        (None, "OK"),
        (GRPCError(Status.NOT_FOUND, "no such Job"), "NOT_FOUND"),
        (RuntimeError("a bug"), "UNKNOWN"),
    ]
    for outcome, code in outcomes:
        before = _count(code)
        (service,) = timed_handlers([_Service(outcome)])
        handler = service.__mapping__()["/tuneplane.v1.Probe/Call"]
        if outcome is None:
            await handler.func(object())
        else:
            with pytest.raises(type(outcome)):
                await handler.func(object())
        assert _count(code) == before + 1, code


def test_a_fresh_store_reads_as_empty_gauges(tmp_path: Path) -> None:
    async def read() -> StoreGauges:
        store = await Store.open(current().where(tmp_path / "coordinator.db"))
        try:
            return await asyncio.wait_for(read_gauges(store, 1_000), 10)
        finally:
            await store.close()

    gauges = asyncio.run(read())
    assert gauges.jobs == dict.fromkeys(LIVE_JOB_STATES, 0)
    assert gauges.nodes == {"connected": 0, "disconnected": 0, "revoked": 0}
    assert gauges.queue_length == 0
    assert gauges.oldest_queued_ms is None and gauges.longest_disconnected_ms == 0
