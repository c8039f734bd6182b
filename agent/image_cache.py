"""The Node's content-addressed cache of runtime images: blobs verified by digest, and each image's
root filesystem unpacked once, in full, before any member may use it.

Layout under the cache's directory (``<state_dir>/images`` in the agent)::

    blobs/sha256/<hex>        every verified blob: manifests, indexes, configs, layers
    partial/<hex>             a blob being streamed (resumed from its length after a crash)
    roots/<image hex>/        an image's unpacked root filesystem, renamed here when complete
    roots/.build-<image hex>-<pid>-<random>/   a root being unpacked (removed if left behind)
    images/<image hex>.json   the image's record: manifest, config (Env, WorkingDir, ...), layers
    locks/<hex>.lock          flock(2) files: one process at a time per image and per blob
    locks/cache.lock          held shared by every pull while it writes, exclusively by removal
    used/<image hex>          when a member last used the image (the size limit's LRU order)
    sizes/<image hex>         the root's bytes on disk, measured once (agent/image_store.py)

Rules:
- ``<image hex>`` is the digest the runtime pins (an image index's when it names an index), so a
  member's runtime finds its root without asking the registry anything.
- An image is ready when its record exists; the record is written after the root is renamed into
  place, and a root without a record is completed from the blobs (no network). A file appears
  under ``blobs/`` only verified, under ``roots/`` only whole.
- One process pulls an image or a blob at a time: a trio.Lock per digest inside the process and
  an flock across processes, so concurrent ``ensure`` calls of one image pull each blob once and
  a second agent (or a restarted one) waits, then finds it ready or resumes it.
- Unpacking runs in a worker thread; the event loop only waits for it.
- Removal (``tuneplane-node images``, the size limit) is agent/image_removal.py's: it waits for
  the cache's lock, which every pull holds shared, so it never removes what a pull writes.
  With a :class:`CacheLimit`, a pull that completes evicts least recently used images; that
  never fails the pull (it is logged).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .atomic_file import fsync_dir, write_atomic, write_json_atomic
from .crashpoint import crashpoint
from .image_access import RegistryAccess
from .image_errors import ImageError, ImageRefused, ManifestRefused
from .image_manifest import (
    Descriptor,
    ImageConfig,
    Index,
    Manifest,
    Platform,
    expect,
    host_platform,
    read_config,
    read_document,
    select_manifest,
)
from .image_ref import ImageRef
from .image_removal import (
    Eviction,
    evict,
    remove_tree,
)
from .image_store import (
    gc_lock_path,
    keep_root_bytes,
    mark_used,
    try_lock,
)
from .image_usage import ImageUsage
from .sizes import human_bytes

if TYPE_CHECKING:
    from .image_pull import RegistryClient

log = logging.getLogger(__name__)

RECORD_VERSION = 1
_LOCK_POLL_S = 0.05


@attrs.frozen
class PullProgress:
    """How far an image is: blob bytes on disk of all it needs, layers verified of all, and the
    phase (``pulling``, ``unpacking``, ``ready``)."""

    bytes_done: int
    bytes_total: int
    layers_done: int
    layers_total: int
    phase: str


ProgressCallback = Callable[[PullProgress], None]
#: Gives the registry's client, opening it the first time it is called.
ClientFor = Callable[[], Awaitable["RegistryClient"]]


@attrs.frozen
class ReadyImage:
    """An image ready for members: its root filesystem (never written to) and its config."""

    ref: ImageRef
    root: Path
    config: ImageConfig
    manifest_digest: str  # the platform manifest's, ``sha256:…``
    layers: int
    bytes: int  # of its blobs (compressed layers and the config)


@attrs.frozen
class CacheLimit:
    """node.toml's ``[images] max_size`` (bytes) and how to learn which images live members use
    (:func:`tuneplane.agent.image_usage.read_usage` of the journal, in the agent)."""

    max_bytes: int
    usage: Callable[[], ImageUsage]


@attrs.frozen
class ImagePlan:
    """What :meth:`ImageCache.ensure` still has to do for one image (see :func:`plan_image`)."""

    fetch: tuple[Descriptor, ...]
    unpack: bool
    write_record: bool


def plan_image(
    manifest: Manifest, have_blobs: frozenset[str], root_ready: bool, record_ready: bool
) -> ImagePlan:
    """What is left to make the image of ``manifest`` ready (pure): the blobs to fetch (the
    config always, layers only when the root must be unpacked), whether to unpack, whether to
    write the record. The config is needed for the record; layers only for unpacking."""
    if root_ready and record_ready:
        return ImagePlan((), unpack=False, write_record=False)
    needed = manifest.blobs if not root_ready else (manifest.config,)
    seen: set[str] = set()
    fetch = []
    for blob in needed:
        if blob.digest_hex not in have_blobs and blob.digest_hex not in seen:
            seen.add(blob.digest_hex)
            fetch.append(blob)
    return ImagePlan(tuple(fetch), unpack=not root_ready, write_record=True)


@attrs.define
class _Progress:
    """Progress of one ensure, told to its callback as blobs land."""

    callback: ProgressCallback | None
    bytes_total: int = 0
    layers_total: int = 0
    bytes_done: int = 0
    layers_done: int = 0
    phase: str = "pulling"
    layer_digests: frozenset[str] = frozenset()

    def tell(self) -> None:
        if self.callback is not None:
            self.callback(
                PullProgress(
                    self.bytes_done,
                    self.bytes_total,
                    self.layers_done,
                    self.layers_total,
                    self.phase,
                )
            )

    def add_bytes(self, n: int) -> None:
        self.bytes_done += n
        self.tell()


class ImageCache:
    """The cache under ``directory``; ``registries`` maps ``host[:port]`` to how this Node
    reaches it (a registry not listed is reached with the system's CAs and no credentials)."""

    def __init__(
        self,
        directory: Path,
        registries: Mapping[str, RegistryAccess] | None = None,
        *,
        platform: Platform | None = None,
        concurrent_blobs: int = 3,
        client_options: Mapping[str, Any] | None = None,
        limit: CacheLimit | None = None,
    ) -> None:
        self.directory = directory
        self.limit = limit
        self.registries = dict(registries or {})
        self.platform = platform or host_platform()
        self.client_options = dict(client_options or {})
        self._limiter = trio.CapacityLimiter(concurrent_blobs)
        self._locks: dict[str, trio.Lock] = {}
        #: Every registry client this cache opened, in order: what tests count requests with.
        self.clients: list[RegistryClient] = []

    # -- paths -----------------------------------------------------------------------------

    def blob_path(self, digest_hex: str) -> Path:
        return self.directory / "blobs" / "sha256" / digest_hex

    def root_path(self, ref: ImageRef) -> Path:
        return self.directory / "roots" / ref.digest_hex

    def record_path(self, ref: ImageRef) -> Path:
        return self.directory / "images" / f"{ref.digest_hex}.json"

    # -- the public calls ------------------------------------------------------------------

    def ready(self, ref: ImageRef) -> ReadyImage | None:
        """The image when it is ready in the cache (no network, no waiting), else ``None``."""
        try:
            record = json.loads(self.record_path(ref).read_bytes())
        except FileNotFoundError:
            return None
        if not self.root_path(ref).is_dir():
            return None
        config = record["config"]
        return ReadyImage(
            ref=ref,
            root=self.root_path(ref),
            config=ImageConfig.from_json(config),
            manifest_digest=record["manifest"],
            layers=len(record["layers"]),
            bytes=record["bytes"],
        )

    async def ensure(self, ref: ImageRef, progress: ProgressCallback | None = None) -> ReadyImage:
        """Make the image ``ref`` ready (pull what is missing, verify, unpack) and return it.

        Raises an :class:`~tuneplane.agent.image_errors.ImageError` whose ``str()`` says why
        the image cannot be had; what was verified stays cached for the next call."""
        await trio.lowlevel.checkpoint()
        found = self.ready(ref)
        pulled = False
        if found is None:
            async with self._exclusive(ref.digest_hex):
                found = self.ready(ref)  # another task or process made it while this one waited
                if found is None:
                    async with self._writing(), self._clients(ref) as client_for:
                        manifest_hex, manifest = await self._manifest(ref, client_for)
                        found = await self._complete(
                            ref, manifest_hex, manifest, client_for, _Progress(progress)
                        )
                    pulled = True
        await trio.to_thread.run_sync(self.touch, ref)
        if pulled:
            await self._evict(keep=ref.digest_hex)
        return found

    def touch(self, ref: ImageRef) -> None:
        """Record durably that ``ref`` was used now (what the size limit evicts last)."""
        mark_used(self.directory, ref.digest_hex)

    async def _evict(self, keep: str) -> Eviction | None:
        """Bring the cache under its limit after a pull, keeping ``keep`` (just made ready for
        a member). Logged, never raised: a full cache never fails a Prepare."""
        if self.limit is None:
            return None
        limit = self.limit
        try:
            done = await trio.to_thread.run_sync(
                lambda: evict(self.directory, limit.max_bytes, limit.usage(), frozenset({keep}))
            )
        except Exception as exc:  # eviction must never fail the pull
            log.warning("image cache eviction failed directory=%s reason=%s", self.directory,
                        exc)  # fmt: skip
            return None
        if done is None:
            log.info("image cache eviction deferred: another pull or a removal holds the cache; "
                     "the last pull to finish evicts")  # fmt: skip
            return None
        if done.removed.images or done.removed.blobs:
            log.info("image cache evicted images=%d blobs=%d freed=%s", len(done.removed.images),
                     len(done.removed.blobs), human_bytes(done.removed.bytes))  # fmt: skip
        if done.over_by:
            log.warning("The image cache %s stays %s over its limit of %s: %s.", self.directory,
                        human_bytes(done.over_by), human_bytes(limit.max_bytes),
                        "; ".join(done.kept) or "nothing more can be removed")  # fmt: skip
        return done

    # -- steps -----------------------------------------------------------------------------

    async def _manifest(self, ref: ImageRef, client_for: ClientFor) -> tuple[str, Manifest]:
        """The platform manifest of ``ref`` and its digest's hex, from the cache or the
        registry, verified."""
        where = f"{ref.registry}/{ref.name}@{ref.digest}"
        manifest_hex = ref.digest_hex
        document = await self._document(ref, manifest_hex, where, client_for)
        if isinstance(document, Index):
            chosen = select_manifest(document, self.platform, where)
            where_child = f"{ref.registry}/{ref.name}@{chosen.digest}"
            manifest_hex = chosen.digest_hex
            document = await self._document(ref, manifest_hex, where_child, client_for)
            if not isinstance(document, Manifest):
                raise ManifestRefused(
                    f"The image index {where} points for {self.platform} at {chosen.digest}, "
                    "which is another index; TunePlane resolves one level of index only."
                )
        return manifest_hex, document

    async def _document(
        self, ref: ImageRef, digest_hex: str, where: str, client_for: ClientFor
    ) -> Manifest | Index:
        path = self.blob_path(digest_hex)
        try:
            data = await trio.to_thread.run_sync(path.read_bytes)
            content_type = ""
        except FileNotFoundError:
            client = await client_for()
            data, content_type = await client.manifest(ref.name, digest_hex)
            document = read_document(data, content_type, digest_hex, where)
            await trio.to_thread.run_sync(_write_blob, path, data)
            return document
        return read_document(data, content_type, digest_hex, where)

    async def _complete(
        self,
        ref: ImageRef,
        manifest_hex: str,
        manifest: Manifest,
        client_for: ClientFor,
        state: _Progress,
    ) -> ReadyImage:
        where = f"{ref.registry}/{ref.name}@{ref.digest}"
        have = frozenset(
            d.digest_hex for d in manifest.blobs if self.blob_path(d.digest_hex).exists()
        )
        root = self.root_path(ref)
        plan = plan_image(manifest, have, root.is_dir(), self.record_path(ref).exists())
        state.bytes_total = sum(d.size for d in manifest.blobs)
        state.layers_total = len(manifest.layers)
        state.layer_digests = frozenset(d.digest_hex for d in manifest.layers)
        fetching = {d.digest_hex for d in plan.fetch}
        state.bytes_done = sum(d.size for d in manifest.blobs if d.digest_hex not in fetching)
        state.layers_done = sum(1 for d in manifest.layers if d.digest_hex not in fetching)
        state.tell()
        if plan.fetch:
            try:
                async with trio.open_nursery() as nursery:
                    for descriptor in plan.fetch:
                        nursery.start_soon(self._fetch_blob, ref, descriptor, client_for, state)
            except BaseExceptionGroup as group:
                # The first blob that failed cancelled the others: its error is the answer.
                errors = group.subgroup(lambda e: isinstance(e, ImageError))
                if errors is None or errors.split(ImageError)[1] is not None:
                    raise
                raise _leaves(errors)[0] from None
        if plan.unpack:
            state.phase = "unpacking"
            state.tell()
            await trio.to_thread.run_sync(self._unpack, ref, manifest, where)
        config_data = await trio.to_thread.run_sync(
            self.blob_path(manifest.config.digest_hex).read_bytes
        )
        expect(config_data, manifest.config, f"config of {where}")
        config = read_config(config_data, where)
        record = {
            "version": RECORD_VERSION,
            "ref": str(ref),
            "manifest": f"sha256:{manifest_hex}",
            "config": config.to_json(),
            "layers": [
                {"digest": d.digest, "size": d.size, "mediaType": d.media_type}
                for d in manifest.layers
            ],
            "bytes": state.bytes_total,
        }
        if plan.write_record:
            path = self.record_path(ref)
            await trio.to_thread.run_sync(_write_record, path, record)
        state.phase = "ready"
        state.tell()
        found = self.ready(ref)
        assert found is not None, "the record and the root were just written"
        return found

    async def _fetch_blob(
        self, ref: ImageRef, descriptor: Descriptor, client_for: ClientFor, state: _Progress
    ) -> None:
        async with self._limiter, self._exclusive(descriptor.digest_hex):
            dest = self.blob_path(descriptor.digest_hex)
            if not dest.exists():  # another image's pull may have brought it meanwhile
                client = await client_for()
                partial = self.directory / "partial" / descriptor.digest_hex
                await client.blob(ref.name, descriptor, dest, partial, state.add_bytes)
            else:
                state.add_bytes(descriptor.size)
        if descriptor.digest_hex in state.layer_digests:
            state.layers_done += 1
            state.tell()

    def _unpack(self, ref: ImageRef, manifest: Manifest, where: str) -> None:
        """Apply every layer, bottom first, into a fresh build folder, then rename it into place
        (a worker thread; this process holds the image's lock)."""
        # tarfile (with gzip, bz2 and lzma) loads with the first image unpacked, not with the
        # agent: a Node that runs only host: runtimes never holds it (issue 13, goal 4).
        from .image_layer import LayerRefused, apply_layer

        roots = self.directory / "roots"
        roots.mkdir(parents=True, exist_ok=True)
        for stale in roots.glob(f".build-{ref.digest_hex}-*"):
            remove_tree(stale)  # left by a crash: nobody else builds this image now
        build = roots / f".build-{ref.digest_hex}-{os.getpid()}-{secrets.token_hex(4)}"
        build.mkdir(0o755)
        try:
            for layer in manifest.layers:
                try:
                    apply_layer(self.blob_path(layer.digest_hex), layer.media_type, build)
                except LayerRefused as exc:
                    raise ImageRefused(
                        f"The image {where} cannot be unpacked safely: {exc} Nothing of it was "
                        "installed; rebuild the image without that entry."
                    ) from None
            os.chmod(build, 0o755)
            _syncfs(build)
            crashpoint("before-image-root-renamed", image=ref.digest_hex[:12])
            os.rename(build, self.root_path(ref))
            fsync_dir(roots)
            keep_root_bytes(self.directory, ref.digest_hex)
        except BaseException:
            remove_tree(build)
            raise

    # -- locks and clients -----------------------------------------------------------------

    @asynccontextmanager
    async def _exclusive(self, digest_hex: str) -> AsyncIterator[None]:
        """This task alone, in this process and on this machine, works on ``digest_hex``."""
        lock = self._locks.setdefault(digest_hex, trio.Lock())
        async with lock:
            path = self.directory / "locks" / f"{digest_hex}.lock"
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        # Another process pulls it; flock cannot wait and be cancelled at once.
                        await trio.sleep(_LOCK_POLL_S)
                yield
            finally:
                os.close(fd)  # releases the flock

    @asynccontextmanager
    async def _writing(self) -> AsyncIterator[None]:
        """Hold the cache's lock shared while this pull writes: removal waits for it."""
        path = gc_lock_path(self.directory)
        while True:
            fd = try_lock(path, shared=True)
            if fd is not None:
                break
            await trio.sleep(_LOCK_POLL_S)  # a removal runs now; it is short
        try:
            yield
        finally:
            os.close(fd)

    @asynccontextmanager
    async def _clients(self, ref: ImageRef) -> AsyncIterator[ClientFor]:
        """A function giving the registry's client, opened the first time it is needed (an
        image whose blobs are all cached is completed without any connection)."""
        opened: list[RegistryClient] = []

        async def client_for() -> RegistryClient:
            if not opened:
                # httpx (with rich and pygments, which it loads for its command line) loads
                # with the first pull, not with the agent: a Node that runs only host:
                # runtimes never holds it (issue 13, goal 4: the idle agent's memory).
                from .image_pull import RegistryClient

                access = self.registries.get(ref.registry, RegistryAccess())
                client = RegistryClient(ref.registry, access, **self.client_options)
                opened.append(client)
                self.clients.append(client)
            return opened[0]

        try:
            yield client_for
        finally:
            for client in opened:
                await client.__aexit__(None, None, None)


def _write_blob(path: Path, data: bytes) -> None:
    """A verified blob (a manifest or index read whole) written into ``blobs/``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, 0o644)


def _write_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)


_libc: Any = None


def _syncfs(path: Path) -> None:
    """Make every file under ``path`` durable before the root is renamed into place: syncfs(2)
    of its file system (one call, rather than an fsync of each of an image's files)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"syncfs: {os.strerror(code)}", str(path))
    finally:
        os.close(fd)


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found
