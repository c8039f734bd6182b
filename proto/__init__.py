"""TunePlane's wire protocol: ``.proto`` sources in ``tuneplane/v1`` and the betterproto code
generated from them in :mod:`tuneplane.proto.v1` (regenerate with ``nox -s proto``).

Domain code never builds these messages directly; each side converts them to attrs objects at
its wire edge. Importing :mod:`tuneplane.proto.v1` makes betterproto's attribute access cheaper
(:mod:`tuneplane.proto.message_speed`); importing this package or its contract loads nothing of
betterproto or grpclib.
"""
