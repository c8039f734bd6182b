"""Fetch grants and the holder's facts, on a real store file: what a Node's Hello.outputs leaves
in the store, the grant each Prepare naming a holder carries as it leaves (one the holder's key
accepts for exactly that source member), and what Preview learns of a holder."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.coordinator import stored_outputs_service
from tests.support.store_backend import current
from tuneplane.coordinator.derivation import GRANT_TTL_MS, Holder
from tuneplane.coordinator.gateways.outputs_grants import (
    FetchSource,
    accepted_service,
    attach,
    check_service,
    fetch_source,
    grant_for,
)
from tuneplane.coordinator.store import identity as store_identity
from tuneplane.coordinator.store.core import Store, db_path
from tuneplane.coordinator.store.fleet_views import holder, outputs_services
from tuneplane.coordinator.store.lost_nodes import declare_node_lost
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.orders import (
    CommitOrder,
    Inventory,
    Order,
    OutputsService,
    PrepareOrder,
)
from tuneplane.proto.contract.derivation_source import InitFromSource
from tuneplane.proto.contract.jobspec import canonical_json, loads
from tuneplane.proto.contract.outputs_grant import GRANT_KEY_BYTES, grant_valid

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
NOW = 1_700_000_000_000
KEY = bytes(range(GRANT_KEY_BYTES))
SERVICE = OutputsService("10.0.0.7:7463", "cd" * 32, KEY)
SOURCE = InitFromSource(
    "run-src", 2, 0, "/var/lib/tp/out/run-src/attempt-2/member-0", "ab" * 32, 3, 4096,
    node_id="node-h",
)  # fmt: skip


def _spec(source: InitFromSource | None) -> str:
    data = {
        "api_version": "tuneplane/v1",
        "project": "p",
        "experiment": "e",
        "method_id": "custom/custom",
        "recipe_digest": "sha256:" + "0" * 64,
        "runtime_id": "host:python3",
        "entrypoint": ["bash", "train.sh"],
        "resources": {"profile": "h200:1", "series": "", "gpus": 1},
    }
    if source is not None:
        data |= {"init_from": source.run_id, "init_from_source": attrs.asdict(source)}
    return canonical_json(loads(json.dumps(data)))


def _prepare(node_id: str, source: InitFromSource | None, index: int = 0) -> PrepareOrder:
    return PrepareOrder(
        node_id=node_id,
        member=MemberKey("run-new", 1, index),
        jobspec_json=_spec(source),
        member_count=2,
        gpu_indexes=(0,),
        pick_rendezvous=index == 0,
        capsule_files={},
    )


# --- pure: what a Hello may store, which JobSpec names a holder -----------------------------


@pytest.mark.parametrize(
    ("service", "said"),
    [
        (attrs.evolve(SERVICE, address="no-port"), "is not HOST:PORT"),
        (attrs.evolve(SERVICE, address="10.0.0.7:0"), "is not HOST:PORT"),
        (attrs.evolve(SERVICE, address="10.0.0.7:65536"), "is not HOST:PORT"),
        (attrs.evolve(SERVICE, address="a b:7463"), "is not HOST:PORT"),
        (attrs.evolve(SERVICE, address="h\n:7463"), "printable ASCII"),
        (attrs.evolve(SERVICE, address="h" * 300 + ":7463"), "at most 300"),
        (attrs.evolve(SERVICE, cert_sha256="CD" * 32), "64 lowercase hex"),
        (attrs.evolve(SERVICE, cert_sha256="cd" * 31), "64 lowercase hex"),
        (attrs.evolve(SERVICE, grant_key=KEY[:-1]), "grant_key is 31 bytes, not 32"),
        (attrs.evolve(SERVICE, grant_key=KEY + b"x"), "grant_key is 33 bytes, not 32"),
    ],
)
def test_a_malformed_outputs_service_is_refused_and_logged(
    service: OutputsService, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    why = check_service(service)
    assert why is not None and said in why
    with caplog.at_level("WARNING"):
        assert accepted_service("node-h", service) is None
    assert "outputs service refused node=node-h why=" in caplog.text


def test_a_well_formed_outputs_service_is_kept_and_its_key_never_shown() -> None:
    assert check_service(SERVICE) is None
    assert check_service(attrs.evolve(SERVICE, address="[fd00::7]:7463")) is None
    assert accepted_service("node-h", SERVICE) == SERVICE
    assert accepted_service("node-h", None) is None
    assert KEY.hex() not in repr(SERVICE) and repr(KEY) not in repr(SERVICE)


def test_only_a_jobspec_whose_source_names_a_holder_fetches() -> None:
    assert fetch_source(_spec(SOURCE)) == FetchSource("node-h", MemberKey("run-src", 2, 0))
    assert fetch_source(_spec(attrs.evolve(SOURCE, node_id=""))) is None
    assert fetch_source(_spec(None)) is None
    # A key that only looks like the source, nested in the Job's own env, is not one.
    nested = json.loads(_spec(None))
    nested["env"] = {"X": '"init_from_source": {"node_id": "node-h"}'}
    assert fetch_source(json.dumps(nested)) is None
    assert fetch_source('{"init_from_source": {"node_id": "node-h"}') is None


@given(
    run_id=st.from_regex(r"run-[0-9a-f]{1,12}", fullmatch=True),
    attempt=st.integers(1, 1000),
    index=st.integers(0, 31),
)
def test_a_grant_fits_its_source_member_only(run_id: str, attempt: int, index: int) -> None:
    source = attrs.evolve(SOURCE, run_id=run_id, attempt=attempt, member_index=index)
    order = _prepare("node-t", source)
    found = fetch_source(order.jobspec_json)
    assert found == FetchSource("node-h", MemberKey(run_id, attempt, index))
    assert found is not None
    grant = grant_for(SERVICE, found.member, NOW)
    assert grant.grant_expires_at_ms == NOW + GRANT_TTL_MS
    valid = (KEY, grant.grant, run_id, attempt, index, grant.grant_expires_at_ms)
    assert grant_valid(*valid, NOW)
    assert not grant_valid(*valid, grant.grant_expires_at_ms)  # expired
    assert not grant_valid(KEY, grant.grant, run_id, attempt + 1, index, valid[5], NOW)
    assert not grant_valid(KEY, grant.grant, run_id, attempt, index + 1, valid[5], NOW)
    assert not grant_valid(bytes(32), grant.grant, run_id, attempt, index, valid[5], NOW)


# --- on a real store file -------------------------------------------------------------------


def _with_store(tmp_path: Path, work: Callable[[Store], Awaitable[T]]) -> T:
    async def go() -> T:
        store = await Store.open(current().where(db_path(tmp_path)))
        try:
            await store.bootstrap("admin-hash", NOW)
            for node_id in ("node-h", "node-t"):
                token = secrets.token_hex(8)
                await store.create_join_token(token, "default", NOW, NOW + 60_000)
                await store.enroll(token, node_id, Inventory(node_id), f"cred-{node_id}", NOW)
            return await work(store)
        finally:
            await store.close()

    return asyncio.run(go())


def test_each_prepare_naming_a_holder_gets_a_fresh_grant_as_it_leaves(tmp_path: Path) -> None:
    async def work(store: Store) -> tuple[list[Order], list[Order], list[Order]]:
        await store.node_connected("node-h", Inventory("node-h"), [], NOW, "", SERVICE)
        orders: list[Order] = [
            _prepare("node-t", SOURCE),
            _prepare("node-h", SOURCE, 1),  # the holder itself gets one too: it decides
            _prepare("node-t", None),
            CommitOrder("node-t", MemberKey("run-other", 1, 0), "10.0.0.1", 29500),
        ]
        first = await attach(store, orders, NOW)
        again = await attach(store, orders, NOW + 5)
        # The holder's next Hello says it serves nothing: the next Prepare goes without.
        await store.node_connected("node-h", Inventory("node-h"), [], NOW + 9, "", None)
        after = await attach(store, orders, NOW + 10)
        return first, again, after

    first, again, after = _with_store(tmp_path, work)
    for made, at in ((first, NOW), (again, NOW + 5)):
        for order in made[:2]:
            assert isinstance(order, PrepareOrder) and order.init_from_fetch is not None
            fetch = order.init_from_fetch
            assert (fetch.address, fetch.cert_sha256) == (SERVICE.address, SERVICE.cert_sha256)
            assert fetch.grant_expires_at_ms == at + GRANT_TTL_MS
            assert grant_valid(KEY, fetch.grant, "run-src", 2, 0, fetch.grant_expires_at_ms, at)
            assert fetch.grant not in repr(order)
        assert made[2:] == [first[2], first[3]]
        assert isinstance(made[2], PrepareOrder) and made[2].init_from_fetch is None
    grants = {
        o.init_from_fetch.grant
        for o in (*first[:2], *again[:2])
        if isinstance(o, PrepareOrder) and o.init_from_fetch is not None
    }
    assert len(grants) == 2  # fresh on resend
    assert all(isinstance(o, PrepareOrder) and o.init_from_fetch is None for o in after[:3])
    assert stored_outputs_service(tmp_path, "node-h") == ("", "", "")


def test_a_malformed_hello_never_overwrites_with_its_parts(tmp_path: Path) -> None:
    bad = attrs.evolve(SERVICE, grant_key=b"short")

    async def work(store: Store) -> None:
        await store.node_connected("node-h", Inventory("node-h"), [], NOW, "", SERVICE)
        await store.node_connected(
            "node-h", Inventory("node-h"), [], NOW + 1, "", accepted_service("node-h", bad)
        )

    _with_store(tmp_path, work)
    assert stored_outputs_service(tmp_path, "node-h") == ("", "", "")


def test_a_stored_service_is_read_back_whole(tmp_path: Path) -> None:
    async def work(store: Store) -> dict[str, OutputsService]:
        await store.node_connected("node-h", Inventory("node-h"), [], NOW, "", SERVICE)
        return await outputs_services(store, {"node-h", "node-t", "node-x"})

    assert _with_store(tmp_path, work) == {"node-h": SERVICE}
    assert stored_outputs_service(tmp_path, "node-h") == (
        SERVICE.address,
        SERVICE.cert_sha256,
        KEY.hex(),
    )


def test_preview_learns_whether_the_holder_serves_is_lost_or_revoked(tmp_path: Path) -> None:
    async def work(store: Store) -> tuple[list[Holder | None], dict[str, OutputsService]]:
        seen = [await holder(store, "node-h")]
        await store.node_connected("node-h", Inventory("node-h"), [], NOW, "", SERVICE)
        seen.append(await holder(store, "node-h"))
        await store.node_disconnected("node-h", NOW + 1, "the stream ended")
        await declare_node_lost(
            store, "node-h", "admin", "the machine burned", NOW + 2, connected=False
        )
        seen.append(await holder(store, "node-h"))
        await store.node_connected("node-h", Inventory("node-h"), [], NOW + 3, "", SERVICE)
        seen.append(await holder(store, "node-h"))
        await store_identity.revoke_node(store, "node-h", "admin", "decommissioned", NOW + 4)
        seen.append(await holder(store, "node-h"))
        seen.append(await holder(store, "node-gone"))
        return seen, await outputs_services(store, {"node-h"})

    seen, services = _with_store(tmp_path, work)
    h = Holder("node-h", "node-h")
    served = attrs.evolve(h, outputs_address=SERVICE.address)
    assert seen == [
        h,  # enrolled, never connected: serves nothing yet
        served,
        attrs.evolve(served, lost=True),
        served,  # connected since it was declared lost
        attrs.evolve(served, retired=True),
        None,
    ]
    assert services == {}  # a revoked holder gets no grant
