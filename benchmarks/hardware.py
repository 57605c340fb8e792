"""What the benchmarks record about the machine they ran on, and their one CUDA-event timer
(shared by the scripts here)."""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cuda_median_us(run_round: Callable[[], None], rounds: int, calls_per_round: int) -> float:
    """Median µs per call over ``rounds`` rounds, each ``run_round()`` (``calls_per_round``
    calls) between two CUDA events. Warm up before calling this."""
    import torch

    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_round()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls_per_round)
    return statistics.median(samples)
