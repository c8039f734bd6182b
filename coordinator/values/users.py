"""Users as the store knows them: a name, a role (``user`` or ``admin``) and when it was made.

Rules: frozen attrs values only (see :mod:`..values`); tokens are never part of a value.
"""

from __future__ import annotations

import attrs

#: The role that may administer the coordinator (and read every Job); any other is a user.
ADMIN_ROLE = "admin"


@attrs.frozen
class User:
    name: str
    role: str
    created_at_ms: int

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN_ROLE
