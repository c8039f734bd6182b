"""What every layer of the member manager builds on: its state, the report it sends, and the
paths it gives a member.

Rules: :class:`MemberBase` is the bottom layer of :class:`~tuneplane.agent.members.MemberManager`
(members.py composes the layers: prepare, launch, exits). It journals nothing itself; the
daemon's nursery, handed in, owns every task a layer starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import attrs
import trio

from . import messages as m
from .config import WorkloadPolicy
from .image_access import RegistryAccess
from .image_cache import CacheLimit, ImageCache
from .image_store import default_image_root
from .image_usage import read_usage
from .inventory import Inventory
from .journal import Journal
from .journal_records import MemberKey, PendingReport
from .members_rendezvous import RendezvousHolds
from .runner_template import RunnerTemplate
from .state_dir import JOURNAL_FILE

#: The image cache's folders only the agent reads (verified blobs, partial ones, records,
#: locks), and the one members pass through to their image's root without listing it.
_PRIVATE = ("blobs", "partial", "images", "locks")
_PASSABLE = ("roots",)


def make_image_folders(directory: Path) -> None:
    """The image cache's folders with their modes (before a pull writes anything there): the
    cache and ``roots/`` passable by every account (0711: a member's sandbox, running as the
    member's account, binds its image's root, but no member lists which images this Node
    holds), the rest the agent's own (0700)."""
    for folder, mode in (
        (directory, 0o711),
        *((directory / name, 0o700) for name in _PRIVATE),
        *((directory / name, 0o711) for name in _PASSABLE),
    ):
        folder.mkdir(mode=mode, parents=True, exist_ok=True)
        os.chmod(folder, mode)


@attrs.define(eq=False)
class Preparation:
    """A preparing member's runtime image being made ready by a task the daemon's nursery owns:
    an Abort cancels ``scope`` and waits for ``done`` before it journals the member aborted."""

    image: str
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    done: trio.Event = attrs.field(factory=trio.Event)


Publish = Callable[[m.Outgoing], Awaitable[None]]


def now_ms() -> int:
    return int(time.time() * 1000)


def out_dir_for(out_root: Path, key: MemberKey) -> Path:
    """``$TUNEPLANE_OUT_DIR`` of a member: ``<out root>/<run id>/attempt-<n>/member-<i>``."""
    return out_root / key.run_id / f"attempt-{key.attempt}" / f"member-{key.member_index}"


def work_dir_for(work_root: Path, key: MemberKey) -> Path:
    """The member's work directory (its cwd and HOME): ``<work root>/<member key>``."""
    return work_root / str(key)


class MemberBase:
    """What every layer of the member manager shares: the journal, the member, work and output
    directories, the Node's policy, the daemon's nursery, and how to publish a message.

    ``publish`` sends a message if a session is open (and drops it otherwise: reports are
    replayed from the journal after the next Welcome, and the coordinator repeats Prepare).
    """

    def __init__(
        self,
        journal: Journal,
        members_dir: Path,
        out_root: Path,
        inventory: Callable[[], Inventory],
        node_address: Callable[[], str],
        publish: Publish,
        nursery: trio.Nursery,
        *,
        work_root: Path,
        policy: WorkloadPolicy,
        refresh: Callable[[], Awaitable[Inventory]] | None = None,
        node_id: str = "",
        runner_template: RunnerTemplate | None = None,
        registries: Mapping[str, RegistryAccess] | None = None,
        image_root: Path | None = None,
        image_max_bytes: int | None = None,
    ) -> None:
        self.journal = journal
        # This Node's id: a Derivation whose source it holds itself is copied, not fetched.
        self.node_id = node_id
        self.members_dir = members_dir
        self.state_dir = members_dir.parent
        self.out_root = out_root
        self.work_root = work_root
        self.policy = policy
        self.inventory = inventory
        # A fresh probe for launch's re-check (the daemon's, with XIDs applied); without one,
        # the last inventory.
        self.refresh = refresh
        self.publish = publish
        self.nursery = nursery
        # Forks runners instead of starting an interpreter each (agent/runner_template.py).
        self.runner_template = runner_template
        # The newest journal event whose ended member's folders a Prepare has given back to
        # root (members_prepare.py): later Prepares read only the members ended since.
        self.reclaimed_through = 0
        # The members a watcher follows (members_exits.py): one watcher each.
        self.watched: set[MemberKey] = set()
        self.rendezvous = RendezvousHolds(nursery, node_address)
        # Runtime images, pulled at Prepare into the image root beside the state dir
        # (agent/image_cache.py), kept under node.toml's [images] max_size by evicting the least
        # recently used images no live member uses (the journal says which are used). Its
        # folders are made (make_image_folders) before the first pull, never here.
        journal_path = self.state_dir / JOURNAL_FILE
        limit = (
            None
            if image_max_bytes is None
            else CacheLimit(image_max_bytes, lambda: read_usage(journal_path))
        )
        self.images = ImageCache(
            image_root or default_image_root(self.state_dir), registries, limit=limit
        )
        # Members whose image is being pulled, by key (one task each, members_prepare.py), and
        # the lock the end of every Prepare (lease, files, journal) takes, so a Prepare finished
        # by a pull never interleaves with one the command worker carries out.
        self.preparations: dict[MemberKey, Preparation] = {}
        self.prepare_lock = trio.Lock()

    async def report(self, report: PendingReport | None) -> None:
        """Send a report the journal queued (None: the transition queued none)."""
        if report is not None:
            await self.publish(m.Report(report))
