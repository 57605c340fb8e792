"""The CUDA caching allocator's private pools: a call's allocations routed to a pool of its own
(what ``torch.cuda.use_mem_pool`` does, without a context manager's cost per call)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PrivatePool", "private_pools_available"]

_ROUTING = ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool", "_cuda_releasePool")


def private_pools_available() -> bool:
    """Whether this torch can route a thread's allocations to a ``torch.cuda.MemPool``."""
    return (torch.cuda.is_available() and hasattr(torch.cuda, "MemPool")
            and all(hasattr(torch._C, name) for name in _ROUTING))


class PrivatePool:
    """A ``torch.cuda.MemPool`` (made on first use) that the calls ``route`` wraps allocate from.
    A pool only one fixed sequence of calls allocates from, with everything freed between
    rounds, hands out the same addresses each round."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.pool: Any = None

    def route(self, fn: Callable[..., Any], enabled: Callable[[], bool]) -> Callable[..., Any]:
        """``fn`` with its allocations (on this thread) made in the pool while ``enabled()``. One
        call at a time: the allocator refuses to route a second thread to a pool that is routed."""
        begin, end, release = (getattr(torch._C, name) for name in _ROUTING)
        device = self.device

        def routed(*args: Any) -> Any:
            if not enabled():
                return fn(*args)
            if self.pool is None:
                with torch.cuda.device(device):  # a MemPool belongs to the device current when it is made
                    self.pool = torch.cuda.MemPool()
            pool_id = self.pool.id
            begin(device, pool_id)  # as torch.cuda.use_mem_pool: take a reference, route, give it back
            try:
                return fn(*args)
            finally:
                end(device, pool_id)
                release(device, pool_id)

        routed.__wrapped__ = fn
        return routed

    def bytes(self) -> int:
        """The device memory the pool holds (its segments)."""
        if self.pool is None:
            return 0
        pool_id = tuple(self.pool.id)
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == pool_id)
