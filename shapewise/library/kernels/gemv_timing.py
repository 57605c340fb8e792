"""How the GEMV tuner times a call: as a decode step's CUDA graph runs it, each call reading its
weight from memory, not from a warm L2 (``time_calls``). Used by ``gemv``'s tuner, under its lock."""

from __future__ import annotations

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
    # Its memory pool named here, not by torch: a failed capture's pool is not given back by
    # ``graph.pool()`` (it raises), and its routing must be ended (``_abandon``).
    pool = torch.cuda.graph_pool_handle()
    # On a stream of the weight's device of its own (not torch's one capture stream of the process,
    # made on whichever device captured first), thread-local (other threads may use CUDA meanwhile),
    # without torch.cuda.graph's emptying of the allocator's cache; the stream is restored and the
    # capture ended whatever fn raises.
    with torch.cuda.stream(_timing_stream(w.device)):
        try:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        except Exception:  # torch routes the pool to the graph before it begins the stream's capture
            _abandon(graph, w.device, pool)
            raise
        try:
            for c in copies:
                fn(c)
        finally:
            try:
                graph.capture_end()
            except Exception:  # the capture was invalidated (fn did what a capture does not allow)
                _abandon(graph, w.device, pool)
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
# Graphs whose capture failed, never destroyed. torch's ``capture_end`` raises before it ends the
# routing of the allocator to the graph's pool, and ``graph.pool()`` raises for a failed capture, so
# before 2026-12-07 the routing was never ended: the allocator stayed "capturing" for the rest of the
# process, and the next garbage collection that freed CUDA memory aborted it (H100 test workers,
# 2026-12-06: "Fatal Python error: Aborted", once in the next test's Dynamo trace, once at a
# ``gc.collect()``; ``torch.cuda.empty_cache()`` raises on its internal assert). Now the pool is named by
# ``time_calls``, its routing ended and the pool released here; the graph is still kept (torch's pinned
# host allocator stays routed to it through a filter that points at it, and has no binding to end it).
ABANDONED: list[torch.cuda.CUDAGraph] = []


def _abandon(graph: torch.cuda.CUDAGraph, device: torch.device, pool: tuple[int, int]) -> None:
    """Keep ``graph`` (a failed capture) alive for good; where torch left the allocator routed to its
    ``pool``, end the routing and release the pool (what a successful ``capture_end`` and the graph's
    destructor would have done)."""
    ABANDONED.append(graph)
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:  # never begun (capture_begin failed before it): nothing to end or release
        pass
    else:
        torch._C._cuda_releasePool(index, pool)
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
