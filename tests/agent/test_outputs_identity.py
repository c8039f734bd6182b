"""The outputs listener's identity files: made once (0600, atomically), reused, and replaced with
a warning when truncated, corrupt, mismatched or readable by others."""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509

from tuneplane.agent import outputs_identity as oi
from tuneplane.agent.outputs_tls import make_tls_pem
from tuneplane.proto.contract.outputs_grant import GRANT_KEY_BYTES


def _cert_digest(pem: bytes) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.split(b"-----END PRIVATE KEY-----\n")[1]
                                                   .decode())).hexdigest()  # fmt: skip


def test_made_once_private_and_reused(tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    first = oi.load_or_create(creds, "node-a")
    key_file, tls_file = creds / oi.GRANT_KEY_FILE, creds / oi.TLS_FILE
    for path in (key_file, tls_file):
        assert path.stat().st_mode & 0o777 == 0o600
    assert len(first.grant_key) == GRANT_KEY_BYTES
    assert key_file.read_bytes() == first.grant_key
    assert first.cert_sha256 == _cert_digest(tls_file.read_bytes())
    assert len(first.replaced) == 2 and all("was made" in r for r in first.replaced)
    # No temporary file is left beside them.
    assert sorted(p.name for p in creds.iterdir()) == [oi.GRANT_KEY_FILE, oi.TLS_FILE]

    again = oi.load_or_create(creds, "node-a")
    assert again.grant_key == first.grant_key
    assert again.cert_sha256 == first.cert_sha256
    assert again.replaced == ()
    # The file loads as a server certificate and key, as the listener uses it.
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(again.tls_path))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:200]), "does not hold a PEM key and certificate"),
        (lambda p: p.write_bytes(b""), "does not hold a PEM key and certificate"),
        (lambda p: p.chmod(0o644), "has mode 0644, so others could have read it"),
        (
            lambda p: p.write_bytes(
                make_tls_pem("x", datetime.datetime.now(datetime.UTC)).split(b"-----END P")[0]
                + b"-----END PRIVATE KEY-----\n"
                + p.read_bytes().split(b"-----END PRIVATE KEY-----\n")[1]
            ),
            "a certificate that is not its key's",
        ),
    ],
)
def test_an_unusable_tls_file_is_replaced_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object, said: str
) -> None:
    creds = tmp_path / "credentials"
    first = oi.load_or_create(creds, "node-a")
    tls_file = creds / oi.TLS_FILE
    damage(tls_file)  # type: ignore[operator]
    with caplog.at_level(logging.WARNING):
        again = oi.load_or_create(creds, "node-a")
    assert again.cert_sha256 != first.cert_sha256
    assert again.grant_key == first.grant_key  # the other file is kept
    assert len(again.replaced) == 1 and said in again.replaced[0]
    assert str(tls_file) in again.replaced[0]
    assert any(said in r.getMessage() and "outputs identity replaced" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert tls_file.stat().st_mode & 0o777 == 0o600
    assert again.cert_sha256 == _cert_digest(tls_file.read_bytes())


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:7]), f"holds 7 bytes, not {GRANT_KEY_BYTES}"),
        (lambda p: p.chmod(0o640), "has mode 0640"),
    ],
)
def test_an_unusable_grant_key_is_replaced_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object, said: str
) -> None:
    creds = tmp_path / "credentials"
    first = oi.load_or_create(creds, "node-a")
    damage(creds / oi.GRANT_KEY_FILE)  # type: ignore[operator]
    with caplog.at_level(logging.WARNING):
        again = oi.load_or_create(creds, "node-a")
    assert again.grant_key != first.grant_key and len(again.grant_key) == GRANT_KEY_BYTES
    assert again.cert_sha256 == first.cert_sha256
    assert said in again.replaced[0]
    assert any("outputs identity replaced" in r.getMessage() for r in caplog.records)


def test_a_link_in_place_of_the_key_is_not_followed(tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    creds.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.key"
    elsewhere.write_bytes(b"k" * GRANT_KEY_BYTES)
    os.chmod(elsewhere, 0o600)
    (creds / oi.GRANT_KEY_FILE).symlink_to(elsewhere)
    found = oi.load_or_create(creds, "node-a")
    assert found.grant_key != b"k" * GRANT_KEY_BYTES
    assert not (creds / oi.GRANT_KEY_FILE).is_symlink()
    assert elsewhere.read_bytes() == b"k" * GRANT_KEY_BYTES  # the link's target is untouched


def test_a_certificate_near_its_end_is_replaced(tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=oi.CERT_DAYS)
    old = oi.load_or_create(creds, "node-a", now=long_ago)
    cert = x509.load_pem_x509_certificate((creds / oi.TLS_FILE).read_bytes())
    assert cert.not_valid_after_utc < datetime.datetime.now(datetime.UTC)
    fresh = oi.load_or_create(creds, "node-a")
    assert fresh.cert_sha256 != old.cert_sha256
    assert "a certificate that ends" in fresh.replaced[0]


def test_a_failure_in_the_child_reaches_the_agent_and_changes_nothing(tmp_path: Path) -> None:
    """The key and certificate are made in a forked child: its error is raised here, as it
    would have been in the agent itself, and the other file is left as it was."""
    creds = tmp_path / "credentials"
    first = oi.load_or_create(creds, "node-a")
    tls_file = creds / oi.TLS_FILE
    tls_file.unlink()
    tls_file.mkdir()  # neither readable as a file nor replaceable by a rename
    with pytest.raises(OSError) as raised:
        oi.load_or_create(creds, "node-a")
    assert str(tls_file) in str(raised.value)
    assert (creds / oi.GRANT_KEY_FILE).read_bytes() == first.grant_key
    assert tls_file.is_dir()


def test_a_child_that_dies_or_cannot_answer_is_a_sentence_not_a_hang() -> None:
    with pytest.raises(oi.IdentityUnusable, match=r"ended \(wait status 768\) without a whole"):
        oi._in_child(lambda: os._exit(3))
    with pytest.raises(oi.IdentityUnusable, match="failed: TypeError"):
        oi._in_child(threading.Lock)  # a lock cannot be pickled back
    assert oi._in_child(lambda: ("digest", None)) == ("digest", None)
