"""What Nodes and collectors talk to: the control gateway (Enroll, the Connect stream) and
the telemetry gateway, with the session registry, heartbeats, log shipping, credentials and
the limits on incoming messages.
"""
