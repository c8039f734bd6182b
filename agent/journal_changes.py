"""Which members changed, told to the loops that follow members (the collector supervisor, the
log shipper), so that a pass re-reads the live members and those just changed, never every
member the journal ever held.

Rules:
- The journal calls :meth:`MemberChanges.note` after a write that changed a member commits
  (created, moved to a new state); a caller may note a change the journal does not hold (a
  collector credential written for a member). Every follower gets the key, every waiter wakes.
- A follower takes its keys (:meth:`Follower.take`) before it reads the journal, so a change
  committed during that read stays for its next pass and is never lost.
- In memory only: a follower starts with one read of every member (after an agent restart that
  is the only way to find what an earlier run left unfinished), then follows from there.
"""

from __future__ import annotations

import attrs
import trio

from .journal_records import MemberKey


@attrs.define(eq=False)
class Follower:
    """One loop's view of the changes: the keys noted since it last took them."""

    _changes: MemberChanges = attrs.field(alias="changes")
    _keys: set[MemberKey] = attrs.field(factory=set, alias="keys")

    def add(self, key: MemberKey) -> None:
        """Note that member ``key`` changed (what :meth:`MemberChanges.note` calls)."""
        self._keys.add(key)

    def take(self) -> set[MemberKey]:
        """The members changed since the last take (and forget them here)."""
        keys, self._keys = self._keys, set()
        return keys

    async def wait(self, timeout_s: float) -> None:
        """Until a member changes that was not taken yet (at once if one did), or ``timeout_s``."""
        if self._keys:
            return
        with trio.move_on_after(timeout_s):
            await self._changes.changed.wait()


@attrs.define(eq=False)
class MemberChanges:
    """The journal's change feed; one per open journal."""

    changed: trio.Event = attrs.field(factory=trio.Event)
    _followers: list[Follower] = attrs.field(factory=list, alias="followers")

    def follow(self) -> Follower:
        """A follower that gets every change noted from now on."""
        follower = Follower(self)
        self._followers.append(follower)
        return follower

    def note(self, key: MemberKey) -> None:
        """Member ``key`` changed: tell every follower and wake every waiter."""
        for follower in self._followers:
            follower.add(key)
        self.changed.set()
        self.changed = trio.Event()
