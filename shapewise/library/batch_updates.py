"""``BatchInputUpdates``: in-place additions to a piece's inputs (a KV cache's token counters),
made at the end of the piece, all of one amount in one ``_foreach_add_``.

    fast = sw.compile_generate(model, ..., graph_passes=[sw.library.BatchInputUpdates()])

transformers' static cache layers keep their token count in a tensor each (``cumulative_length``)
and a decode step adds to it in every layer, ``counter.add_(1)``, after the layer has read it to
place the new keys and values. Compiled, each add is a kernel of its own: Inductor cannot put it
with its layer's cache writes (it must wait for their read of the counter) nor with another
layer's (each waits for its own layer). On the H200 at Llama-3.2-1B shapes that is 16 kernels of
~1.1 µs a decode step (``triton_poi_fused_add_copy_``, benchmarks/results/session_20261204), one a
layer, where one launch does them all.

In: a compute piece's graph (any sizes). Out: each ``x.add_(c)`` whose ``x`` is an input of the
piece that nothing reads after the add (no later node uses ``x`` or a view of it; no other input
shares its memory), whose result is unused and whose amount ``c`` is a number, is taken out, and
before the piece's output one ``torch.ops.aten._foreach_add_.Scalar([x, ...], c)`` per amount adds to all of
them: the same values in every input, read by nothing in between. Nothing is done where fewer than
two such adds share an amount. ``PassResult.modified`` says whether any was moved.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx

from shapewise._compat import node_value, storage_key
from shapewise.passes.base import register_pass
from shapewise.passes.graph_pass import GraphPass, PassResult, Sizes

__all__ = ["BatchInputUpdates"]

_FOREACH_ADD = torch.ops.aten._foreach_add_.Scalar


def _storage(node: torch.fx.Node) -> Any:
    value = node_value(node)
    return storage_key(value) if isinstance(value, torch.Tensor) else None


@register_pass
@dataclass(frozen=True)
class BatchInputUpdates(GraphPass):
    """``x.add_(c)`` on inputs nothing reads afterwards -> one ``_foreach_add_`` per amount, at the end."""

    name: ClassVar[str] = "batch_input_updates"
    version: ClassVar[int] = 2

    def rewrite_key(self, sizes: Sizes) -> Hashable | None:
        return "every size"  # the rewrite reads the graph's storages, never the sizes: one rewrite per piece

    def rewrite(self, gm: torch.fx.GraphModule, sizes: Sizes) -> PassResult:
        graph = gm.graph
        nodes = list(graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        shared: dict[Any, int] = {}  # an input's storage -> how many inputs have it
        for n in nodes:
            if n.op == "placeholder" and (key := _storage(n)) is not None:
                shared[key] = shared.get(key, 0) + 1
        last: dict[Any, int] = {}  # a storage -> the last node that reads or writes it (through any view)
        for n in nodes:
            for m in (n, *n.all_input_nodes):
                if (key := _storage(m)) is not None:
                    last[key] = order[n]
        groups: dict[tuple, list[torch.fx.Node]] = {}
        for n in nodes:
            amount = self._amount(n)
            if amount is None:
                continue
            x = n.args[0]
            key = _storage(x) if x.op == "placeholder" else None
            if key is None or shared.get(key, 0) != 1 or last[key] > order[n]:  # (x's own later users count)
                continue
            groups.setdefault((type(amount), amount), []).append(n)
        output = next(n for n in reversed(nodes) if n.op == "output")
        moved = 0
        for (_, amount), adds in groups.items():
            if len(adds) < 2:
                continue
            inputs = [n.args[0] for n in adds]
            for n in adds:
                graph.erase_node(n)
            with graph.inserting_before(output):
                graph.call_function(_FOREACH_ADD, (inputs, amount))
            moved += len(adds)
        if moved:
            graph.lint()
            gm.recompile()
        return PassResult(gm, bool(moved))

    @staticmethod
    def _amount(node: torch.fx.Node) -> int | float | None:
        """``c`` where ``node`` is ``x.add_(c)`` (a method call, no ``alpha``, its result unused), ``c`` a number."""
        if node.op != "call_method" or node.target != "add_" or node.kwargs or len(node.args) != 2 or node.users \
                or not isinstance(node.args[0], torch.fx.Node):
            return None
        c = node.args[1]
        return c if type(c) in (int, float) else None
