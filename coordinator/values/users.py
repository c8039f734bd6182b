"""Users as the store knows them: a name, a role (``user`` or ``admin``) and when it was made.

Rules: frozen attrs values only (see :mod:`..values`); tokens are never part of a value.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class User:
    name: str
    role: str
    created_at_ms: int
