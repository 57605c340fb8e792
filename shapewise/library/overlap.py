"""``OverlapAllReduce``: a piece's all-reduces overlapped with its compute, by running the piece
in row chunks, pipelined.

    fast = sw.compile(tp_model, sizes=[1, 16, 256, 4096], splitting_ops=[attention],
                      graph_passes=[sw.library.OverlapAllReduce()])   # chunks=4, min_tokens=2048

In: a compute piece's graph at a static size whose row count (the one size symbol that is dim 0
of the piece's tensor inputs) is at least ``min_tokens``, and which holds an
``_c10d_functional.all_reduce``. Out: the same graph with its row-wise part (linear layers of a
row-split input and a weight without rows, pointwise ops, reductions, softmax and splits over a
dim other than 0, views that keep dim 0, casts, the all-reduces and their waits) run as up to
``chunks`` slices of rows, in pipeline order: every slice's work up to its first all-reduce,
then slice 0's work up to its next one, slice 1's, and so on, so that slice i's all-reduce runs
(on NCCL's stream) while slices i+1.. compute. The slices are put back together (``torch.cat``)
where the piece returns them or where a node that is not row-wise reads them; anything not
row-wise ends the chunked region. Slices are equal multiples of ``align`` rows, each at least
``min_slice`` rows, the last taking the remainder. The answers are the unchunked piece's.
``PassResult.modified`` is False, and the graph untouched, for range variants, fewer rows,
pieces without an all-reduce, pieces whose tokens are not dim 0 of their inputs (flatten them
to ``[tokens, hidden]``) and pieces with in-place ops (the slices run out of the old order).
The rewritten variants get Inductor options that keep the slices' kernels and waits apart
(``inductor_options``). Why these defaults, and what the slices cost:
``benchmarks/results/overlap_h200/NOTE.md``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import sympy
import torch
import torch.fx
import torch.nn.functional as F

from shapewise._compat import node_value, sym_expr
from shapewise.errors import ConfigError
from shapewise.library.patterns import match_linear
from shapewise.passes.base import register_pass
from shapewise.passes.graph_pass import GraphPass, PassResult, Sizes, VariantSizes

__all__ = ["OverlapAllReduce"]

_POINTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.neg, torch.abs, torch.exp, torch.log,
    torch.rsqrt, torch.sqrt, torch.tanh, torch.sigmoid, torch.relu, torch.clamp,
    F.silu, F.gelu, F.relu, F.sigmoid, F.tanh,
}
_POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "pow", "neg", "abs", "exp", "log", "rsqrt", "sqrt", "tanh", "sigmoid", "relu",
    "clamp", "float", "half", "bfloat16", "to", "type_as", "contiguous",
}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "softmax", "log_softmax", "var"}
_REDUCTION_FUNCTIONS = {torch.mean: "mean", torch.sum: "sum", torch.amax: "amax", torch.amin: "amin",
                        torch.softmax: "softmax", F.softmax: "softmax", F.log_softmax: "log_softmax"}
_SPLITS = {"chunk": 2, "split": 2, "unbind": 1, "tensor_split": 2}  # method -> position of its dim argument
_SPLIT_FUNCTIONS = {torch.chunk: "chunk", torch.split: "split", torch.unbind: "unbind",
                    torch.tensor_split: "tensor_split"}
_VIEWS = {"view", "reshape"}


def _targets(name: str) -> tuple[Any, ...]:
    """A c10d functional op as Dynamo's graph spells it (the packet) and as AOT's does (the overload)."""
    ops = getattr(torch.ops, "_c10d_functional", None)
    packet = getattr(ops, name, None) if ops is not None else None
    return (packet, packet.default) if packet is not None else ()


def _tensors(value: Any) -> list[torch.Tensor] | None:
    """The tensors of a node's value (one, or a tuple/list of them); None for anything else."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return None


def _inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), out.append)
    return out


def _arg(node: torch.fx.Node, pos: int, name: str, default: Any) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


@dataclass
class _Plan:
    """Which nodes run per slice ('split'), once ('shared': no rows), or whole after a cat."""

    sym: sympy.Symbol
    sizes: list[int]
    kind: dict[torch.fx.Node, str] = field(default_factory=dict)
    depth: dict[torch.fx.Node, int] = field(default_factory=dict)  # all-reduces waited for on the way


