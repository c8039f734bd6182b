"""The coordinator's store: the only SQL, on SQLite or PostgreSQL.

Every decision and its effects are one transaction with its ``decisions`` row. ``core`` holds
:class:`Store`, composed of one layer per concern (``enrollment``, ``nodes``, ``admission``,
``job_reads``, ``launches`` over ``launch_steps``, ``reports``, all over ``member_states`` and
``base``); the other modules are one concern each (Fleet, identity, lifecycle, logs, telemetry,
control address, ...) over the same handle, and ``db``, ``sqlite`` and ``postgres`` the
backends.
"""
