"""``tuneplane-node gpu``: the operator's actions on this Node's GPUs, recorded in the journal.

Rules: ``gpu clear`` is the one operator write: one journal transaction, safe while the daemon
runs (SQLite serialises writers), which the daemon reads at its next refresh. ``gpu release``
asks the running agent, through a file in the state dir, to let go of NVML for a while.
"""

from __future__ import annotations

import os
import pwd
import time
from pathlib import Path

import click
import trio

from . import journal_read
from .adapter import open_aio_host
from .atomic_file import write_json_atomic
from .cli_support import sentences, state_dir_option
from .inventory_source import RELEASE_REQUEST
from .journal import Journal
from .state_dir import StateDir, read_status
from .status_cli import pid_alive
from .xid_book import XidRecord


@click.group("gpu")
def gpu_group() -> None:
    """Operator actions on this Node's GPUs, recorded in the journal."""


MAX_CLEAR_REASON = 500


@gpu_group.command("clear")
@click.argument("uuid")
@click.option(
    "--reason", required=True, help="Why the GPU may be used again (kept in the journal)."
)
@state_dir_option
def gpu_clear(uuid: str, reason: str, state_dir: Path) -> None:
    """Put a GPU that XIDs disabled back into service (after a reset or a check)."""
    with sentences():
        lifted = trio.run(_clear_gpu, StateDir(state_dir), uuid.strip(), reason.strip())
    click.echo(
        f"cleared {uuid.strip()}: XID {lifted.xid} no longer disables it; the running agent "
        "offers it again at its next inventory refresh"
    )


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"uid {os.getuid()}"


async def _clear_gpu(state: StateDir, uuid: str, reason: str) -> XidRecord:
    if not uuid:
        raise ValueError("The GPU UUID is empty; copy it from `tuneplane-node journal gpus`.")
    if not reason or len(reason) > MAX_CLEAR_REASON:
        raise ValueError(
            f"--reason must say in 1 to {MAX_CLEAR_REASON} characters why the GPU may be used "
            "again (for example: reset with nvidia-smi -r, checks passed)."
        )
    path = state.journal_path
    if not path.exists():
        raise journal_read.JournalUnreadable(
            f"There is no journal at {path}; pass the --state-dir of an enrolled Node."
        )
    actor = f"operator {_user()}"
    async with open_aio_host():
        journal = await Journal.open(path)
        try:
            lifted = await journal.clear_gpu(uuid, int(time.time() * 1000), actor, reason)
        finally:
            await journal.close()
    if lifted is None:
        raise ValueError(
            f"No XID disables GPU {uuid} in the journal {path}, so there is nothing to clear "
            "and nothing was written; `tuneplane-node journal gpus` lists the GPUs XIDs disable."
        )
    return lifted


MAX_RELEASE_MINUTES = 240


@gpu_group.command("release")
@click.option(
    "--minutes",
    type=click.IntRange(1, MAX_RELEASE_MINUTES),
    default=15,
    show_default=True,
    help="How long the agent keeps its hands off NVML; it takes NVML back after that.",
)
@click.option("--end", is_flag=True, help="End a release now: the agent takes NVML back.")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(0, 3600),
    default=120.0,
    show_default=True,
    help="Seconds to wait for the running agent to say it let go (it reads the request at its "
    "next inventory refresh).",
)
@state_dir_option
def gpu_release(minutes: int, end: bool, wait_s: float, state_dir: Path) -> None:
    """Have the running agent let go of NVML so `nvidia-smi -r` can reset a GPU.

    While released, every GPU of the Node reads unhealthy ("NVML released for a GPU reset by
    the operator") and nothing is launched on it; running members are left alone.
    """
    state = StateDir(state_dir)
    with sentences():
        state.load_node()
        now = int(time.time() * 1000)
        until = 0 if end else now + minutes * 60_000
        request = {"until_ms": until, "requested_at_ms": now, "by": _user()}
        write_json_atomic(state.root / RELEASE_REQUEST, request, 0o600)
        status = read_status(state.status_path) or {}
        if not pid_alive(status.get("pid")):
            click.echo(
                "No agent runs for this state dir; the request is stored and the agent honours "
                "it when it starts."
            )
            return

        def taken() -> bool:
            inv = (read_status(state.status_path) or {}).get("inventory", {})
            return bool(inv.get("released_until_ms", 0) == until)

        deadline = time.monotonic() + wait_s
        while not taken():
            if time.monotonic() >= deadline:
                raise click.ClickException(
                    f"The agent did not confirm within {wait_s:g} s (it reads the request at "
                    "its next inventory refresh, --inventory-interval); the request stays, so "
                    "check `tuneplane-node status` before resetting a GPU."
                )
            time.sleep(0.2)
    if end:
        click.echo("The agent has NVML again and probes the GPUs as usual.")
    else:
        at = time.strftime("%H:%M:%S", time.gmtime(until / 1000))
        click.echo(
            f"The agent let go of NVML until {at} UTC: reset the GPU now (nvidia-smi -r -i "
            "UUID), then end the release with `tuneplane-node gpu release --end`."
        )
