"""What serve advertises and when it refuses: the pure plan and verdict, the real look-up, and
the dev CA's certificate reissued (or a foreign one refused) for an advertised name."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from tuneplane.coordinator.config import AddressSettings, ConfigError, parse_config
from tuneplane.coordinator.server.advertise import (
    Advertised,
    AdvertiseError,
    HostFacts,
    judge,
    look_up,
    plan,
)
from tuneplane.coordinator.server.tls import TlsError, TlsPaths, cover_names, create_dev_ca

PORTS = {"api": 7443, "control": 7444, "telemetry": 7445}


def test_a_specific_bind_is_advertised_as_itself() -> None:
    assert plan("10.0.0.5", AddressSettings(), PORTS) == Advertised(
        "10.0.0.5:7443", "10.0.0.5:7444", "10.0.0.5:7445"
    )
    assert plan("::1", AddressSettings(), PORTS).control == "[::1]:7444"


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", ""])
def test_a_wildcard_bind_with_nothing_advertised_refuses_naming_the_setting(bind: str) -> None:
    with pytest.raises(AdvertiseError, match=r"Set host under \[addresses\].*--advertise HOST"):
        plan(bind, AddressSettings(), PORTS)


def test_host_then_per_listener_overrides() -> None:
    settings = AddressSettings(host="coord.example.org", telemetry="lb.example.org:443")
    assert plan("0.0.0.0", settings.with_host(None), PORTS) == Advertised(
        "coord.example.org:7443", "coord.example.org:7444", "lb.example.org:443"
    )
    # serve --advertise wins over [addresses] host, not over a whole HOST:PORT.
    assert plan("0.0.0.0", settings.with_host("other"), PORTS).api == "other:7443"
    assert plan("0.0.0.0", settings.with_host("other"), PORTS).telemetry == "lb.example.org:443"


def test_an_override_that_is_not_host_port_is_refused() -> None:
    with pytest.raises(AdvertiseError, match=r"\[addresses\] control .* not HOST:PORT"):
        plan("0.0.0.0", AddressSettings(host="c", control="c.example.org"), PORTS)


def _verdict(bind: str, facts: HostFacts) -> tuple[tuple[str, ...], tuple[str, ...]]:
    advertised = plan("0.0.0.0", AddressSettings(host=facts.host), PORTS)
    found = judge(bind, advertised, {facts.host: facts})
    return found.refusals, found.warnings


def test_loopback_advertised_while_listening_beyond_it_is_refused_once_per_host() -> None:
    refusals, _ = _verdict("0.0.0.0", HostFacts("box", ("127.0.1.1",), ("127.0.1.1",)))
    (refusal,) = refusals
    assert "resolves to loopback (127.0.1.1)" in refusal
    assert "api, control, telemetry listeners" in refusal
    assert _verdict("127.0.0.1", HostFacts("localhost", ("127.0.0.1",), ("127.0.0.1",))) == (
        (),
        (),
    )


def test_an_address_of_this_machine_serve_does_not_listen_on_is_refused() -> None:
    refusals, _ = _verdict("10.0.0.5", HostFacts("box", ("192.168.1.5",), ("192.168.1.5",)))
    assert refusals and "does not listen on (it listens on 10.0.0.5)" in refusals[0]


def test_nat_and_unresolved_names_are_warnings_not_refusals() -> None:
    refusals, warnings = _verdict("0.0.0.0", HostFacts("lb", ("203.0.113.7",), ()))
    assert not refusals and "NAT or a load balancer" in warnings[0]
    refusals, warnings = _verdict("0.0.0.0", HostFacts("nowhere", (), (), "Name not known"))
    assert not refusals and "does not resolve on this machine (Name not known)" in warnings[0]
    assert _verdict("0.0.0.0", HostFacts("box", ("10.0.0.5",), ("10.0.0.5",))) == ((), ())
    assert _verdict("10.0.0.5", HostFacts("box", ("10.0.0.5",), ("10.0.0.5",))) == ((), ())


def test_a_wildcard_advertised_is_refused() -> None:
    found = judge("0.0.0.0", Advertised("0.0.0.0:1", "0.0.0.0:2", "0.0.0.0:3"), {
        "0.0.0.0": look_up("0.0.0.0")
    })  # fmt: skip
    assert found.refusals and "is a wildcard" in found.refusals[0]


def test_look_up_knows_loopback_is_held_and_a_documentation_address_is_not() -> None:
    assert look_up("127.0.0.1") == HostFacts("127.0.0.1", ("127.0.0.1",), ("127.0.0.1",))
    assert look_up("203.0.113.7") == HostFacts("203.0.113.7", ("203.0.113.7",), ())
    assert look_up("name.invalid").error


def _sans(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {*san.get_values_for_type(x509.DNSName)} | {
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)
    }


def test_the_dev_ca_reissues_its_server_certificate_for_an_advertised_name(tmp_path: Path) -> None:
    paths = create_dev_ca(tmp_path, ["localhost", "127.0.0.1"])
    key_before = paths.server_key.read_bytes()
    before = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    assert cover_names(paths, ["localhost", "127.0.0.1"]) == []
    assert cover_names(paths, ["coord.example.org", "10.77.0.1"]) == [
        "coord.example.org",
        "10.77.0.1",
    ]
    assert _sans(paths.server_cert) == {"localhost", "127.0.0.1", "coord.example.org", "10.77.0.1"}
    after = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    assert paths.server_key.read_bytes() == key_before
    assert after.not_valid_after_utc == before.not_valid_after_utc
    assert after.not_valid_before_utc <= datetime.datetime.now(datetime.UTC)
    # The reissued certificate verifies against the CA every Node already holds.
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", str(paths.ca_cert), str(paths.server_cert)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr


def test_a_certificate_of_another_ca_is_never_reissued(tmp_path: Path) -> None:
    paths = create_dev_ca(tmp_path / "ours", ["localhost"])
    foreign = create_dev_ca(tmp_path / "theirs", ["localhost", "*.example.org"])
    production = TlsPaths(paths.ca_cert, paths.ca_key, foreign.server_cert, foreign.server_key)
    pem = production.server_cert.read_bytes()
    # A wildcard name covers one first label, as TLS clients match.
    assert cover_names(production, ["coord.example.org"]) == []
    with pytest.raises(TlsError, match=r"does not cover a\.b\.example\.org, which serve"):
        cover_names(production, ["a.b.example.org"])
    assert production.server_cert.read_bytes() == pem


def test_addresses_in_coordinator_toml() -> None:
    config = parse_config('[addresses]\nhost = "coord"\ntelemetry = "lb:443"\n', Path("c.toml"))
    assert config.addresses == AddressSettings(host="coord", telemetry="lb:443")
    with pytest.raises(ConfigError, match=r"\[addresses\] has unknown key\(s\) hots"):
        parse_config('[addresses]\nhots = "coord"\n', Path("c.toml"))
    with pytest.raises(ConfigError, match=r"\[addresses\] host = 5 must be a non-empty string"):
        parse_config("[addresses]\nhost = 5\n", Path("c.toml"))


def _serve(state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.admin", "serve", "--state-dir",
         str(state), "--api-port", "0", "--control-port", "0", "--telemetry-port", "0", *extra],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _snapshot(state: Path) -> dict[str, bytes]:
    """Every file of the state directory (what a refused serve must leave alone)."""
    return {str(p.relative_to(state)): p.read_bytes() for p in state.rglob("*") if p.is_file()}


@pytest.fixture
def state(tmp_path: Path) -> Path:
    folder = tmp_path / "coord"
    subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.admin", "init", "--state-dir",
         str(folder)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return folder


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ((), "Set host under [addresses] in coordinator.toml (or pass --advertise HOST)"),
        (("--advertise", "127.0.0.1"), "resolves to loopback (127.0.0.1) while serve listens"),
        (("--advertise", "0.0.0.0"), "is a wildcard, which no client can dial"),
    ],
)
def test_serve_on_every_address_refuses_what_no_other_machine_can_dial(
    state: Path, extra: tuple[str, ...], said: str
) -> None:
    before = _snapshot(state)
    done = _serve(state, "--host", "0.0.0.0", *extra)
    assert done.returncode == 1
    assert said in " ".join(done.stderr.split()), done.stderr
    # Nothing published, no certificate reissued, no store opened.
    assert _snapshot(state) == before


def test_serve_refuses_a_name_a_certificate_of_another_ca_does_not_cover(
    state: Path, tmp_path: Path
) -> None:
    # A production certificate (another CA, no key of it here) for localhost only.
    other = create_dev_ca(tmp_path / "other-ca", ["localhost", "127.0.0.1"])
    tls = TlsPaths.under(state)
    for source, target in (
        (other.server_cert, tls.server_cert),
        (other.server_key, tls.server_key),
    ):
        target.write_bytes(source.read_bytes())
    before = _snapshot(state)
    done = _serve(state, "--host", "127.0.0.1", "--advertise", "localhost.localdomain")
    assert done.returncode == 1
    told = " ".join(done.stderr.split())
    assert f"The server certificate {tls.server_cert} does not cover localhost.localdomain" in told
    assert _snapshot(state) == before
