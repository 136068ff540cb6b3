"""Test and benchmark harnesses shared by ``tests/`` and ``bench/`` (not needed to train)."""
