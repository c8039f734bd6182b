"""A real OCI registry for tests: the Distribution registry (Debian's ``docker-registry``) on a
loopback port with TLS from a test CA, and a push helper that uploads images the test builds.

Rules:
- Everything the registry writes (storage, config, certificates, htpasswd, log) is under the
  test's own temporary folder; the process is stopped by its PID at teardown (and by the
  reaper of tests/support/processes.py if a test forgot).
- A missing ``docker-registry`` (or ``htpasswd`` for a registry with users) skips the test with a
  sentence naming the package, except under ``CI=true``, where it fails: CI must run these.
- Images are pushed through the registry's own push API (blob upload POST then PUT, manifest
  PUT), so a test needs no skopeo; layers are tar bytes the test writes with Python.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx

from tests.support.accounts import require
from tests.support.processes import track, untrack, wait_until
from tuneplane.agent.image_manifest import OCI_INDEX, OCI_MANIFEST
from tuneplane.coordinator.server.tls import create_dev_ca

REGISTRY_BIN = "/usr/bin/docker-registry"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
START_TIMEOUT_S = 30.0


def require_registry(users: bool = False) -> None:
    """Skip (fail under CI=true) unless the registry, and htpasswd when ``users``, are here."""
    require(
        os.path.exists(REGISTRY_BIN),
        f"the Distribution registry ({REGISTRY_BIN}); install the distribution's docker-registry "
        "package",
    )
    if users:
        require(
            shutil.which("htpasswd") is not None,
            "htpasswd for the registry's users; install the distribution's apache2-utils package",
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def descriptor(media_type: str, data: bytes, **extra: Any) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": f"sha256:{sha256_hex(data)}", "size": len(data),
            **extra}  # fmt: skip


def tar_layer(
    entries: Sequence[tarfile.TarInfo | tuple[str, bytes]], *, gzipped: bool = True
) -> bytes:
    """A layer of ``entries`` (a TarInfo as it is, ``(name, data)`` as a 0644 file)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for item in entries:
            if isinstance(item, tarfile.TarInfo):
                tar.addfile(item)
                continue
            name, data = item
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    raw = buffer.getvalue()
    return gzip.compress(raw, mtime=0) if gzipped else raw


@attrs.frozen
class PushedImage:
    """What a push made: the digest to pin, and the blobs, for the test to compare with."""

    name: str
    digest_hex: str  # of the manifest (or of the index, for an index push)
    manifest: bytes
    config: bytes
    layers: tuple[bytes, ...]

    def ref_text(self, registry: str) -> str:
        return f"image:{registry}/{self.name}@sha256:{self.digest_hex}"


