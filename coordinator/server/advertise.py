"""The addresses the coordinator hands out: what Nodes, collectors and ``tp`` dial.

Rules:
- Every address the coordinator gives away (``endpoints.json``, ``tp-context.json``, the
  telemetry address in every Commit) is an advertised one, never the bind address: a wildcard
  bind (``0.0.0.0``, ``::``) says nothing about how another machine reaches this one.
- What is advertised: ``[addresses]`` in coordinator.toml (``host`` for every listener, or a
  whole ``HOST:PORT`` per listener for a NAT or a load balancer in front), with
  ``serve --advertise HOST`` over ``host``. With nothing set, a specific bind address is
  advertised as itself; a wildcard bind refuses to start, naming the setting.
- Checked at start (:func:`judge`, pure, over what :func:`look_up` learnt): a wildcard, a
  loopback address while listening beyond loopback, or an address of this machine that the
  listener is not bound to refuses ``serve``; a name that does not resolve here, or resolves only
  to addresses this machine does not hold (a NAT, a load balancer), is a warning.
- The server certificate must cover every advertised host (a Node verifies it): see
  ``tls.cover_names``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping, Sequence

import attrs

from tuneplane.agent.host_port import join_host_port

from ..config import AddressSettings
from ..control_address import BadAddress, split

LISTENERS = ("api", "control", "telemetry")
WILDCARDS = ("", "0.0.0.0", "::")


class AdvertiseError(RuntimeError):
    """The coordinator cannot tell others how to reach it; ``str()`` says why and the fix."""


@attrs.frozen
class Advertised:
    """HOST:PORT per listener, as clients dial it."""

    api: str
    control: str
    telemetry: str

    def by_listener(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in LISTENERS}


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def _setting(listener: str) -> str:
    return f"[addresses] {listener} in coordinator.toml"


def plan(bind_host: str, settings: AddressSettings, ports: Mapping[str, int]) -> Advertised:
    """The address of each listener (``ports``: the ports they are bound to) that others dial.

    Raises :class:`AdvertiseError` when a wildcard bind leaves a listener with nothing to
    advertise, or an override is not ``HOST:PORT``.
    """
    chosen: dict[str, str] = {}
    for name in LISTENERS:
        override: str = getattr(settings, name)
        if override:
            try:
                split(override)
            except BadAddress:
                raise AdvertiseError(
                    f"{_setting(name)} is {override!r}, which is not HOST:PORT (for IPv6, "
                    "[ADDRESS]:PORT). Write the name or address and port clients dial, e.g. "
                    f'{name} = "coordinator.example.org:{ports[name]}".'
                ) from None
            chosen[name] = override
            continue
        if settings.host and is_wildcard(settings.host):
            raise AdvertiseError(
                f"The advertised host {settings.host} (--advertise or host under [addresses] in "
                "coordinator.toml) is a wildcard, which no client can dial. Give the name or "
                'address the other machines dial, e.g. host = "coordinator.example.org".'
            )
        host = settings.host or bind_host
        if is_wildcard(host):
            raise AdvertiseError(
                f"serve listens on {bind_host or '0.0.0.0'} (every address of this machine), so "
                f"it cannot tell which address Nodes, collectors and tp reach its {name} "
                "listener at. Set host under [addresses] in coordinator.toml (or pass "
                "--advertise HOST) to the name or address the other machines dial, e.g. "
                'host = "coordinator.example.org".'
            )
        chosen[name] = join_host_port(host, ports[name])
    return Advertised(**chosen)


@attrs.frozen
class HostFacts:
    """What this machine knows about one advertised host: the IP addresses it resolves to
    (empty when it does not, ``error`` saying why) and those this machine holds."""

    host: str
    resolved: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    error: str = ""


@attrs.frozen
class Verdict:
    refusals: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _bound_to(bind_host: str) -> str:
    return "every address of this machine" if is_wildcard(bind_host) else bind_host


def judge_one(bind_host: str, listeners: Sequence[str], facts: HostFacts) -> Verdict:
    """Whether a client could reach ``listeners`` at the host ``facts`` are about;
    ``bind_host`` is the IP address they are bound to (a wildcard: every address)."""
    host = facts.host
    listener = "listener" if len(listeners) == 1 else "listeners"
    said = f"The advertised address {host} (of the {', '.join(listeners)} {listener})"
    fix = (
        f"Set host (or {', '.join(listeners)}) under [addresses] in coordinator.toml, or "
        "--advertise, to a name or address the other machines reach this one at."
    )
    if is_wildcard(host):
        return Verdict(refusals=(f"{said} is a wildcard, which no client can dial. {fix}",))
    if not facts.resolved:
        return Verdict(
            warnings=(
                f"{said} does not resolve on this machine ({facts.error or 'no address'}); "
                "every Node must resolve it itself. Check the name if that is not intended.",
            )
        )
    wildcard_bind = is_wildcard(bind_host)
    if not wildcard_bind and str(ipaddress.ip_address(bind_host)) in facts.resolved:
        return Verdict()
    loopback_bind = not wildcard_bind and _loopback(bind_host)
    if all(_loopback(a) for a in facts.resolved):
        if loopback_bind:
            return Verdict()
        return Verdict(
            refusals=(
                f"{said} resolves to loopback ({', '.join(facts.resolved)}) while serve listens "
                f"on {_bound_to(bind_host)}, so only this machine could reach it. {fix}",
            )
        )
    if wildcard_bind:
        if facts.held:
            return Verdict()
    elif facts.held:
        return Verdict(
            refusals=(
                f"{said} resolves to {', '.join(facts.held)}, an address of this machine that "
                f"serve does not listen on (it listens on {bind_host}), so every connection to "
                f"it would be refused. {fix}",
            )
        )
    return Verdict(
        warnings=(
            f"{said} resolves to {', '.join(facts.resolved)}, which this machine does not hold; "
            "that is right only behind a NAT or a load balancer that forwards to "
            f"{_bound_to(bind_host)}.",
        )
    )


def judge(bind_host: str, advertised: Advertised, facts: Mapping[str, HostFacts]) -> Verdict:
    """:func:`judge_one` for every advertised host; ``facts`` by host."""
    by_host: dict[str, list[str]] = {}
    for listener, address in advertised.by_listener().items():
        by_host.setdefault(split(address)[0], []).append(listener)
    refusals: list[str] = []
    warnings: list[str] = []
    for host, listeners in by_host.items():
        verdict = judge_one(bind_host, listeners, facts[host])
        refusals += verdict.refusals
        warnings += verdict.warnings
    return Verdict(tuple(refusals), tuple(warnings))


def hosts(advertised: Advertised) -> list[str]:
    """The distinct hosts of ``advertised``, in listener order."""
    return list(dict.fromkeys(split(a)[0] for a in advertised.by_listener().values()))


def _holds(address: str) -> bool:
    """Whether this machine holds ``address`` (binding a UDP socket to it succeeds)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def look_up(host: str) -> HostFacts:
    """Resolve ``host`` here and find which of its addresses this machine holds (blocking)."""
    if is_wildcard(host):
        return HostFacts(host)
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        return HostFacts(host, error=str(exc))
    # A link-local IPv6 answer carries its zone ("fe80::1%eth0"): the address is what counts.
    found = (str(info[4][0]).split("%", 1)[0] for info in infos)
    resolved = tuple(dict.fromkeys(str(ipaddress.ip_address(a)) for a in found))
    return HostFacts(host, resolved, tuple(a for a in resolved if _holds(a)))


def look_up_all(names: Iterable[str]) -> dict[str, HostFacts]:
    return {name: look_up(name) for name in names}


__all__ = [
    "AdvertiseError",
    "Advertised",
    "HostFacts",
    "Verdict",
    "hosts",
    "judge",
    "judge_one",
    "look_up",
    "look_up_all",
    "plan",
]
