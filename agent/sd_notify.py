"""systemd's service notification protocol (sd_notify(3)): READY, STATUS, WATCHDOG and STOPPING.

Rules:
- Each notification is one datagram of ``KEY=value`` lines to the socket ``$NOTIFY_SOCKET``
  names (a path, or an abstract name written with a leading ``@``). Without it every call is a
  no-op, so the daemons run the same under systemd, under another supervisor and in tests.
- :meth:`ServiceNotifier.from_environment` takes ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and
  ``WATCHDOG_PID`` out of the process environment, as ``sd_notify(unset_environment=1)`` does:
  the runners, collectors and workloads the daemon starts never see them.
- The watchdog is kept by :meth:`ServiceNotifier.keep_watchdog`, a task on the daemon's own event
  loop (anyio, so the Trio agent and the asyncio coordinator share it): a loop that blocks stops
  the pings and systemd restarts the daemon. It pings at half of ``WATCHDOG_USEC``, and only when
  ``WATCHDOG_PID`` is absent or names this process.
- Sending never raises: a notification that cannot be delivered is logged and dropped, because a
  service manager that went away must not stop the daemon.

Why not a library: ``sdnotify`` has had no release since 2017, ``systemd-python`` needs
libsystemd's headers to build, and ``systemd-watchdog`` has no STOPPING and times the watchdog
with the wall clock. The protocol is one datagram; the pure parts below are tested alone.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, MutableMapping

import anyio
import attrs

log = logging.getLogger(__name__)

NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
#: The fastest the watchdog is pinged, however short WATCHDOG_USEC is: never a busy loop.
MIN_PING_INTERVAL_S = 0.01


@attrs.frozen
class NotifySettings:
    """Where notifications go (``None``: nowhere) and how often the watchdog wants a ping."""

    address: str | None = None
    watchdog_interval_s: float | None = None


def settings_from(env: Mapping[str, str], pid: int) -> NotifySettings:
    """What the service manager asked of process ``pid`` through ``env`` (pure).

    The watchdog interval is half of ``WATCHDOG_USEC``, as sd_watchdog_enabled(3) advises (at
    least :data:`MIN_PING_INTERVAL_S`); it is ``None`` without a socket, without
    ``WATCHDOG_USEC``, when that is not a positive number, or when ``WATCHDOG_PID`` names
    another process.
    """
    address = env.get("NOTIFY_SOCKET") or None
    if address is None:
        return NotifySettings()
    interval: float | None = None
    usec = env.get("WATCHDOG_USEC", "")
    watchdog_pid = env.get("WATCHDOG_PID", "")
    for_us = not watchdog_pid or (watchdog_pid.isdigit() and int(watchdog_pid) == pid)
    if usec.isdigit() and int(usec) > 0 and for_us:
        interval = max(int(usec) / 1_000_000 / 2, MIN_PING_INTERVAL_S)
    return NotifySettings(address, interval)


def socket_address(name: str) -> str:
    """The address ``sendto`` takes for ``$NOTIFY_SOCKET``: ``@x`` is the abstract ``\\0x``."""
    return "\0" + name[1:] if name.startswith("@") else name


def encode(fields: Mapping[str, str]) -> bytes:
    """One notification: ``KEY=value`` lines; a value's line breaks become spaces (STATUS is one
    line in ``systemctl status``)."""
    lines = (f"{key}={' '.join(str(value).splitlines())}\n" for key, value in fields.items())
    return "".join(lines).encode("utf-8")


@attrs.define(eq=False)
class ServiceNotifier:
    """Tells the service manager about this process; every method is a no-op without a socket."""

    settings: NotifySettings = attrs.field(factory=NotifySettings)
    _sock: socket.socket | None = attrs.field(default=None, init=False)
    _warned: bool = attrs.field(default=False, init=False)

    @classmethod
    def from_environment(cls, env: MutableMapping[str, str] | None = None) -> ServiceNotifier:
        """The notifier the environment asks for; the variables are removed from ``env``
        (``os.environ`` by default) so no child process inherits them."""
        env = os.environ if env is None else env
        settings = settings_from(env, os.getpid())
        for name in NOTIFY_VARIABLES:
            env.pop(name, None)
        return cls(settings)

    @property
    def enabled(self) -> bool:
        return self.settings.address is not None

    def send(self, **fields: str) -> bool:
        """Send ``fields`` as one datagram; False (and a log line) when it could not be sent."""
        if self.settings.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # A full queue at the receiver drops this one notification; it never blocks
                # the event loop the watchdog is meant to vouch for.
                self._sock.setblocking(False)
            self._sock.sendto(encode(fields), socket_address(self.settings.address))
        except OSError as exc:
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(
                level,
                "service manager notification not sent socket=%s fields=%s error=%s",
                self.settings.address, ",".join(fields), exc.strerror or exc,
            )  # fmt: skip
            return False
        return True

    def ready(self, status: str) -> bool:
        """READY=1: start-up is over and the service does what it is for."""
        return self.send(READY="1", STATUS=status)

    def status(self, status: str) -> bool:
        """A short human status line, shown by ``systemctl status``."""
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        """WATCHDOG=1: the event loop is alive."""
        return self.send(WATCHDOG="1")

    def stopping(self, status: str) -> bool:
        """STOPPING=1: an orderly stop has begun."""
        return self.send(STOPPING="1", STATUS=status)

    async def keep_watchdog(self) -> None:
        """Ping the watchdog from this event loop until cancelled; returns at once when the
        service manager asked for no watchdog."""
        interval = self.settings.watchdog_interval_s
        if interval is None:
            return
        log.info("watchdog kept interval_s=%g", interval)
        while True:
            self.watchdog()
            await anyio.sleep(interval)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


__all__ = [
    "NOTIFY_VARIABLES",
    "NotifySettings",
    "ServiceNotifier",
    "encode",
    "settings_from",
    "socket_address",
]
