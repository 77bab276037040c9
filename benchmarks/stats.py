"""Percentiles for the benchmarks' reports."""

from __future__ import annotations

import statistics

__all__ = ["p50_p99_ms", "pct"]


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (nearest rank); NaN if there are none."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] if s else float("nan")


def p50_p99_ms(xs: list[float]) -> str:
    """``p50 … ms  p99 … ms`` of durations in seconds."""
    return f"p50 {statistics.median(xs) * 1e3:7.1f} ms  p99 {pct(xs, 99) * 1e3:7.1f} ms"
