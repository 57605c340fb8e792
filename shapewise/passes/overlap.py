"""``OverlapAllReduce``: a row-parallel linear layer and its all-reduce, in row chunks, so that
the all-reduce of one chunk runs while the next chunk's matmul does.

    fast = sw.compile(tp_model, sizes=[1, 16, 256, 4096],
                      graph_passes=[sw.passes.OverlapAllReduce(chunks=4, min_tokens=1024)])

In a tensor-parallel model (Megatron's split) the output projection and the MLP's down
projection are row-parallel: each rank multiplies its slice of K, then an all-reduce sums the
ranks' partial results. The all-reduce waits for the whole matmul, and everything after waits
for the whole all-reduce, so the link and the multiprocessors take turns. Per (piece, static
variant) with at least ``min_tokens`` rows, this pass rewrites

    y = linear(x, W)                  # x [T, K/world], or x @ W.t(), mm, addmm
    y = wait_tensor(all_reduce(y))    # torch.distributed._functional_collectives.all_reduce

into ``chunks`` slices of x's rows, each with its own matmul and all-reduce, every all-reduce
issued before any is waited for, and the pieces put back together (``torch.cat``, which
Inductor fuses into what reads it: the residual add). NCCL runs the collectives on its own
stream, so chunk i's all-reduce overlaps chunk i+1's matmul and only the last chunk's is
exposed. The answer is the same sum (each row's reduction is unchanged). Below ``min_tokens``
the collectives are latency-bound and the matmuls small: chunking would only add launches.
Range variants are left alone.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx

from shapewise._compat import node_value
from shapewise.errors import ConfigError
from shapewise.passes.graph_pass import GraphPass, Sizes, VariantSizes
from shapewise.passes.patterns import match_linear

__all__ = ["OverlapAllReduce"]

log = logging.getLogger("shapewise")


def _targets(name: str) -> tuple[Any, ...]:
    """The op as Dynamo's graph spells it (the packet) and as AOT's does (the overload)."""
    ops = getattr(torch.ops, "_c10d_functional", None)
    packet = getattr(ops, name, None) if ops is not None else None
    return (packet, packet.default) if packet is not None else ()


@dataclass(frozen=True)
class OverlapAllReduce(GraphPass):
    """``wait(all_reduce(linear(x, W)))`` with >= ``min_tokens`` rows -> ``chunks`` row slices,
    each all-reduce overlapping the next slice's matmul."""

    name: ClassVar[str] = "overlap_all_reduce"
    version: ClassVar[int] = 1
    chunks: int = 4
    min_tokens: int = 1024
    align: int = 64  # chunk boundaries on multiples of this many rows (matmul tiles stay whole)

    def __post_init__(self) -> None:
        for field, low in (("chunks", 2), ("min_tokens", 1), ("align", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"OverlapAllReduce({field}={value!r}): give an int >= {low}")

    def applies(self, sizes: Sizes) -> bool:
        return all(isinstance(v, int) for v in sizes.values())

    def rewrite(self, gm: torch.fx.GraphModule, sizes: Sizes) -> torch.fx.GraphModule:
        if not isinstance(sizes, VariantSizes):
            sizes = VariantSizes(sizes)
        all_reduce, wait = _targets("all_reduce"), _targets("wait_tensor")
        if not all_reduce:
            return gm
        changed = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in wait or not node.args:
                continue
            reduce = node.args[0]
            if not (isinstance(reduce, torch.fx.Node) and reduce.target in all_reduce and len(reduce.users) == 1):
                continue
            linear = reduce.args[0]
            if not (isinstance(linear, torch.fx.Node) and len(linear.users) == 1):
                continue
            found = match_linear(linear)
            if found is None or not isinstance(found[0], torch.fx.Node):
                continue
            bounds = self._bounds(sizes.shape(found[0]))
            if bounds is None:
                continue
            self._chunk(gm.graph, node, reduce, linear, found[0], bounds)
            changed += 1
        if changed:
            gm.graph.lint()
            gm.recompile()
        return gm

    def _bounds(self, shape: tuple[int | None, ...] | None) -> list[int] | None:
        """Chunk sizes along dim 0 for an x of ``shape`` at this variant, or None (too few rows,
        a size the variant leaves open)."""
        if not shape or len(shape) < 2 or any(d is None for d in shape):
            return None
        if math.prod(shape[:-1]) < self.min_tokens:
            return None
        rows = shape[0]
        step = -(-rows // self.chunks)
        step = -(-step // self.align) * self.align
        sizes = [min(step, rows - start) for start in range(0, rows, step)]
        return sizes if len(sizes) >= 2 else None

    @staticmethod
    def _chunk(graph: torch.fx.Graph, wait_node: torch.fx.Node, reduce: torch.fx.Node, linear: torch.fx.Node,
               x: torch.fx.Node, sizes: list[int]) -> None:
        waits = []
        with graph.inserting_before(linear):
            parts = graph.call_function(torch.split, (x, sizes), {"dim": 0})
            issued = []
            for i in range(len(sizes)):
                part = graph.call_function(operator.getitem, (parts, i))
                y = graph.node_copy(linear, lambda n: part if n is x else n)
                issued.append(graph.call_function(reduce.target, (y, *reduce.args[1:]), dict(reduce.kwargs)))
        with graph.inserting_before(wait_node):
            for t in issued:
                waits.append(graph.call_function(wait_node.target, (t,), dict(wait_node.kwargs)))
            out = graph.call_function(torch.cat, (waits,), {"dim": 0})
        value = node_value(wait_node)
        if value is not None:
            out.meta["example_value"] = value
        wait_node.replace_all_uses_with(out)
        for dead in (wait_node, reduce, linear):
            graph.erase_node(dead)
