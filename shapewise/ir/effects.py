"""What a graph does to its inputs, read from its fake values: which placeholders it may write
(``mutated_inputs``) and whether an output shares memory with an input or another output
(``aliased_outputs``). Conservative: an unknown op that might write counts as writing."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from shapewise import _compat

__all__ = ["aliased_outputs", "inputs_aliased_by_outputs", "mutated_inputs"]


#: ``x += y`` and its kin: Dynamo records them as these functions, which write their first
#: argument when it is a tensor.
_AUGMENTED = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                        operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                        operator.irshift, operator.imatmul})


def _written_args(node: torch.fx.Node) -> list[Any]:
    """The arguments ``node`` may write to (conservative: in-place methods and functions,
    augmented assignment, ``out=``, ``inplace=True``, setitem, and ops whose schema marks an
    argument as written)."""
    if node.op == "call_method":
        name = str(node.target)
        return [node.args[0]] if name.endswith("_") and not name.startswith("_") else []
    if node.op != "call_function":
        return []
    out = [node.kwargs["out"]] if "out" in node.kwargs else []
    if node.kwargs.get("inplace") is True:
        out.append(node.args[0])
    target = node.target
    name = getattr(target, "__name__", "")
    if target is operator.setitem or target in _AUGMENTED or (name.endswith("_") and not name.startswith("_")):
        out.append(node.args[0])
    schema = _compat.op_schema(target)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                if i < len(node.args):
                    out.append(node.args[i])
                elif a.name in node.kwargs:
                    out.append(node.kwargs[a.name])
    return out


def mutated_inputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Positions of the placeholders whose memory the graph may write (through any view)."""
    storage_of: dict[Any, int] = {}
    for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        v = _compat.node_value(n)
        if isinstance(v, torch.Tensor):
            storage_of.setdefault(_compat.storage_key(v), i)
    out = set()
    for node in gm.graph.nodes:
        for arg in _written_args(node):
            flat = arg if isinstance(arg, (list, tuple)) else [arg]
            for a in flat:
                v = _compat.node_value(a) if isinstance(a, torch.fx.Node) else None
                if isinstance(v, torch.Tensor):
                    i = storage_of.get(_compat.storage_key(v))
                    if i is not None:
                        out.add(i)
    return frozenset(out)


def aliased_outputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Positions of the outputs of ``gm`` that share memory with an input or with an earlier
    output, or whose memory is not known (no fake value): AOTAutograd regenerates them at run
    time, outside the compiled code."""
    inputs = {_compat.storage_key(v) for n in gm.graph.nodes if n.op == "placeholder"
              if isinstance(v := _compat.node_value(n), torch.Tensor)}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    seen: set[Any] = set()
    aliased = set()
    for i, o in enumerate(outs):
        if not isinstance(o, torch.fx.Node):
            continue
        v = _compat.node_value(o)
        if not isinstance(v, torch.Tensor):
            if v is None:
                aliased.add(i)
            continue
        key = _compat.storage_key(v)
        if key in inputs or key in seen:
            aliased.add(i)
        seen.add(key)
    return frozenset(aliased)


def inputs_aliased_by_outputs(gm: torch.fx.GraphModule) -> frozenset[int] | None:
    """Positions of the inputs of ``gm`` whose memory an output shares (None: an output's
    memory is not known, no fake value)."""
    keys = {}
    for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        if isinstance(v := _compat.node_value(n), torch.Tensor):
            keys.setdefault(_compat.storage_key(v), set()).add(i)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    aliased: set[int] = set()
    for o in outs:
        if not isinstance(o, torch.fx.Node):
            continue
        v = _compat.node_value(o)
        if v is None:
            return None
        if isinstance(v, torch.Tensor):
            aliased |= keys.get(_compat.storage_key(v), set())
    return frozenset(aliased)

