"""Named crash points for fault tests: ``TUNEPLANE_CRASHPOINT=<name>`` makes the agent die there.

Rules: the agent calls :func:`crashpoint` at each point where a crash must be survivable; the
process exits at once with status 137 (as if SIGKILLed), running no cleanup, so a test sees
exactly what a power cut at that point would leave behind.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

POINTS = frozenset(
    {
        "after-prepare-journaled",
        "after-commit-journaled",
        "after-spawn",
        "after-exit-observed",
        "after-report-sent",
        # Control credential rotation (agent/daemon.py: Daemon._rotate).
        "after-credential-issued",
        "after-next-credential-stored",
        "after-credential-swapped",
        "after-credential-confirmed",
        # XIDs committed to the journal, the inventory that shows them not yet current or sent.
        "after-xid-journaled",
        # Output manifests (agent/outputs_manifest.py) and a Derivation's copy (agent/init_from.py).
        "after-manifest-written",
        "during-init-from-copy",
    }
)


def crashpoint(name: str) -> None:
    """Exit with status 137 right here if ``TUNEPLANE_CRASHPOINT`` names this point."""
    if os.environ.get("TUNEPLANE_CRASHPOINT") == name:
        log.critical("crash point reached, exiting point=%s", name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(137)
