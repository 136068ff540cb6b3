"""Benchmarks of the planner and the engine (run as ``python -m bench.NAME``; see README.md)."""
