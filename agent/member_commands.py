"""What a Node does with the coordinator's Commit, Abort and Cancel: one pure table.

Rules: the answer depends only on the member's journaled state (None when the journal holds no
such member). :mod:`agent.members` asks here, then journals the event (before anything else),
starts or stops the member, and logs the note; nothing is decided between its awaits. A repeat
of any command gets an answer that journals nothing, so a resent order is harmless. Preparing a
member has its own checks (agent/prepare.py): a repeated Prepare is answered from the journal.

========  ================================  ==================================================
command   member's state                    what the Node does
========  ================================  ==================================================
Commit    prepared                          journal ``commit-received``, start the member
Commit    committed, starting               start it (again: a start resumes, never doubles)
Commit    aborted, none                     nothing; logged as an error
Commit    any other                         nothing (a repeat)
Abort     preparing, prepared               journal ``abort-received``, free the rendezvous
Abort     committed or later                nothing; logged as an error (Abort after Commit)
Abort     none, aborted                     nothing
Cancel    prepared, committed               journal ``cancel-received`` (aborted), free the
                                            rendezvous
Cancel    starting, running                 journal ``cancel-received`` (cancelling), stop it
Cancel    none, or any other                nothing
========  ================================  ==================================================
"""

from __future__ import annotations

import enum

import attrs

from .member_state import COMMITTED_OR_LATER, MemberEvent, MemberState

S = MemberState
E = MemberEvent


class Command(enum.Enum):
    COMMIT = "commit"
    ABORT = "abort"
    CANCEL = "cancel"


@attrs.frozen
class Response:
    """What to do: journal ``event`` first (when set), then free the rendezvous, start or stop
    the member as flagged; ``note`` says why nothing was done (``error``: it should not happen)."""

    event: MemberEvent | None = None
    start: bool = False
    stop: bool = False
    release_rendezvous: bool = False
    note: str = ""
    error: bool = False


def respond(command: Command, state: MemberState | None) -> Response:
    """The table in the module docstring."""
    if state is None:
        # Only a Commit for a member it never prepared would mean the coordinator is wrong.
        never = f"{command.value} for a member this Node never prepared"
        return Response(note=never, error=command is Command.COMMIT)
    if command is Command.COMMIT:
        if state is S.PREPARED:
            return Response(E.COMMIT_RECEIVED, start=True)
        if state in (S.COMMITTED, S.STARTING):
            return Response(start=True)
        if state is S.ABORTED:
            return Response(note="commit for an aborted member ignored", error=True)
        return Response(note="commit repeated")
    if command is Command.ABORT:
        if state in (S.PREPARING, S.PREPARED):
            return Response(E.ABORT_RECEIVED, release_rendezvous=True)
        if state in COMMITTED_OR_LATER:
            return Response(note="abort after commit ignored", error=True)
        return Response(note="abort repeated")
    if state in (S.PREPARED, S.COMMITTED):
        return Response(E.CANCEL_RECEIVED, release_rendezvous=True)
    if state in (S.STARTING, S.RUNNING):
        return Response(E.CANCEL_RECEIVED, stop=True)
    return Response(note="cancel repeated")