@register_pass
@dataclass(frozen=True)
class OverlapAllReduce(GraphPass):
    """Pieces with an all-reduce, at >= ``min_tokens`` rows, in ``chunks`` pipelined row slices."""

    name: ClassVar[str] = "overlap_all_reduce"
    version: ClassVar[int] = 2
    chunks: int = 4
    min_tokens: int = 2048
    align: int = 256  # slice sizes are multiples of this many rows
    min_slice: int = 1024  # rows

    def __post_init__(self) -> None:
        for name, low in (("chunks", 2), ("min_tokens", 1), ("align", 1), ("min_slice", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"OverlapAllReduce({name}={value!r}): give an int >= {low}")

    def applies(self, sizes: Sizes) -> bool:
        return all(isinstance(v, int) for v in sizes.values())

    def inductor_options(self) -> dict[str, Any]:
        # Inductor's reordering for peak memory would gather the slices' waits together, and so
        # would its side-by-side fusion of two slices' same-shaped kernels (they share a read of
        # a norm's weight, a few KiB): each slice would then wait for every slice's all-reduce.
        # Fusions along a slice share whole activations (MiBs at these sizes) and still happen.
        return {"reorder_for_peak_memory": False, "score_fusion_memory_threshold": 2**20}

    def rewrite(self, gm: torch.fx.GraphModule, sizes: Sizes) -> PassResult:
        if not isinstance(sizes, VariantSizes):
            sizes = VariantSizes(sizes)
        plan = self.plan(gm.graph, sizes)
        if plan is None:
            return PassResult(gm, False)
        gm.graph = _emit(gm.graph, plan)
        gm.recompile()
        return PassResult(gm, True)

    # -- which nodes are row-wise ----------------------------------------------------------
    def plan(self, graph: torch.fx.Graph, sizes: VariantSizes) -> _Plan | None:
        """The chunking of ``graph`` at these sizes, or None (no row dim, too few rows, no
        all-reduce among the row-wise nodes)."""
        sym = _row_symbol(graph)
        rows = sizes.evaluate(sym) if sym is not None else None
        if rows is None or rows < self.min_tokens:
            return None
        bounds = self._bounds(rows)
        if bounds is None:
            return None
        plan = _Plan(sym, bounds)
        wait, reduce = _targets("wait_tensor"), _targets("all_reduce")
        if any(_writes(node) for node in graph.nodes if node.target not in wait + reduce):
            return None  # slices run out of the old order: nothing may depend on when a write happens
        reduces = 0
        for node in graph.nodes:
            kind = _classify(node, plan, wait + reduce)
            plan.kind[node] = kind
            if kind == "split":
                below = [plan.depth[n] for n in _inputs(node) if plan.kind.get(n) == "split"]
                plan.depth[node] = max(below, default=0) + (node.target in wait)
                reduces += node.target in reduce
        if not reduces:
            return None
        for node in graph.nodes:  # a node reading a tuple of slices whole (not through getitem): leave it
            if plan.kind[node] == "whole" and any(
                    plan.kind[n] == "split" and not isinstance(node_value(n), torch.Tensor) for n in _inputs(node)):
                return None
        return plan

    def _bounds(self, rows: int) -> list[int] | None:
        """Slice sizes: up to ``chunks`` equal multiples of ``align`` rows (whole matmul tiles:
        a slice of 1088 rows runs its 256-row tiles 15% empty), each at least ``min_slice`` rows
        (smaller matmuls lose more to their launch and tail than the overlap wins back), the
        last taking the remainder; None where two such slices do not fit."""
        a = self.align
        for c in range(self.chunks, 1, -1):
            step = rows // c // a * a
            if step >= max(a, self.min_slice):
                return [step] * (c - 1) + [rows - step * (c - 1)]
        return None


def _writes(node: torch.fx.Node) -> bool:
    """An in-place or otherwise side-effecting node (its place in the order matters)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    overloads = getattr(node.target, "overloads", None)
    if callable(overloads):  # an OpOverloadPacket: mutable if any overload is
        try:
            if any(getattr(node.target, o)._schema.is_mutable for o in overloads()):
                return True
        except (AttributeError, RuntimeError):
            return True
    return node.is_impure() and node.target is not operator.getitem


def _row_symbol(graph: torch.fx.Graph) -> sympy.Symbol | None:
    """The one size symbol that is dim 0 of the piece's tensor inputs (None if none or several)."""
    found = set()
    for node in graph.find_nodes(op="placeholder"):
        value = node_value(node)
        if isinstance(value, torch.Tensor) and value.dim():
            expr = sym_expr(value.shape[0])
            if isinstance(expr, sympy.Symbol):
                found.add(expr)
    return found.pop() if len(found) == 1 else None


def _has_rows(value: Any, sym: sympy.Symbol) -> bool:
    tensors = _tensors(value)
    if tensors is not None:
        return any(sym in sym_expr(d).free_symbols for t in tensors for d in t.shape)
    if isinstance(value, torch.SymInt):
        return sym in sym_expr(value).free_symbols
    return False


def _rows_first(value: Any, sym: sympy.Symbol) -> bool:
    """Every tensor of the value has the row symbol as dim 0 and nowhere else."""
    tensors = _tensors(value)
    return tensors is not None and all(
        t.dim() and sym_expr(t.shape[0]) == sym and not any(sym in sym_expr(d).free_symbols for d in t.shape[1:])
        for t in tensors)


def _classify(node: torch.fx.Node, plan: _Plan, collectives: tuple[Any, ...]) -> str:
    """'split', 'shared', 'row' (the row count itself), or 'whole'."""
    value = node_value(node)
    if node.op == "placeholder":
        if isinstance(value, torch.SymInt) and sym_expr(value) == plan.sym:
            return "row"
        if _rows_first(value, plan.sym):
            return "split"
        return "whole" if _has_rows(value, plan.sym) else "shared"
    if node.op == "output":
        return "whole"
    kinds = [plan.kind[n] for n in _inputs(node)]
    if "whole" in kinds:
        return "whole"
    if "split" not in kinds:
        if "row" in kinds or _has_rows(value, plan.sym):
            return "whole"
        return "shared"
    if node.op not in ("call_function", "call_method") or not _rows_first(value, plan.sym):
        return "whole"
    return "split" if _row_wise(node, plan, collectives) else "whole"


def _row_wise(node: torch.fx.Node, plan: _Plan, collectives: tuple[Any, ...]) -> bool:
    """Whether each output row of ``node`` is computed from the same row of its split inputs."""
    kind = plan.kind
    row_args = [n for n in _inputs(node) if kind[n] == "row"]
    target, method = node.target, node.target if node.op == "call_method" else None
    first = node.args[0] if node.args else None
    if row_args and method not in _VIEWS and target is not torch.reshape:
        return False
    if target in collectives:
        return True
    if target is operator.getitem:
        parts = _tensors(node_value(first)) if isinstance(first, torch.fx.Node) else None
        return parts is not None and len(parts) > 1 and isinstance(node.args[1], int)
    linear = match_linear(node) if node.op == "call_function" else None
    if linear is not None:
        x, weight, bias, _ = linear
        return (kind.get(x) == "split" and kind.get(weight) == "shared"
                and (bias is None or kind.get(bias) == "shared"))
    if not isinstance(first, torch.fx.Node) or kind.get(first) != "split":
        return False
    ndim = node_value(first).dim()
    if method in _VIEWS or target is torch.reshape:
        return True  # the value's dim 0 is the row symbol (checked): rows map to themselves
    name = method if method in _REDUCTIONS | set(_SPLITS) else (
        _REDUCTION_FUNCTIONS.get(target) or _SPLIT_FUNCTIONS.get(target))
    if name in _REDUCTIONS:
        dims = _arg(node, 1, "dim", None)
        return dims is not None and _dims_skip_rows(dims, ndim)
    if name in _SPLITS:
        return _dims_skip_rows(_arg(node, _SPLITS[name], "dim", 0), ndim)
    if target in _POINTWISE_FUNCTIONS or method in _POINTWISE_METHODS:
        out_dim = node_value(node).dim()
        for n in _inputs(node):
            v = node_value(n)
            if not isinstance(v, torch.Tensor):
                continue
            if kind[n] == "split" and v.dim() != out_dim:
                return False  # rows would broadcast into another dim
            if kind[n] == "shared" and v.dim() == out_dim and sym_expr(v.shape[0]) != 1:
                return False
        return True
    return False


def _sliced(value: Any, rows: int, sym: sympy.Symbol) -> Any:
    """A fake value like ``value`` (a tensor or a tuple of them, the row dim first) with ``rows``
    rows: what a slice's node carries as its ``example_value`` (AOTAutograd's cache wants one on
    every tensor a method is called on). ``value`` itself where it cannot be made."""
    if isinstance(value, (tuple, list)):
        return type(value)(_sliced(v, rows, sym) for v in value)
    mode = getattr(value, "fake_mode", None)
    if not isinstance(value, torch.Tensor) or mode is None or any(
            sym in sym_expr(st).free_symbols for st in value.stride()):
        return value
    with mode:
        return torch.empty_strided((rows, *value.shape[1:]), value.stride(), dtype=value.dtype, device=value.device)


def _dims_skip_rows(dims: Any, ndim: int) -> bool:
    items = dims if isinstance(dims, (tuple, list)) else (dims,)
    return all(isinstance(d, int) for d in items) and all(d % ndim != 0 for d in items)


# -- the rewritten graph --------------------------------------------------------------------
def _emit(graph: torch.fx.Graph, plan: _Plan) -> torch.fx.Graph:
    """Placeholders, then the nodes without rows, then the split nodes slice by slice in pipeline
    order (by all-reduces waited for, then slice, then the old order), then the cats and the
    nodes that need whole values."""
    new = torch.fx.Graph()
    order = {n: i for i, n in enumerate(graph.nodes)}
    env: dict[torch.fx.Node, Any] = {}
    per_chunk: list[dict[torch.fx.Node, Any]] = [{} for _ in plan.sizes]
    split_nodes = [n for n in graph.nodes if plan.kind[n] == "split" and n.op != "placeholder"]
    for node in graph.find_nodes(op="placeholder"):
        env[node] = new.node_copy(node, lambda n: env[n])
    for node in graph.find_nodes(op="placeholder"):
        if plan.kind[node] == "row":
            for i, size in enumerate(plan.sizes):
                per_chunk[i][node] = size
        elif plan.kind[node] == "split":
            value = node_value(node)
            parts = new.call_function(torch.split, (env[node], list(plan.sizes)), {"dim": 0})
            parts.meta["example_value"] = tuple(_sliced(value, size, plan.sym) for size in plan.sizes)
            for i, size in enumerate(plan.sizes):
                per_chunk[i][node] = new.call_function(operator.getitem, (parts, i))
                per_chunk[i][node].meta["example_value"] = _sliced(value, size, plan.sym)
    for node in graph.nodes:
        if plan.kind[node] == "shared" and node.op != "placeholder":
            env[node] = new.node_copy(node, lambda n: env[n])
    for node, i in sorted(((n, i) for n in split_nodes for i in range(len(plan.sizes))),
                          key=lambda ni: (plan.depth[ni[0]], ni[1], order[ni[0]])):
        copy = new.node_copy(node, lambda n, i=i: per_chunk[i][n] if n in per_chunk[i] else env[n])
        copy.meta.pop("val", None)
        copy.meta["example_value"] = _sliced(node_value(node), plan.sizes[i], plan.sym)
        per_chunk[i][node] = copy

    def whole(n: torch.fx.Node) -> Any:
        if n not in env:  # a split value read whole: its slices, back together
            env[n] = new.call_function(torch.cat, ([per_chunk[i][n] for i in range(len(plan.sizes))],), {"dim": 0})
            value = node_value(n)
            if value is not None:
                env[n].meta["example_value"] = value
        return env[n]

    for node in graph.nodes:
        if plan.kind[node] in ("whole",) or node.op == "output":
            env[node] = new.node_copy(node, whole)
    new.lint()
    return new

