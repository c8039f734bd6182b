"""A pull-only client of the OCI distribution API over HTTPS that never blocks the event loop:
manifests by digest, blobs streamed to disk, verified, and resumed where they stopped, and a tag
resolved to the digest of what it names.

Rules:
- TLS verification is always on (DESIGN.md, "Identity and security"): against the system's CA
  bundle, or the registry's own ``ca_file`` when the Node is configured with one. Plain HTTP is
  never spoken.
- Credentials are the Node's (``RegistryAccess``), never the workload's. A 401 is answered as its
  ``WWW-Authenticate`` challenge asks: ``Basic`` with the Node's user and password, ``Bearer``
  with a token fetched from the challenge's realm (with those credentials when the Node has
  them, anonymously when not), kept for the scope it was issued for. A second 401 is a
  :class:`RegistryAuthRefused`.
- A blob is streamed into ``partial`` with its sha256 computed as the bytes arrive, fsynced, and
  renamed to ``dest`` only when its digest and size are the descriptor's; otherwise the partial
  is removed and :class:`DigestMismatch` names the blob. A partial left by a crash or a dropped
  connection is resumed with ``Range: bytes=<size>-``; a server that ignores the Range (a 200) or
  cannot satisfy it (a 416) restarts the blob from byte 0.
- A dropped connection or a refused connect is retried ``retries`` times with a doubling pause,
  resuming each time; after that the pull fails with :class:`RegistryUnreachable`, the partial
  kept for the next pull.
- File writes, hashing and fsyncs run in worker threads; only the sockets are on the loop.
- It is written with anyio, so it runs the same on Trio (the agent pulls with it) and on asyncio
  (the coordinator resolves tags with it at Preview). ``holder`` and ``configured_in`` name who
  holds the credentials and where they are configured, for the sentences its errors say.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import attrs
import httpx

from .atomic_file import fsync_dir
from .crashpoint import crashpoint
from .image_access import RegistryAccess as RegistryAccess
from .image_errors import (
    DigestMismatch,
    ImageNotFound,
    ManifestRefused,
    RegistryAuthRefused,
    RegistryBusy,
    RegistryFailed,
    RegistryUnreachable,
)
from .image_manifest import ACCEPT, MAX_MANIFEST_BYTES, Descriptor, read_document, sha256_hex

#: Bytes read from the socket per write to the partial file (one worker-thread hop each).
CHUNK = 1 << 20
#: Answers a registry gives while overloaded or restarting: retried like a dropped connection.
BUSY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: The longest pause between tries, whatever the backoff or a Retry-After asks.
MAX_PAUSE_S = 8.0
_CHALLENGE_PARAM = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))\s*,?')


@attrs.frozen
class Resolution:
    """What a reference names at a registry now: the manifest's (or index's) sha256 hex and its
    media type."""

    digest_hex: str
    media_type: str


@attrs.frozen
class Challenge:
    """A parsed ``WWW-Authenticate`` header: its scheme (lowercase) and its parameters."""

    scheme: str
    params: dict[str, str]


def parse_challenge(header: str) -> Challenge:
    """``Bearer realm="…",service="…",scope="…"`` (or ``Basic realm="…"``) as a Challenge."""
    scheme, _, rest = header.strip().partition(" ")
    params: dict[str, str] = {}
    position = 0
    while position < len(rest):
        match = _CHALLENGE_PARAM.match(rest, position)
        if match is None or match.end() == position:
            break
        quoted, bare = match.group(2), match.group(3)
        value = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare
        params[match.group(1).lower()] = value
        position = match.end()
    return Challenge(scheme.lower(), params)


@attrs.define
class PullStatistics:
    """What a client did, for tests and the journal: requests sent, of them blob requests with a
    ``Range``, blobs restarted from byte 0 on a resume, and blob bytes received."""

    requests: int = 0
    range_requests: int = 0
    restarts: int = 0
    blob_bytes: int = 0
    retries: int = 0


def retry_after(header: str) -> float | None:
    """The seconds a ``Retry-After`` header asks for; None when it gives none this client reads
    (an HTTP date is not read: the backoff applies)."""
    text = header.strip()
    return float(text) if text.isdigit() else None


def retry_pause(first_pause: float, attempt: int, asked: float | None) -> float:
    """How long to wait before try ``attempt + 2``: the doubling backoff, or longer when the
    registry asked for longer, never over :data:`MAX_PAUSE_S`."""
    backoff: float = first_pause * 2.0**attempt
    return min(max(backoff, asked or 0.0), MAX_PAUSE_S)


class RegistryClient:
    """One registry, one connection pool; use as ``async with RegistryClient(...) as client``."""

    def __init__(
        self,
        registry: str,
        access: RegistryAccess | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        first_pause: float = 0.25,
        holder: str = "Node",
        configured_in: str = "the Node's configuration",
    ) -> None:
        self.registry = registry
        self.holder = holder
        self.configured_in = configured_in
        self.access = access or RegistryAccess()
        self.retries = retries
        self.first_pause = first_pause
        self.stats = PullStatistics()
        self._tokens: dict[str, str] = {}  # scope -> bearer token
        self._basic = False  # the registry asked for Basic: send it on every request
        self._http = httpx.AsyncClient(
            verify=_tls_context(self.access.ca_file, registry),
            timeout=httpx.Timeout(timeout),
            follow_redirects=True,  # registries may send blob GETs to a storage host
            headers={"User-Agent": f"tuneplane-{holder.lower()}"},
        )

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self._http.aclose()

    # -- manifests -------------------------------------------------------------------------

    async def manifest(self, name: str, digest_hex: str) -> tuple[bytes, str]:
        """The raw bytes and Content-Type of the manifest or index ``name@sha256:digest_hex``
        (not yet verified: :func:`image_manifest.read_document` does that)."""
        where = f"{self.registry}/{name}@sha256:{digest_hex}"
        data, content_type, _ = await self._document(name, f"sha256:{digest_hex}", where)
        return data, content_type

    async def resolve(self, name: str, reference: str) -> Resolution:
        """What ``name:<tag>`` (or ``name@sha256:<hex>``) names now: the sha256 of the manifest
        or index the registry serves for it, computed from the bytes read (a
        ``Docker-Content-Digest`` that disagrees is a :class:`DigestMismatch`), and its media
        type. An index stays an index: the Node picks its platform's manifest at pull. A
        document that is no image (schema 1, another media type) is a :class:`ManifestRefused`,
        and a digest reference whose bytes hash otherwise a :class:`DigestMismatch`."""
        sep = "@" if reference.startswith("sha256:") else ":"
        where = f"{self.registry}/{name}{sep}{reference}"
        data, content_type, claimed = await self._document(name, reference, where)
        digest_hex = sha256_hex(data)
        if claimed and claimed != f"sha256:{digest_hex}":
            raise DigestMismatch(
                f"The registry {self.registry} says {where} is {claimed}, but the manifest it "
                f"served hashes to sha256:{digest_hex}; the registry is broken or tampered "
                "with, so nothing is pinned to it."
            )
        expected = reference.removeprefix("sha256:") if sep == "@" else digest_hex
        document = read_document(data, content_type, expected, where)
        return Resolution(digest_hex, document.media_type)

    async def _document(self, name: str, reference: str, where: str) -> tuple[bytes, str, str]:
        """The bytes, Content-Type and Docker-Content-Digest ("" when absent) of the manifest
        ``reference`` (a tag or ``sha256:<hex>``) names, at most :data:`MAX_MANIFEST_BYTES`."""
        url = self._url(f"/v2/{name}/manifests/{reference}")
        for attempt in range(self.retries + 1):
            try:
                async with self._request(name, url, {"Accept": ACCEPT}, where) as response:
                    data = bytearray()
                    declared = response.headers.get("Content-Length", "0")
                    if not declared.isdigit() or int(declared) <= MAX_MANIFEST_BYTES:
                        async for chunk in response.aiter_bytes():
                            data += chunk
                            if len(data) > MAX_MANIFEST_BYTES:
                                break
                    if len(data) > MAX_MANIFEST_BYTES or int(declared or 0) > MAX_MANIFEST_BYTES:
                        raise ManifestRefused(
                            f"The registry {self.registry} serves more than {MAX_MANIFEST_BYTES} "
                            f"bytes for the manifest of {where}; a {self.holder} reads no larger "
                            "manifest, so the registry is serving something that is not one."
                        )
                    headers = response.headers
                    return (
                        bytes(data),
                        headers.get("Content-Type", ""),
                        headers.get("Docker-Content-Digest", "").strip(),
                    )
            except (httpx.TransportError, RegistryBusy) as exc:
                await self._pause_or_raise(attempt, where, exc, resumes=False)
        raise AssertionError("unreachable: the last attempt raises")

    # -- blobs -----------------------------------------------------------------------------

    async def blob(
        self,
        name: str,
        descriptor: Descriptor,
        dest: Path,
        partial: Path,
        on_bytes: Callable[[int], None] = lambda n: None,
    ) -> None:
        """Stream the blob ``descriptor`` of repository ``name`` into ``partial`` (resuming what
        is there), verify it and rename it to ``dest``. ``on_bytes(n)`` is called as ``n`` more
        bytes of the blob are on disk (a resumed partial's bytes are reported first)."""
        where = f"{self.registry}/{name}@{descriptor.digest}"
        url = self._url(f"/v2/{name}/blobs/{descriptor.digest}")
        writer = await anyio.to_thread.run_sync(_PartialBlob.open, partial, descriptor)
        try:
            if writer.offset:
                on_bytes(writer.offset)
            for attempt in range(self.retries + 1):
                if writer.offset == descriptor.size:
                    break
                try:
                    await self._stream_into(writer, name, url, where, on_bytes)
                    if writer.offset == descriptor.size:
                        break
                    # The body ended early without a transport error: resume like a drop.
                    raise httpx.RemoteProtocolError("the response ended before the blob did")
                except (httpx.TransportError, RegistryBusy) as exc:
                    await self._pause_or_raise(attempt, where, exc)
            await anyio.to_thread.run_sync(writer.finish, dest)
        finally:
            await anyio.to_thread.run_sync(writer.close)

    async def _stream_into(
        self,
        writer: _PartialBlob,
        name: str,
        url: str,
        where: str,
        on_bytes: Callable[[int], None],
    ) -> None:
        headers = {"Accept-Encoding": "identity"}
        if writer.offset:
            headers["Range"] = f"bytes={writer.offset}-"
            self.stats.range_requests += 1
        async with self._request(name, url, headers, where, ok=(200, 206, 416)) as response:
            resumed = response.status_code == 206 and response.headers.get(
                "Content-Range", ""
            ).startswith(f"bytes {writer.offset}-")
            if writer.offset and not resumed:
                # The Range was ignored (200), unsatisfiable (416) or answered for other bytes:
                # start the blob again from byte 0.
                self.stats.restarts += 1
                on_bytes(-writer.offset)
                await anyio.to_thread.run_sync(writer.restart)
                if response.status_code != 200:
                    await response.aclose()
                    await self._stream_into(writer, name, url, where, on_bytes)  # no Range now
                    return
            elif response.status_code == 416:
                raise RegistryFailed(
                    f"The registry {self.registry} answered HTTP 416 for {where} without a "
                    "Range; it is not serving the blob."
                )
            async for chunk in response.aiter_bytes(CHUNK):
                await anyio.to_thread.run_sync(writer.write, chunk, where)
                self.stats.blob_bytes += len(chunk)
                on_bytes(len(chunk))

    # -- requests and authentication -------------------------------------------------------

    def _url(self, path: str) -> str:
        return f"https://{self.registry}{path}"

    @asynccontextmanager
    async def _request(
        self,
        name: str,
        url: str,
        headers: dict[str, str],
        where: str,
        ok: tuple[int, ...] = (200,),
    ) -> AsyncIterator[httpx.Response]:
        """A streamed GET of ``url`` with the credentials the registry asks for; any status
        outside ``ok`` is raised as the typed error it means."""
        scope = f"repository:{name}:pull"
        for attempt in range(2):
            request = self._http.build_request("GET", url, headers=self._auth(scope) | headers)
            self.stats.requests += 1
            response = await self._http.send(request, stream=True)
            try:
                if response.status_code == 401 and attempt == 0:
                    challenge = parse_challenge(response.headers.get("WWW-Authenticate", ""))
                    await response.aclose()
                    await self._answer(challenge, scope, where)
                    continue
                if response.status_code not in ok:
                    await response.aread()
                    raise self._status_error(response, where)
                yield response
                return
            finally:
                await response.aclose()
        raise AssertionError("unreachable: the second 401 raises")

    def _auth(self, scope: str) -> dict[str, str]:
        token = self._tokens.get(scope)
        if token is not None:
            return {"Authorization": f"Bearer {token}"}
        if self._basic and self.access.username is not None:
            raw = f"{self.access.username}:{self.access.password or ''}".encode()
            return {"Authorization": f"Basic {base64.b64encode(raw).decode()}"}
        return {}

    async def _answer(self, challenge: Challenge, scope: str, where: str) -> None:
        """Get what the 401's challenge asks for, so the request can be sent once more."""
        if challenge.scheme == "basic":
            if self.access.username is None:
                raise RegistryAuthRefused(
                    f"The registry {self.registry} wants a user name and password for {where}, "
                    f"and this {self.holder} holds none for it; add them to the registry's entry "
                    f"in {self.configured_in}."
                )
            self._basic = True
            return
        if challenge.scheme != "bearer" or "realm" not in challenge.params:
            raise RegistryAuthRefused(
                f"The registry {self.registry} asked for {challenge.scheme or 'no'} "
                f"authentication for {where}; a {self.holder} answers Basic and Bearer "
                "challenges only."
            )
        realm = challenge.params["realm"]
        if not realm.startswith("https://"):
            raise RegistryAuthRefused(
                f"The registry {self.registry} sends the {self.holder} to the token service "
                f"{realm!r}, which is not HTTPS; the {self.holder} sends credentials only over "
                "verified TLS."
            )
        query = {"scope": challenge.params.get("scope", scope)}
        if "service" in challenge.params:
            query["service"] = challenge.params["service"]
        auth = None
        if self.access.username is not None:
            auth = httpx.BasicAuth(self.access.username, self.access.password or "")
        self.stats.requests += 1
        try:
            response = await self._http.get(realm, params=query, auth=auth)
        except httpx.TransportError as exc:
            raise RegistryUnreachable(
                f"The token service {realm} of the registry {self.registry} could not be "
                f"reached ({type(exc).__name__}: {exc}); check the {self.holder}'s network to it."
            ) from None
        if response.status_code in (401, 403):
            raise self._refused(where)
        body: Any = None
        if response.status_code == 200:
            try:
                body = response.json()
            except ValueError:
                body = None
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise RegistryAuthRefused(
                f"The token service {realm} of the registry {self.registry} answered HTTP "
                f"{response.status_code} without a token for {where}."
            )
        self._tokens[scope] = token

    def _refused(self, where: str) -> RegistryAuthRefused:
        who = (
            f"the credentials of user {self.access.username!r}"
            if self.access.username is not None
            else "an anonymous pull"
        )
        return RegistryAuthRefused(
            f"The registry {self.registry} refused {who} for {where}; check the user name and "
            f"password in the registry's entry in {self.configured_in}, and that the account "
            "may pull this repository."
        )

    def _status_error(self, response: httpx.Response, where: str) -> Exception:
        status = response.status_code
        if status in (401, 403):
            return self._refused(where)
        if status == 404:
            return ImageNotFound(
                f"The registry {self.registry} has no {where} (HTTP 404); check the repository "
                "name and the digest, and that the image was pushed to this registry."
            )
        text = response.text[:200].strip()
        if status in BUSY_STATUSES:
            return RegistryBusy(
                f"The registry {self.registry} answered HTTP {status} for {where}"
                f"{f' ({text})' if text else ''}",
                retry_after(response.headers.get("Retry-After", "")),
            )
        return RegistryFailed(
            f"The registry {self.registry} answered HTTP {status} for {where}"
            f"{f' ({text})' if text else ''}; the pull cannot go on from that."
        )

    async def _pause_or_raise(
        self, attempt: int, where: str, exc: Exception, resumes: bool = True
    ) -> None:
        kept = "what was pulled is kept and the next pull resumes it"
        if attempt >= self.retries and isinstance(exc, RegistryBusy):
            then = f"{kept}; pull again" if resumes else "try again"
            raise RegistryFailed(
                f"{exc}{f', {attempt + 1} times in a row' if attempt else ''}; {then} once the "
                "registry is healthy."
            ) from None
        if attempt >= self.retries:
            then = kept if resumes else "check that it is up and that this machine reaches it"
            raise RegistryUnreachable(
                f"The registry {self.registry} could not be reached for {where} after "
                f"{attempt + 1} tries ({type(exc).__name__}: {exc or 'connection lost'}); "
                f"{then}."
            ) from None
        self.stats.retries += 1
        asked = exc.retry_after_s if isinstance(exc, RegistryBusy) else None
        await anyio.sleep(retry_pause(self.first_pause, attempt, asked))


def _tls_context(ca_file: Path | None, registry: str) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise RegistryUnreachable(
            f"The CA file {ca_file} of the registry {registry} cannot be loaded "
            f"({type(exc).__name__}: {exc}); it must be a PEM bundle of the CA that signed the "
            "registry's certificate."
        ) from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


@attrs.define
class _PartialBlob:
    """The partial file of one blob, its sha256 so far and its length (worker threads only)."""

    path: Path
    descriptor: Descriptor
    fd: int
    hasher: Any
    offset: int

    @classmethod
    def open(cls, path: Path, descriptor: Descriptor) -> _PartialBlob:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        hasher = hashlib.sha256()
        offset = 0
        # What a crash or a drop left is hashed again (a hash's state cannot be saved); more
        # than the blob's size is garbage, so it restarts.
        if os.fstat(fd).st_size > descriptor.size:
            os.ftruncate(fd, 0)
        while block := os.read(fd, CHUNK):
            hasher.update(block)
            offset += len(block)
        return cls(path, descriptor, fd, hasher, offset)

    def write(self, chunk: bytes, where: str) -> None:
        if self.offset + len(chunk) > self.descriptor.size:
            self.discard()
            raise DigestMismatch(
                f"The registry served more than the {self.descriptor.size} bytes the manifest "
                f"gives the blob {where}; the partial blob was removed. The registry is broken or "
                "tampered with."
            )
        view = memoryview(chunk)
        while view:
            view = view[os.write(self.fd, view) :]
        self.hasher.update(chunk)
        self.offset += len(chunk)
        crashpoint("mid-image-blob", blob=self.descriptor.digest_hex[:12], offset=self.offset)

    def restart(self) -> None:
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self.hasher = hashlib.sha256()
        self.offset = 0

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)

    def finish(self, dest: Path) -> None:
        """Verify the blob and rename it into place, durably; a mismatch removes the partial."""
        actual = self.hasher.hexdigest()
        if actual != self.descriptor.digest_hex or self.offset != self.descriptor.size:
            self.discard()
            raise DigestMismatch(
                f"The blob {self.descriptor.digest} the registry served hashes to "
                f"sha256:{actual} ({self.offset} bytes; the manifest names "
                f"{self.descriptor.size}); the partial blob was removed and nothing was cached. "
                "The registry's copy is corrupt or tampered with: push the image again."
            )
        os.fsync(self.fd)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.path, dest)
        fsync_dir(dest.parent)

    def close(self) -> None:
        os.close(self.fd)
