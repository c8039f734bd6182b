"""The coordinator: API service, control and telemetry gateways, admission, placement, store,
and the ``tp`` CLI."""
