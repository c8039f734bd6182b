"""TunePlane tests: unit, integration (real processes on loopback) and fault tests."""
