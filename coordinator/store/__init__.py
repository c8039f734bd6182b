"""The coordinator's store: the only SQL, on SQLite or PostgreSQL.

Every decision and its effects are one transaction with its ``decisions`` row. ``core`` holds
:class:`Store`; the other modules are one concern each (Fleet, identity, lifecycle, logs,
metrics, ...) over the same handle, and ``db``, ``sqlite`` and ``postgres`` the backends.
"""
