"""Runtime images at Preview, with real processes: a real Distribution registry on loopback TLS
(a test CA) with basic auth, and a real coordinator whose Fleets list it in coordinator.toml.

A tag is resolved to the digest the registry serves and the resolved JobSpec names the pinned
image, so its digest covers it; a retag changes no admitted Job but the next Preview pins the new
image. Every refusal names the registry and what to do, and changes nothing: no preview, no Job.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.cli.tp_process import run_tp_as
from tests.coordinator.grpc_client import api_client, job_ids, jobspec
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.oci_registry import RegistryProcess, start_registry, tar_layer
from tests.support.store_backend import StoreBackend, read, where_in
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.cli.project import init_project
from tuneplane.coordinator.cli.scaffold import new_experiment
from tuneplane.coordinator.store.core import Store
from tuneplane.proto import v1

USER, PASSWORD = "puller", "s3cret-pull-word"
WRONG_PASSWORD = "not-the-password"
SLOW_TIMEOUT_S = 2.0


@attrs.frozen
class Site:
    coord: CoordinatorProcess
    registry: RegistryProcess
    down: str  # a registry address where nothing listens
    stalled: str  # a registry address that accepts connections and never answers


def _config(registry: RegistryProcess, folder: Path, down: str, stalled: str) -> str:
    good, wrong = folder / "registry.password", folder / "wrong.password"
    good.write_text(PASSWORD + "\n")
    wrong.write_text(WRONG_PASSWORD + "\n")
    for path in (good, wrong):
        path.chmod(0o600)
    ca = registry.ca_file
    tables = [
        f'[fleet.default.registries."{registry.address}"]\nca_file = "{ca}"\n'
        f'username = "{USER}"\npassword_file = "{good}"\n',
        f'[fleet.wrong.registries."{registry.address}"]\nca_file = "{ca}"\n'
        f'username = "{USER}"\npassword_file = "{wrong}"\n',
        f'[fleet.down.registries."{down}"]\nca_file = "{ca}"\n',
        f'[fleet.slow.registries."{stalled}"]\nca_file = "{ca}"\ntimeout_s = {SLOW_TIMEOUT_S}\n',
    ]
    profiles = [
        f'[profiles.cpu-{name}]\nseries = "cpu"\nfleet = "{name}"\n'
        for name in ("wrong", "down", "slow")
    ]
    return "\n" + "\n".join(tables + profiles)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def site(
    tmp_path_factory: pytest.TempPathFactory, module_store_backend: StoreBackend
) -> Iterator[Site]:
    folder = tmp_path_factory.mktemp("image-pin")
    # Accepts TCP connections (the kernel's backlog) but never reads or answers a byte.
    stalled_sock = socket.socket()
    stalled_sock.bind(("127.0.0.1", 0))
    stalled_sock.listen(16)
    stalled = f"127.0.0.1:{stalled_sock.getsockname()[1]}"
    down = f"127.0.0.1:{_free_port()}"
    try:
        with start_registry(folder / "registry", users={USER: PASSWORD}) as registry:
            config = _config(registry, folder, down, stalled)
            with start_coordinator(folder, config=config) as coord:
                for fleet in ("wrong", "down", "slow"):
                    made = coord.admin("fleet", "create", fleet)
                    assert made.returncode == 0, made.stderr
                yield Site(coord, registry, down, stalled)
    finally:
        stalled_sock.close()


def _push(registry: RegistryProcess, name: str, tag: str, marker: str) -> str:
    """Push a one-layer image tagged ``tag`` and return its pinned runtime id."""
    layer = tar_layer([("etc/marker", marker.encode())])
    return registry.push_image(name, [layer], tag=tag).ref_text(registry.address)


def _spec(runtime_id: str, profile: str = "cpu", project: str = "images") -> dict[str, Any]:
    spec = jobspec(gpus=0, profile=profile, project=project)
    spec["runtime_id"] = runtime_id
    return spec


def _counts(coord: CoordinatorProcess) -> tuple[int, int]:
    """(previews, Jobs) in the store, as an operator's sqlite3 or psql would count them."""
    where = where_in(coord.state_dir)
    ((previews,),) = read(where, Store, "SELECT COUNT(*) FROM previews")
    ((jobs,),) = read(where, Store, "SELECT COUNT(*) FROM jobs")
    return int(previews), int(jobs)


async def _preview(coord: CoordinatorProcess, spec: dict[str, Any]) -> v1.PreviewReply:
    async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
        return await api.preview(spec)


