"""Split: partition a graph at splitting ops into pieces plus a stitching graph.

Plan first (``plan_split``: which node goes to which piece, deterministic), then apply
(``apply_plan``: build one GraphModule per piece and the stitching graph).
"""

from __future__ import annotations

import copy
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx

from shapewise._compat import node_value, sym_expr
from shapewise.errors import ShapewiseError
from shapewise.graph_split.registry import OpMatcher, is_allocation, is_getitem, resolve_ops
from shapewise.ir.program import Piece, Program
from shapewise.passes.base import Pass, register_pass

__all__ = ["Split", "SplitPlan", "apply_plan", "plan_split", "stitch_graph"]

log = logging.getLogger("shapewise")


@dataclass(frozen=True)
class SplitPlan:
    """Node name → piece index, and which pieces hold splitting ops."""

    assignment: tuple[tuple[str, int], ...]
    splitting: tuple[bool, ...]

    @property
    def num_pieces(self) -> int:
        return len(self.splitting)

    def nodes_of(self, index: int) -> list[str]:
        return [n for n, i in self.assignment if i == index]


def _is_body(node: torch.fx.Node) -> bool:
    return node.op not in ("placeholder", "output", "get_attr")


def decompose_size_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Return a copy of ``gm`` where whole ``x.size()`` tuples are replaced by per-dim values,
    so that no ``torch.Size`` has to cross a piece boundary."""
    gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph = gm.graph
    for node in list(graph.nodes):
        whole_size = (
            node.op == "call_method" and node.target == "size" and len(node.args) == 1 and not node.kwargs
        ) or (node.op == "call_function" and node.target is torch.ops.aten.sym_size.default)
        if not whole_size:
            continue
        src = node.args[0]
        val = node_value(node)
        if val is None:
            continue
        dims: list[Any] = []
        with graph.inserting_after(node):
            for d, size in enumerate(val):
                if isinstance(size, torch.SymInt):
                    dn = graph.call_method("size", (src, d))
                    dn.meta["example_value"] = size
                    dn.meta["val"] = size
                    dims.append(dn)
                else:
                    dims.append(int(size))
        for user in list(node.users):
            if is_getitem(user) and isinstance(user.args[1], int):
                _replace_uses(user, dims[user.args[1]])  # size[i] -> the i-th dim
                graph.erase_node(user)
        _replace_uses(node, tuple(dims))  # any other use takes the tuple of dims
        graph.erase_node(node)
    gm.recompile()
    return gm


def _replace_uses(node: torch.fx.Node, value: Any) -> None:
    """Put ``value`` (a node, an int or a tuple of them) wherever ``node`` is an argument."""
    for user in list(node.users):
        user.args = torch.fx.node.map_aggregate(user.args, lambda a: value if a is node else a)
        user.kwargs = torch.fx.node.map_aggregate(user.kwargs, lambda a: value if a is node else a)


def _unpacks(node: torch.fx.Node) -> bool:
    """``out[i]`` taking one result of a multi-output op (a tuple), not indexing a tensor:
    ``attention(q, k, v)[:, 0]`` or ``y[idx]`` is computation, and ``idx`` may come later."""
    if not (is_getitem(node) and isinstance(node.args[0], torch.fx.Node) and isinstance(node.args[1], int)):
        return False
    value = node_value(node.args[0])
    return value is None or isinstance(value, (tuple, list))


def plan_split(gm: torch.fx.GraphModule, matchers: Sequence[OpMatcher]) -> SplitPlan:
    """Assign every body node to a piece, in graph order.

    - a run of splitting ops (and their ``getitem``s) forms one splitting piece;
    - a ``getitem`` stays with its producer;
    - a piece that only allocates (``empty*``), next to a splitting piece, joins it.
    """
    piece_of: dict[str, int] = {}
    kinds: list[bool] = []
    for node in gm.graph.nodes:
        if not _is_body(node):
            continue
        if _unpacks(node) and node.args[0].name in piece_of:
            producer = piece_of[node.args[0].name]
            if kinds[producer]:
                piece_of[node.name] = producer
                continue
        splitting = any(m(node) for m in matchers)
        if not kinds or kinds[-1] != splitting:
            kinds.append(splitting)
        piece_of[node.name] = len(kinds) - 1

    # An allocation-only compute piece next to a splitting piece becomes part of it
    # (running an `empty` as its own compiled piece buys nothing); then consecutive
    # splitting pieces merge into one.
    nodes = {n.name: n for n in gm.graph.nodes}
    members: list[list[str]] = [[] for _ in kinds]
    for name, i in piece_of.items():
        members[i].append(name)
    for i, is_split in enumerate(kinds):
        if is_split:
            continue
        only_alloc = any(is_allocation(nodes[n]) for n in members[i]) and all(
            is_allocation(nodes[n]) or is_getitem(nodes[n]) for n in members[i]
        )
        near_split = (i > 0 and kinds[i - 1]) or (i + 1 < len(kinds) and kinds[i + 1])
        if only_alloc and near_split:
            kinds[i] = True
    renumber: list[int] = []
    merged_kinds: list[bool] = []
    for is_split in kinds:
        if not (is_split and merged_kinds and merged_kinds[-1]):
            merged_kinds.append(is_split)
        renumber.append(len(merged_kinds) - 1)
    assignment = tuple((name, renumber[i]) for name, i in piece_of.items())
    return SplitPlan(assignment, tuple(merged_kinds))


def _sizes_of(value: Any) -> tuple[list[Any], list[Any]]:
    """(every size-like expression, the ones a compiler can read a symbol from) of a value."""
    if isinstance(value, torch.SymInt):
        e = sym_expr(value)
        return [e], [e]
    if isinstance(value, torch.Tensor):
        exprs = [sym_expr(d) for d in (*value.shape, *value.stride())]
        return [*exprs, sym_expr(value.storage_offset())], exprs
    return [], []


def _symbol_providers(nodes: Sequence[torch.fx.Node]) -> dict[Any, torch.fx.Node]:
    """For each symbol, a placeholder that carries it bare: a SymInt first, else a tensor dim."""
    out: dict[Any, torch.fx.Node] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for only_ints in (True, False):
        for ph in placeholders:
            value = node_value(ph)
            if only_ints != isinstance(value, torch.SymInt):
                continue
            for e in _sizes_of(value)[1]:
                if e.is_Symbol:
                    out.setdefault(e, ph)
    return out


def _symbol_inputs(inputs: Sequence[torch.fx.Node], providers: dict[Any, torch.fx.Node]) -> list[torch.fx.Node]:
    """Placeholders to add to a compute piece so every symbol of its input sizes can be read
    from an input, and every symbol of a size argument from a size argument.

    A piece after ``cat([y, y[:1]])`` and a splitting op sees only ``s + 1``, from which a
    symbolic Inductor compile cannot recover ``s``; and Inductor's graph cache states its guards
    over the size arguments alone, so a size argument ``2*s`` needs ``s`` as an argument too.
    """
    needed: set[Any] = set()
    bare: set[Any] = set()
    bare_ints: set[Any] = set()
    in_ints: set[Any] = set()
    for a in inputs:
        value = node_value(a)
        exprs, readable = _sizes_of(value)
        needed |= {s for e in exprs for s in e.free_symbols}
        bare |= {e for e in readable if e.is_Symbol}
        if isinstance(value, torch.SymInt):
            (bare_ints if exprs[0].is_Symbol else in_ints).update(exprs[0].free_symbols)
    extra = []
    for s in sorted((needed - bare) | (in_ints - bare_ints), key=str):
        ph = providers.get(s)
        if ph is None or ph in inputs or ph in extra:
            continue
        if s in bare and not isinstance(node_value(ph), torch.SymInt):
            continue  # a tensor dim already carries it; only a size argument would add anything
        extra.append(ph)
    return extra


def apply_plan(gm: torch.fx.GraphModule, plan: SplitPlan) -> tuple[torch.fx.GraphModule, tuple[Piece, ...]]:
    """Build the piece GraphModules and the stitching graph for ``plan``."""
    piece_of = dict(plan.assignment)
    nodes = list(gm.graph.nodes)
    out_node = next(n for n in nodes if n.op == "output")

    # Which values each piece must export: used by a later piece or by the output.
    exports: list[list[torch.fx.Node]] = [[] for _ in range(plan.num_pieces)]
    for node in nodes:
        if node.name not in piece_of:
            continue
        i = piece_of[node.name]
        if any(u is out_node or (u.name in piece_of and piece_of[u.name] != i) for u in node.users):
            exports[i].append(node)

    providers = _symbol_providers(nodes)
    pieces: list[Piece] = []
    piece_inputs: list[list[torch.fx.Node]] = []
    for i in range(plan.num_pieces):
        body = [n for n in nodes if piece_of.get(n.name) == i]
        inputs: list[torch.fx.Node] = []
        attrs: list[torch.fx.Node] = []
        for node in body:
            for a in node.all_input_nodes:
                if piece_of.get(a.name) == i or a in inputs or a in attrs:
                    continue
                (attrs if a.op == "get_attr" else inputs).append(a)
        if not plan.splitting[i]:
            inputs += _symbol_inputs(inputs, providers)
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for a in inputs:
            env[a] = g.placeholder(a.name)
            env[a].meta = dict(a.meta)
        for a in attrs:
            env[a] = g.node_copy(a)
        for node in body:
            env[node] = g.node_copy(node, lambda a: env[a])
        g.output(tuple(env[n] for n in exports[i]))
        name = f"piece_{i}"
        piece_gm = torch.fx.GraphModule(gm, g, class_name=name)
        returned = frozenset(j for j, n in enumerate(exports[i]) if out_node in n.users)
        pieces.append(Piece(name=name, gm=piece_gm, is_splitting=plan.splitting[i], returned=returned))
        piece_inputs.append(inputs)

    stitch = stitch_graph(gm, pieces, piece_inputs, exports)
    return stitch, tuple(pieces)


def stitch_graph(gm: torch.fx.GraphModule, pieces: Sequence[Piece], piece_inputs, exports) -> torch.fx.GraphModule:
    """The top-level graph: the original placeholders, one call per piece, the original output."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    root = torch.nn.Module()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = g.node_copy(node, lambda a: env[a])
    for piece, inputs, outs in zip(pieces, piece_inputs, exports):
        root.add_module(piece.name, piece.gm)
        call = g.call_module(piece.name, tuple(env[a] if a in env else _get_attr(g, env, a) for a in inputs))
        call.meta["example_value"] = tuple(node_value(o) for o in outs)
        for j, o in enumerate(outs):
            item = g.call_function(_getitem, (call, j))
            item.name = o.name
            item.meta = {k: v for k, v in o.meta.items() if k in ("val", "example_value", "tensor_meta")}
            env[o] = item
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    g.output(torch.fx.node.map_arg(out_node.args[0], lambda a: env[a] if a in env else _get_attr(g, env, a)))
    for name, mod in gm.named_children():
        if not hasattr(root, name):
            root.add_module(name, mod)
    return torch.fx.GraphModule(root, g, class_name="Stitched")


