"""Unit conversions, in one place.

Bandwidths are gigabits per second (``*_gbps``) everywhere in configs and
dataclasses; memory is GiB (``*_gib``); times are milliseconds (``*_ms``) or
microseconds (``*_us``). Cost formulas work in bytes and seconds, and convert
here and nowhere else.
"""

from __future__ import annotations

BYTES_PER_GIB = 1024**3
BITS_PER_BYTE = 8


def gbps_to_bytes_per_s(bandwidth_gbps: float) -> float:
    """Gigabits per second to bytes per second (1 Gb/s = 125,000,000 B/s)."""
    return bandwidth_gbps * 1e9 / BITS_PER_BYTE


def bytes_per_s_to_gbps(rate_bytes_per_s: float) -> float:
    """Bytes per second to gigabits per second."""
    return rate_bytes_per_s * BITS_PER_BYTE / 1e9


def gb_per_s_to_gbps(bandwidth_gb_per_s: float) -> float:
    """Gigabytes per second (datasheets) to gigabits per second (this project)."""
    return bandwidth_gb_per_s * BITS_PER_BYTE


def bytes_to_gib(num_bytes: float) -> float:
    return num_bytes / BYTES_PER_GIB


def gib_to_bytes(memory_gib: float) -> float:
    return memory_gib * BYTES_PER_GIB


def gbps_to_mbps(bandwidth_gbps: float) -> float:
    """Gigabits per second to megabits per second (``tc`` and link speeds are often quoted in Mbit/s)."""
    return bandwidth_gbps * 1000.0


def mbps_to_gbps(bandwidth_mbps: float) -> float:
    return bandwidth_mbps / 1000.0
