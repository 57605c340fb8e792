"""What the benchmarks record about the machine they ran on (shared by the scripts here)."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
