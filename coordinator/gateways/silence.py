"""How the control gateway finds a dead Node: by silence, with one timer per stream.

Reading each message under a deadline of its own (``move_on_after``) cost a cancel scope per
message, about 8% of the coordinator's time at 2,000 heartbeats a second. A :class:`SilenceWatch`
instead notes when the reader began to wait for the next message, and one task per stream
(:meth:`SilenceWatch.until_silent`) wakes when that wait would reach the timeout. The rule is the
deadline's: the Node is silent when one wait for a message lasts the whole timeout; time the
gateway spends handling a message (a slow store) is not the Node's silence.
"""

from __future__ import annotations

import anyio
import attrs


@attrs.define(eq=False)
class SilenceWatch:
    timeout_s: float
    # The event loop's time when the reader began waiting; None while it handles a message.
    _waiting_since: float | None = attrs.field(default=None, alias="waiting_since")

    def waiting(self) -> None:
        """The reader begins to wait for the next message."""
        self._waiting_since = anyio.current_time()

    def heard(self) -> None:
        """A message (or the end of the stream) arrived."""
        self._waiting_since = None

    async def until_silent(self) -> None:
        """Return once a single wait of the reader has lasted :attr:`timeout_s`."""
        while True:
            since = self._waiting_since
            now = anyio.current_time()
            if since is not None and now - since >= self.timeout_s:
                return
            await anyio.sleep_until((now if since is None else since) + self.timeout_s)
