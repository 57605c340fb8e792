"""Capturing CUDA graphs at start-up (``CudaGraphs(capture="startup")``): every captured size
run on dummy inputs, largest first, and the device memory the graphs hold."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import sympy
import torch

from shapewise import _compat
from shapewise.dispatch.cudagraphs import GraphRuntime, is_fixed
from shapewise.errors import ConfigError
from shapewise.ir.program import Program, TensorMeta

__all__ = ["capture_now", "dummy_inputs", "graph_memory"]

log = logging.getLogger("shapewise")


def dummy_inputs(program: Program, key: tuple, example_inputs: Sequence[Any],
                 written: frozenset[int] = frozenset()) -> list[Any]:
    """The graph's inputs at the size ``key``, for capturing it before any real call: inputs
    whose layout depends on a dynamic size become zeros at that size's layout; other inputs the
    caller passes anew each call become copies (made anew per call of ``dummy_inputs``, so a
    graph copies them in, as it will the caller's); parameters, buffers and the inputs the graph
    writes (``written``: positions; a KV cache, used where it is) are the example inputs
    themselves, as the real calls will pass them (``capture_now`` restores the ones the graph
    writes)."""
    shapes = program.shapes
    values = dict(zip(shapes.symbols, key))
    out = []
    for i, (meta, example) in enumerate(zip(shapes.inputs, example_inputs)):
        if isinstance(meta, sympy.Basic):
            out.append(int(meta.subs(values)))
        elif not isinstance(example, torch.Tensor) or is_fixed(example):
            out.append(example)
        elif isinstance(meta, TensorMeta) and any(getattr(e, "free_symbols", None)
                                                  for e in (*meta.shape, *meta.stride, meta.offset)):
            shape, stride, offset = meta.at(values)
            storage = torch.zeros(max(_compat.storage_length(shape, stride, offset), 1), dtype=meta.dtype,
                                  device=example.device)
            out.append(storage.as_strided(shape, stride, offset))
        elif i in written:
            out.append(example)
        else:
            out.append(torch.empty_strided(example.shape, example.stride(), dtype=example.dtype,
                                           device=example.device).copy_(example))
    return out


def capture_now(program: Program, runtime: Any, example_inputs: Sequence[Any],
                progress: bool | None = None) -> dict[str, Any]:
    """Capture every size of a program that ``CudaGraphs`` planned, now, through the Runnable's
    ``runtime`` (``runtime.DispatchRuntime``), on dummy inputs
    (``dummy_inputs``), largest first: each size runs once (its warm-up) and is captured.

    Inputs the graph writes in place are left as they were: they are restored from a snapshot
    afterwards (so a cache written since start-up keeps its contents; the snapshot costs one copy
    of each such tensor while capturing). Returns (and logs) the sizes captured,
    the seconds it took and the bytes the graphs hold (``graph_memory``)."""
    from tqdm import tqdm

    plan = program.dispatch.graphs if program.dispatch is not None else None
    keys = list(plan.keys) if plan is not None else []
    if not keys or runtime.graphs is None:
        raise ConfigError("capture_now: the program has no CUDA-graph sizes (CudaGraphs found no compiled single "
                          "size to capture; give capture_sizes)")
    start = time.perf_counter()
    for gate in runtime.graphs.gates:  # variants still compile workers' (wait_for_workers="never"): loaded first,
        for variant in gate.pending:  # so that the graphs hold compiled kernels, not an eager stand-in's
            variant.resolve()
    show = progress if progress is not None else logging.getLogger("shapewise").isEnabledFor(logging.INFO)
    written = plan.written  # the inputs the graph writes, as CudaGraphs found them
    kept = [t for i, t in enumerate(example_inputs) if i in written and isinstance(t, torch.Tensor)]
    with torch.no_grad():
        snapshots = [t.clone() for t in kept]
    try:
        for key in tqdm(sorted(keys, reverse=True), desc="shapewise capture", unit="size", disable=not show,
                        leave=False):
            run = runtime.table.exact[key]
            # Dummies made anew for the capture (both alive, so at other addresses): the graph copies
            # them in, as it will the caller's inputs, and uses the example inputs where they are.
            warm = dummy_inputs(program, key, example_inputs, written)
            run(*warm)  # warm-up
            run(*dummy_inputs(program, key, example_inputs, written))  # capture
            del warm
    finally:
        with torch.no_grad():
            for t, snapshot in zip(kept, snapshots):
                t.copy_(snapshot)  # undo the dummy calls' writes to a static KV cache (or parameters)
    torch.cuda.synchronize()
    info = {"sizes": [program.dispatch.describe_key(k) for k in sorted(keys)],
            "seconds": round(time.perf_counter() - start, 3), **graph_memory(runtime.graphs)}
    log.info("shapewise: captured %d CUDA graph size(s) at start-up in %.1f s; graph pool %.1f MiB, static input "
             "buffers %.1f MiB, splitting ops' pools %.1f MiB", len(keys), info["seconds"], info["pool_bytes"] / 2**20,
             info["buffers_bytes"] / 2**20, info["split_pools_bytes"] / 2**20)
    return info


def graph_memory(graphs: GraphRuntime) -> dict[str, float]:
    """The device memory a Runnable's CUDA graphs hold, in bytes: their shared pool (the segments
    the caching allocator keeps for it), the static input buffers, and the private pools the
    splitting ops of piecewise sizes allocate their outputs in."""
    pieces = graphs.pieces
    pools = {tuple(p.pool.handle) for p in pieces if p.pool.handle is not None}
    pool_bytes = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                     if tuple(seg.get("segment_pool_id", ())) in pools)
    buffers = {id(b): b for p in [*pieces, *graphs.staged] for b in p.buffers
               if b is not None and b.storage is not None}
    buffer_bytes = sum(b.storage.numel() * b.storage.element_size() for b in buffers.values())
    split_pools = {id(p.group.split_pool): p.group.split_pool for p in pieces
                   if p.group is not None and p.group.split_pool is not None}
    return {"pool_bytes": pool_bytes, "buffers_bytes": buffer_bytes,
            "split_pools_bytes": sum(sp.bytes() for sp in split_pools.values())}