@attrs.define
class RegistryProcess:
    """One registry on 127.0.0.1:<port>; ``kill`` and ``start`` again keep its storage."""

    folder: Path
    port: int
    users: Mapping[str, str]
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    sha256 = staticmethod(sha256_hex)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.folder / "tls" / "ca.pem"

    @property
    def storage(self) -> Path:
        return self.folder / "storage"

    @property
    def log_path(self) -> Path:
        return self.folder / "registry.log"

    def blob_data(self, digest_hex: str) -> Path:
        """The file the registry serves a blob from (its filesystem storage driver's layout)."""
        return (self.storage / "docker/registry/v2/blobs/sha256" / digest_hex[:2] / digest_hex
                / "data")  # fmt: skip

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def blob_gets(self, digest_hex: str) -> int:
        """How many GETs of the blob the registry has answered (its access log)."""
        return sum(
            1
            for line in self.read_log().splitlines()
            if f"blobs/sha256:{digest_hex}" in line and '"GET ' in line
        )

    def _configure(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self.ca_file.exists():
            create_dev_ca(self.folder, ["127.0.0.1", "localhost"])
        auth = ""
        if self.users:
            htpasswd = self.folder / "htpasswd"
            lines = []
            for user, password in self.users.items():
                made = subprocess.run(["htpasswd", "-Bbn", user, password], capture_output=True,
                                      text=True, check=True, timeout=30)  # fmt: skip
                lines.append(made.stdout.strip())
            htpasswd.write_text("\n".join(lines) + "\n")
            auth = f"auth:\n  htpasswd:\n    realm: tuneplane-test\n    path: {htpasswd}\n"
        config = self.folder / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: info\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            "  cache:\n    blobdescriptor: inmemory\n"
            f"http:\n  addr: {self.address}\n  secret: tuneplane-test\n"
            f"  tls:\n    certificate: {self.folder / 'tls/server.pem'}\n"
            f"    key: {self.folder / 'tls/server.key'}\n" + auth
        )
        return config

    def start(self) -> None:
        config = self._configure()
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                [REGISTRY_BIN, "serve", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.folder,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
        finally:
            log.close()
        track(self.proc)
        self.starts += 1
        wait_until(f"the registry on {self.address}", self._answers, START_TIMEOUT_S)

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the registry exited with {self.proc.returncode}:\n"
                                 f"{self.read_log()}")  # fmt: skip
        try:
            response = httpx.get(f"https://{self.address}/v2/", verify=self._ssl(), timeout=2)
        except httpx.TransportError:
            return False
        return response.status_code in (200, 401)

    def _ssl(self) -> Any:
        import ssl

        return ssl.create_default_context(cafile=str(self.ca_file))

    def kill(self) -> None:
        """SIGKILL the registry, as a crash would, and reap it."""
        if self.proc is not None:
            untrack(self.proc)
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            untrack(self.proc)
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.kill(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=30)
            self.proc = None

    # -- pushing ---------------------------------------------------------------------------

    @contextmanager
    def _client(self) -> Iterator[httpx.Client]:
        auth = None
        if self.users:
            user, password = next(iter(self.users.items()))
            auth = httpx.BasicAuth(user, password)
        with httpx.Client(
            base_url=f"https://{self.address}", verify=self._ssl(), auth=auth, timeout=60
        ) as client:
            yield client

    def push_blob(self, name: str, data: bytes) -> str:
        digest = f"sha256:{sha256_hex(data)}"
        with self._client() as client:
            started = client.post(f"/v2/{name}/blobs/uploads/")
            assert started.status_code == 202, started.text
            # The Location carries the upload's state in its query: add the digest to it.
            location = httpx.URL(started.headers["Location"]).copy_merge_params({"digest": digest})
            put = client.put(location, content=data,
                             headers={"Content-Type": "application/octet-stream"})  # fmt: skip
            assert put.status_code == 201, put.text
        return digest

    def push_manifest(self, name: str, reference: str, data: bytes, media_type: str) -> None:
        with self._client() as client:
            put = client.put(f"/v2/{name}/manifests/{reference}", content=data,
                             headers={"Content-Type": media_type})  # fmt: skip
            assert put.status_code == 201, put.text

    def push_image(
        self,
        name: str,
        layers: Sequence[bytes],
        *,
        config: Mapping[str, Any] | None = None,
        layer_type: str = LAYER_GZIP,
        tag: str = "latest",
    ) -> PushedImage:
        """Push an image of ``layers`` (bottom first) with an OCI config whose ``config``
        section is ``config``; tagged ``tag`` too."""
        diff_ids = [
            f"sha256:{sha256_hex(gzip.decompress(layer) if layer_type == LAYER_GZIP else layer)}"
            for layer in layers
        ]
        config_doc = {
            "architecture": "amd64",
            "os": "linux",
            "config": dict(config or {}),
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        config_bytes = json.dumps(config_doc).encode()
        self.push_blob(name, config_bytes)
        for layer in layers:
            self.push_blob(name, layer)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": descriptor(CONFIG_TYPE, config_bytes),
                "layers": [descriptor(layer_type, layer) for layer in layers],
            }
        ).encode()
        self.push_manifest(name, tag, manifest, OCI_MANIFEST)
        return PushedImage(name, sha256_hex(manifest), manifest, config_bytes, tuple(layers))

    def push_index(self, name: str, platforms: Mapping[str, PushedImage]) -> PushedImage:
        """Push an image index over images already pushed, keyed ``os/arch``."""
        entries = []
        for key, image in platforms.items():
            os_name, arch = key.split("/")
            entries.append(descriptor(OCI_MANIFEST, image.manifest,
                                      platform={"os": os_name, "architecture": arch}))  # fmt: skip
        index = json.dumps(
            {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
        ).encode()
        self.push_manifest(name, "multi", index, OCI_INDEX)
        return PushedImage(name, sha256_hex(index), index, b"", ())


@contextmanager
def start_registry(
    folder: Path, users: Mapping[str, str] | None = None
) -> Iterator[RegistryProcess]:
    """A registry with its storage, config and CA under ``folder``, stopped at the end."""
    require_registry(users=bool(users))
    registry = RegistryProcess(folder, _free_port(), dict(users or {}))
    registry.start()
    try:
        yield registry
    finally:
        registry.stop()
