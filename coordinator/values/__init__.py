"""The coordinator's values: one family of frozen attrs classes that the store, the scheduler,
the Api handlers and ``tp`` all pass around, one module per subject.

Rules: nothing here imports grpclib, betterproto, the store or anything that does IO, so ``tp``
commands that never call the coordinator start fast and the store never sees a generated
protocol type. Converting to and from protocol messages is :mod:`..wire`'s job, one module per
boundary. Modules: :mod:`.jobs` (Jobs, attempts, members, previews, receipts), :mod:`.orders`
(what the Node boundary carries: orders, reports, inventory), :mod:`.fleet` (Fleets and Nodes),
:mod:`.users`, :mod:`.decisions`, :mod:`.metrics` (metric reads), :mod:`.telemetry` (what
collectors ship) and :mod:`.lifecycle` (cancel, retry, logs, a Node's loss).
"""
