"""How the GEMV tuner times a call: as a decode step's CUDA graph runs it, each call reading its
weight from memory, not from a warm L2 (``time_calls``). Used by ``gemv``'s tuner, under its lock."""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
from collections.abc import Callable

import torch

__all__ = ["ABANDONED", "MAX_COPIES", "REPLAYS", "ROUNDS", "drop_copies", "time_calls", "weight_copies"]

log = logging.getLogger("shapewise")


def time_calls(fn: Callable[[torch.Tensor], object], w: torch.Tensor) -> float:
    """Milliseconds per call of ``fn(w_i)``, timed as a decode step runs it: one CUDA graph of a
    call per copy ``w_i`` of the weight, over enough copies that none is in L2 when its call reads
    it (as each weight of a step), replayed; the replays' time over their calls, median of
    ``ROUNDS``. So the host's launch cost is not in it (a step's calls are a graph's too), nor a
    warm L2. (Before 2026-12-06: ``triton.testing.do_bench`` of single launches, an L2 flush before
    each. In one H100 run it had F.linear win each of the 1B's four weights at one row, where an
    earlier run had timed the kernel 1.08-1.27x faster than cuBLAS in graphs.)"""
    copies = weight_copies(w)
    for c in copies:  # warm-up: compiles, and raises here (not in the capture) most of what fails
        fn(c)
    torch.cuda.synchronize(w.device)
    graph = torch.cuda.CUDAGraph()
    # On a stream of the weight's device of its own (not torch's one capture stream of the process,
    # made on whichever device captured first), thread-local (other threads may use CUDA meanwhile),
    # without torch.cuda.graph's emptying of the allocator's cache; the stream is restored and the
    # capture ended whatever fn raises.
    with torch.cuda.stream(_timing_stream(w.device)):
        try:
            graph.capture_begin(capture_error_mode="thread_local")
        except Exception:  # torch routes the pool to the graph before it begins the stream's capture
            _abandon(graph, w.device)
            raise
        try:
            for c in copies:
                fn(c)
        finally:
            try:
                graph.capture_end()
            except Exception:  # the capture was invalidated (fn did what a capture does not allow)
                _abandon(graph, w.device)
                raise  # (fn's own error, where it raised one, is this one's context)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(ROUNDS):
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (REPLAYS * len(copies)))
    del graph
    return statistics.median(times)


ROUNDS, REPLAYS, MAX_COPIES = 5, 4, 64
# Graphs whose capture failed, never destroyed: torch leaves such a graph's memory pool routed, and its
# destructor, run later by the garbage collector, aborted the process (an H100 test worker,
# 2026-12-06: "Fatal Python error: Aborted" in the next test's Dynamo trace). Each holds only what
# its failed capture allocated.
ABANDONED: list[torch.cuda.CUDAGraph] = []


def _abandon(graph: torch.cuda.CUDAGraph, device: torch.device) -> None:
    """Keep ``graph`` (a failed capture) alive for good, its pool's routing ended where torch left it on."""
    ABANDONED.append(graph)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        with contextlib.suppress(RuntimeError):  # torch ended it itself
            end(device.index if device.index is not None else torch.cuda.current_device(), graph.pool())
    log.debug("shapewise gemv: a timing capture failed; its graph is kept (%d so far)", len(ABANDONED))


@functools.cache
def _timing_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """``w`` and copies of it, together three times the L2 or more (at most ``MAX_COPIES``; a
    weight that large alone is not copied): each call of a replay reads its copy from memory, not
    from L2. Fewer where they would take more than half the free memory, or it runs out (the
    timing then has some of L2's help). Made once per weight while it is tuned (``drop_copies`` drops them)."""
    if _COPIES and _COPIES[0] is w:
        return _COPIES
    l2 = getattr(torch.cuda.get_device_properties(w.device), "L2_cache_size", 50 << 20)
    size = max(1, w.numel() * w.element_size())
    n = min(MAX_COPIES, max(1, -(-3 * l2 // size)))
    n = min(n, 1 + torch.cuda.mem_get_info(w.device)[0] // (2 * size))  # at most half the free memory
    _COPIES[:] = [w]
    try:
        for _ in range(n - 1):  # in w's layout (rows may be strided: the kernel reads them so)
            _COPIES.append(torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=w.device).copy_(w))
    except torch.cuda.OutOfMemoryError:
        log.debug("shapewise gemv: %d of %d weight copies for timing %s fit in memory", len(_COPIES), n,
                  tuple(w.shape))
    return _COPIES


_COPIES: list[torch.Tensor] = []  # the weight being timed and its copies (under the tuner's lock)


def drop_copies() -> None:
    """Free the copies ``weight_copies`` made (the tuner calls it once a weight is tuned)."""
    _COPIES.clear()
