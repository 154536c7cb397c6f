"""Benchmarks and chaos runs against real disagg processes on loopback (not part of the tests)."""
