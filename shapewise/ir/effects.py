"""What a graph does to its inputs, read from its fake values: which placeholders it may write
(``mutated_inputs``) and whether an output shares memory with an input or another output
(``aliased_outputs``). Conservative: an unknown op that might write counts as writing.

A saved graph (``dispatch.saved``) keeps these facts instead of most of its fake values
(``values_left_out``): a warm start reads them and never unpickles the values of the nodes
between the inputs and the outputs, which were half its time. A loaded graph that must be
compiled after all (its artifact is gone) gets its values back first (``restore_values``).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.fx

from shapewise import _compat

__all__ = ["aliased_outputs", "inputs_aliased_by_outputs", "mutated_inputs", "restore_values", "saved_facts",
           "values_left_out"]

log = logging.getLogger("shapewise")

#: The output node's meta key of a saved graph's facts (and whether its inner values were left out).
SAVED_FACTS = "shapewise_saved_facts"
_VALUE_KEYS = ("val", "example_value", "tensor_meta")


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


def saved_facts(gm: torch.fx.GraphModule) -> dict[str, Any] | None:
    """The facts a saved graph carries (None: a graph traced in this process)."""
    last = next(iter(reversed(gm.graph.nodes)), None)
    return last.meta.get(SAVED_FACTS) if last is not None and last.op == "output" else None


def mutated_inputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Positions of the placeholders whose memory the graph may write (through any view)."""
    if (facts := saved_facts(gm)) is not None:
        return facts["mutated_inputs"]
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
    if (facts := saved_facts(gm)) is not None:
        return facts["aliased_outputs"]
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
    if (facts := saved_facts(gm)) is not None:
        return facts["inputs_aliased_by_outputs"]
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



def _kept(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose fake values a loaded graph keeps: its inputs and what it returns (the run
    time reads their layouts: lean calls, padding, CUDA-graph plans)."""
    kept = {n for n in gm.graph.nodes if n.op == "placeholder"}
    out = next(iter(reversed(gm.graph.nodes)))
    torch.fx.node.map_arg(out.args, kept.add)
    return kept


@contextlib.contextmanager
def values_left_out(gms: Iterable[torch.fx.GraphModule]) -> Iterator[None]:
    """While it lasts (the pickling of a program), each of ``gms`` carries its facts on its output
    node and no fake values but its inputs' and outputs' (a nested graph, a higher-order op's
    body, keeps all of its own). Everything is put back after, as it was."""
    undo: list[tuple[dict[str, Any], str, Any]] = []
    absent = object()
    try:
        for gm in {id(g): g for g in gms}.values():
            out = next(iter(reversed(gm.graph.nodes)), None)
            if out is None or out.op != "output" or saved_facts(gm) is not None:
                continue
            facts = {"mutated_inputs": mutated_inputs(gm), "aliased_outputs": aliased_outputs(gm),
                     "inputs_aliased_by_outputs": inputs_aliased_by_outputs(gm), "values": "left out"}
            # The facts first: a reader meanwhile (a lean call being made outside the compile lock)
            # finds them, never a graph with neither facts nor values.
            undo.append((out.meta, SAVED_FACTS, out.meta.get(SAVED_FACTS, absent)))
            out.meta[SAVED_FACTS] = facts
            kept = _kept(gm)
            for node in gm.graph.nodes:
                if node not in kept:
                    undo.extend((node.meta, k, node.meta.pop(k)) for k in _VALUE_KEYS if k in node.meta)
        yield
    finally:
        for meta, k, v in reversed(undo):
            if v is absent:
                meta.pop(k, None)
            else:
                meta[k] = v


def restore_values(gm: torch.fx.GraphModule) -> bool:
    """Give a loaded graph's nodes the fake values its save left out, propagated from its inputs'
    (those it kept, in the loaded fake mode): what a compile of it reads. Whether it did (False: the
    graph has all of its values, or they cannot be made again; a compile then goes on without)."""
    facts = saved_facts(gm)
    if facts is None or facts.get("values") != "left out":
        return False
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    args = [_compat.node_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    mode = next((a.fake_mode for a in args if isinstance(a, torch.Tensor) and hasattr(a, "fake_mode")), None)
    if mode is None or any(a is None for a in args):
        log.debug("shapewise: the saved graph's values cannot be made again (an input without one)")
        return False
    kept = {node: {k: node.meta[k] for k in _VALUE_KEYS if k in node.meta} for node in _kept(gm)}
    try:
        with torch.no_grad() if not any(getattr(a, "requires_grad", False) for a in args) else \
                contextlib.nullcontext():
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
        ok = True
    except Exception as e:  # noqa: BLE001 - the compile goes on from the inputs' values alone
        log.warning("shapewise: a loaded graph's inner values cannot be made again (%s: %s); compiling without",
                    type(e).__name__, e)
        ok = False
    for node in gm.graph.nodes:
        if node in kept:  # as saved (the propagation leaves detached copies: requires_grad lost)
            node.meta.update(kept[node])
        elif not ok:
            for k in _VALUE_KEYS:
                node.meta.pop(k, None)
        if ok and "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])
    facts["values"] = "restored" if ok else "not restored"  # (tried once)
    return ok
