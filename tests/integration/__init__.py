"""End-to-end tests: real coordinator and agents as processes on loopback with TLS."""
