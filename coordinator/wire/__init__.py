"""The coordinator's wire edge: :mod:`..values` to and from betterproto messages, one module per
boundary, both directions in the same module.

Rules: handlers and ``tp``'s client convert through these modules and nowhere else; a message
the protocol does not allow is a :class:`.errors.BadMessage` (INVALID_ARGUMENT at the edge).
Modules: :mod:`.control` (the Node's control stream), :mod:`.telemetry` (collectors),
:mod:`.jobs`, :mod:`.fleet`, :mod:`.metrics` and :mod:`.lifecycle` (the Api), :mod:`.members`
(what they all say about a member), and :mod:`.status` (typed errors -> gRPC status, servers only).
"""