def _get_attr(g: torch.fx.Graph, env: dict, a: torch.fx.Node) -> torch.fx.Node:
    raise ShapewiseError(
        f"a get_attr node ({a.format_node()}) is read directly by the stitching graph; "
        "shapewise expects attributes to be read inside a piece"
    )



_getitem = operator.getitem


@register_pass
@dataclass(frozen=True)
class Split(Pass):
    """Split the graph at splitting ops. ``Split(ops=["mylib::attention"])``; no ops: one piece."""

    name: ClassVar[str] = "split"
    ops: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        ops = (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
        object.__setattr__(self, "ops", ops)
        resolve_ops(ops)  # fail early on unknown names

    def plan(self, gm: torch.fx.GraphModule) -> SplitPlan:
        return plan_split(gm, resolve_ops(self.ops))

    def apply(self, program: Program) -> Program:
        gm = decompose_size_calls(program.gm)
        plan = self.plan(gm)
        if self.ops and not any(plan.splitting):
            log.warning("shapewise: the splitting ops %s match no node of the graph: it stays one piece (an op "
                        "decomposed before the split, e.g. sdpa under make_fx, no longer shows; see "
                        "`shapewise inspect` for the graph's targets)", ", ".join(map(str, self.ops)))
        stitch, pieces = apply_plan(gm, plan)
        return program.replace(gm=gm, graph=stitch, pieces=pieces, shapes=None, bindings=None,
                               dispatch=None, split_plan=plan, splitting_ops=tuple(self.ops))
