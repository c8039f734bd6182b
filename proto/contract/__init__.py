"""The documents the protocol carries, hand-written: what ``tp``, the coordinator and the Node
must read and write the same way.

- :mod:`.jobspec`: the JobSpec (``tuneplane/v1``), its parsing, canonical JSON and digest; its
  values are in :mod:`.jobspec_values`, the rules it validates in :mod:`.jobspec_rules`.
- :mod:`.derivation_source`: a Derivation's source artifact and a member's output manifest summary.
- :mod:`.outputs_grant`: the grant that lets one Node fetch another's outputs.
- :mod:`.input_checks`: the one rule per kind of outside text (file names, env, decoded messages).

Rules: pure (no I/O, no event loop); each module imports only the standard library, its declared
dependencies and other modules here, never ``tuneplane.coordinator``, ``tuneplane.agent``,
``tuneplane.collector`` or ``tuneplane.runner`` (tests/packaging/test_import_layers.py checks
it). Unlike :mod:`tuneplane.proto.v1`, nothing here is generated: ``nox -s proto`` leaves it alone.
"""
