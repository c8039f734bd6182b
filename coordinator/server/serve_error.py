"""``serve``'s one error, in a module of its own so the admin commands that report it
(cli/admin_common.py) need not load the server."""

from __future__ import annotations


class ServeError(RuntimeError):
    """``serve`` cannot start; ``str()`` says why and what to do."""