def _refusal(coord: CoordinatorProcess, spec: dict[str, Any]) -> GRPCError:
    """The Preview's refusal, after checking that it changed nothing."""
    before, jobs_before = _counts(coord), asyncio.run(job_ids(coord))
    with pytest.raises(GRPCError) as refused:
        asyncio.run(_preview(coord, spec))
    assert _counts(coord) == before
    assert asyncio.run(job_ids(coord)) == jobs_before
    return refused.value


def test_a_tag_is_pinned_at_preview_and_a_retag_changes_no_admitted_job(site: Site) -> None:
    coord, registry = site.coord, site.registry
    first = _push(registry, "team/app", "v1", "first")
    tagged = f"image:{registry.address}/team/app:v1"

    async def admit() -> tuple[v1.PreviewReply, v1.Receipt, v1.Job]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            preview = await api.preview(_spec(tagged))
            receipt = await api.commit(preview, "key-image-tag")
            return preview, receipt, await api.job(receipt.run_id)

    preview, receipt, job = asyncio.run(admit())
    resolved = json.loads(preview.resolved_jobspec_json)
    assert resolved["runtime_id"] == first
    assert preview.summary.image_tag == "v1"
    # The digest is over the canonical resolved JobSpec, which names the pinned image.
    canonical = json.dumps(resolved, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert preview.digest == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    assert (job.runtime_id, job.digest) == (first, preview.digest)
    (admission,) = [d for d in coord.decisions("admission") if d["run_id"] == receipt.run_id]
    assert admission["detail"]["runtime_id"] == first
    assert admission["detail"]["image_tag"] == "v1"

    # Retag v1 to another image: the admitted Job keeps its image and digest...
    second = _push(registry, "team/app", "v1", "second")
    assert second != first

    async def after() -> tuple[v1.Job, v1.PreviewReply]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            return await api.job(receipt.run_id), await api.preview(_spec(tagged))

    job_after, again = asyncio.run(after())
    assert (job_after.runtime_id, job_after.digest) == (first, preview.digest)
    stored = read(
        where_in(coord.state_dir),
        Store,
        "SELECT p.resolved_json FROM jobs j JOIN previews p ON p.id = j.preview_id "
        "WHERE j.run_id = ?",
        (receipt.run_id,),
    )
    assert json.loads(stored[0][0])["runtime_id"] == first
    # ...while a new Preview pins the image the tag names now, under another digest.
    assert json.loads(again.resolved_jobspec_json)["runtime_id"] == second
    assert again.digest != preview.digest

    # tp job show prints the pinned image.
    shown = run_tp_as(coord, None, "job", "show", receipt.run_id)
    assert shown.returncode == 0, shown.stderr
    assert "Runtime" in shown.stdout and first in shown.stdout
    as_json = run_tp_as(coord, None, "job", "show", receipt.run_id, "--json")
    assert json.loads(as_json.stdout)["runtime_id"] == first


def test_a_pinned_digest_is_kept_and_an_index_keeps_its_own_digest(site: Site) -> None:
    coord, registry = site.coord, site.registry
    pinned = _push(registry, "team/pinned", "latest", "pinned")
    reply = asyncio.run(_preview(coord, _spec(pinned)))
    assert json.loads(reply.resolved_jobspec_json)["runtime_id"] == pinned
    assert reply.summary.image_tag == ""

    amd64 = registry.push_image("team/multi", [tar_layer([("etc/arch", b"amd64")])])
    arm64 = registry.push_image("team/multi", [tar_layer([("etc/arch", b"arm64")])])
    index = registry.push_index("team/multi", {"linux/amd64": amd64, "linux/arm64": arm64})
    reply = asyncio.run(_preview(coord, _spec(f"image:{registry.address}/team/multi:multi")))
    # The index's digest, not one platform's: the Node picks its platform at Prepare.
    assert json.loads(reply.resolved_jobspec_json)["runtime_id"] == index.ref_text(registry.address)


def test_a_registry_the_fleet_does_not_list_is_refused_before_any_lookup(site: Site) -> None:
    refused = _refusal(site.coord, _spec("image:registry.example.org/team/app:v1"))
    assert refused.status == Status.INVALID_ARGUMENT
    message = str(refused.message)
    assert "runtime_id" in message and "registry.example.org" in message
    assert "resources.profile" in message and "'default'" in message
    assert '[fleet.default.registries."registry.example.org"]' in message
    # A Fleet that lists another registry refuses this one too, and names what it lists.
    refused = _refusal(site.coord, _spec(f"image:{site.registry.address}/team/app:v1", "cpu-down"))
    assert site.down in str(refused.message)


def test_a_tag_the_registry_does_not_have_is_refused(site: Site) -> None:
    _push(site.registry, "team/app2", "v1", "app2")
    refused = _refusal(site.coord, _spec(f"image:{site.registry.address}/team/app2:no-such-tag"))
    assert refused.status == Status.FAILED_PRECONDITION
    message = str(refused.message)
    assert "no-such-tag" in message and site.registry.address in message
    assert "HTTP 404" in message


def test_a_digest_the_registry_does_not_have_is_refused(site: Site) -> None:
    missing = f"image:{site.registry.address}/team/app@sha256:{'ab' * 32}"
    refused = _refusal(site.coord, _spec(missing))
    assert refused.status == Status.FAILED_PRECONDITION
    assert f"sha256:{'ab' * 32}" in str(refused.message)
    assert "HTTP 404" in str(refused.message)


def test_wrong_credentials_name_the_registry_and_the_user_never_the_password(site: Site) -> None:
    _push(site.registry, "team/app3", "v1", "app3")
    spec = _spec(f"image:{site.registry.address}/team/app3:v1", "cpu-wrong")
    refused = _refusal(site.coord, spec)
    message = str(refused.message)
    assert refused.status == Status.FAILED_PRECONDITION
    assert site.registry.address in message and f"user {USER!r}" in message
    assert '[fleet.wrong.registries."' in message
    assert WRONG_PASSWORD not in message and PASSWORD not in message
    assert WRONG_PASSWORD not in site.coord.read_log()


def test_a_registry_that_is_down_is_refused_at_once(site: Site) -> None:
    started = time.monotonic()
    refused = _refusal(site.coord, _spec(f"image:{site.down}/team/app:v1", "cpu-down"))
    assert time.monotonic() - started < 5
    assert refused.status == Status.FAILED_PRECONDITION
    assert f"The registry {site.down} could not be reached" in str(refused.message)


def test_a_stalled_registry_is_refused_at_its_deadline_and_stalls_no_other_preview(
    site: Site,
) -> None:
    coord, registry = site.coord, site.registry
    good = _push(registry, "team/app4", "v1", "app4")
    stalled = _spec(f"image:{site.stalled}/team/app:v1", "cpu-slow")

    async def both() -> tuple[BaseException | None, float, float, v1.PreviewReply]:
        start = time.monotonic()
        slow = asyncio.create_task(_preview(coord, stalled))
        await asyncio.sleep(0.2)  # the stalled lookup is under way
        fast = await _preview(coord, _spec(f"image:{registry.address}/team/app4:v1"))
        fast_at = time.monotonic() - start
        try:
            await slow
            error: BaseException | None = None
        except GRPCError as exc:
            error = exc
        return error, fast_at, time.monotonic() - start, fast

    before = _counts(coord)
    error, fast_at, slow_at, fast = asyncio.run(both())
    assert json.loads(fast.resolved_jobspec_json)["runtime_id"] == good
    assert fast_at < SLOW_TIMEOUT_S, "a stalled registry held up another Preview"
    assert SLOW_TIMEOUT_S - 0.5 <= slow_at < SLOW_TIMEOUT_S + 3
    assert isinstance(error, GRPCError) and error.status == Status.FAILED_PRECONDITION
    message = str(error.message)
    assert f"{site.stalled} did not answer within {SLOW_TIMEOUT_S:g} s" in message
    assert "timeout_s" in message
    assert _counts(coord) == (before[0] + 1, before[1])  # only the good preview


def test_tp_submit_image_previews_the_pinned_image(site: Site, tmp_path: Path) -> None:
    coord, registry = site.coord, site.registry
    pinned = _push(registry, "team/tp", "2.4", "tp")
    made = init_project(tmp_path / "proj", "imagetp")
    new_experiment(made, "hello", "custom/custom", Catalogue.bundled())
    image = f"{registry.address}/team/tp:2.4"
    human = run_tp_as(coord, None, "submit", "hello", "--profile", "cpu:0", "--image", image,
                      "--preview", cwd=made.root)  # fmt: skip
    assert human.returncode == 0, human.stderr
    assert pinned in human.stdout and "tag '2.4' pinned at Preview" in human.stdout
    scripted = run_tp_as(coord, None, "submit", "hello", "--profile", "cpu:0", "--image", image,
                         "--preview", "--json", cwd=made.root)  # fmt: skip
    assert scripted.returncode == 0, scripted.stderr
    line = json.loads(scripted.stdout.splitlines()[0])
    assert line["runtime_id"] == pinned and line["summary"]["image_tag"] == "2.4"
