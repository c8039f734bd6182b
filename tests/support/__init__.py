"""Helpers that start real TunePlane processes for tests and wait on them."""
