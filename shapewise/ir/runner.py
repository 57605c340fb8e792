"""The stitched runner: one generated Python function per binding that runs a split
program's pieces in order (``make_runner``), keeping its source (``run.__source__``)."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

from shapewise.errors import ShapewiseError

__all__ = ["LAYOUTS_ATTR", "make_runner"]

log = logging.getLogger("shapewise")

#: The attribute a compiled piece's callable carries (set by ``Lower`` on Inductor artifacts):
#: per argument, the (shape, stride) the runner makes sure of before the call where the value
#: comes from a callable without this attribute (a splitting op, an eagerly run fallback), None
#: for nothing to check; () where the compiled code asserts its own inputs. Its presence also
#: says that the callable's outputs have its graph's fake layouts (Inductor keeps them), so a
#: later piece reading them needs no check.
LAYOUTS_ATTR = "__shapewise_layouts__"


def _fmt(arg: Any) -> str:
    if isinstance(arg, torch.fx.Node):
        return arg.name
    if isinstance(arg, tuple):
        return "(" + "".join(_fmt(a) + ", " for a in arg) + ")"
    if isinstance(arg, list):
        return "[" + ", ".join(_fmt(a) for a in arg) + "]"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt(v)}" for k, v in arg.items()) + "}"
    return repr(arg)


def make_runner(stitch: torch.fx.GraphModule, callables: Mapping[str, Callable[..., Any]]) -> Callable[..., Any]:
    """Generate one Python function that runs the pieces in order, with ``callables[piece]``
    standing for each piece, and frees each intermediate after its last use. Before a piece
    whose callable lists the layouts it was compiled for (``LAYOUTS_ATTR``), each argument an
    unchecked producer made (a splitting op, an eager fallback) is checked against its layout."""
    nodes = list(stitch.graph.nodes)
    last_use: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a.name] = i
    params = [n.name for n in nodes if n.op == "placeholder"]
    lines = [f"def run({', '.join(params)}):"]
    warned: set[str] = set()  # one warning per place and runner (a runner serves one size)
    env: dict[str, Any] = {"_relayout": lambda t, shape, stride, where: _relayout(t, shape, stride, where, warned)}
    for i, n in enumerate(nodes):
        if n.op == "call_module":
            env[f"_{n.target}"] = callables[n.target]
            lines += _checks(n, callables, env)
            lines.append(f"    {n.name} = _{n.target}({', '.join(_fmt(a) for a in n.args)})")
        elif n.op == "call_function":
            lines.append(f"    {n.name} = {_fmt(n.args[0])}[{n.args[1]!r}]")
        elif n.op == "output":
            lines.append(f"    return {_fmt(n.args[0])}")
            break
        dead = [a.name for a in n.all_input_nodes if last_use.get(a.name) == i and a.op != "placeholder"]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    src = "\n".join(lines) + "\n"
    exec(compile(src, "<shapewise-runner>", "exec"), env)  # noqa: S102 - generated from the graph
    run = env["run"]
    run.__source__ = src
    return run


def _producer(a: torch.fx.Node) -> torch.fx.Node | None:
    """The piece call that made ``a`` (None: a program input)."""
    if a.op == "call_function" and isinstance(a.args[0], torch.fx.Node):
        a = a.args[0]
    return a if a.op == "call_module" else None


def _checks(n: torch.fx.Node, callables: Mapping[str, Callable[..., Any]], env: dict[str, Any]) -> list[str]:
    """Lines that check (and fix) the layouts of ``n``'s arguments its callable needs checked."""
    layouts = getattr(callables[n.target], LAYOUTS_ATTR, ())
    lines = []
    for j, (a, want) in enumerate(zip(n.args, layouts)):
        if want is None or not isinstance(a, torch.fx.Node):
            continue
        producer = _producer(a)
        if producer is None or hasattr(callables[producer.target], LAYOUTS_ATTR):
            continue  # a program input (guarded) or a compiled piece's output (its fake layout)
        shape, stride = want
        dims = tuple(d for d, size in enumerate(shape) if size != 1)  # size-1 dims: any stride
        if not dims:
            cond = f"{a.name}.shape != {shape!r}"
        else:
            pick = f"_pick_{n.target}_{j}"
            env[pick] = operator.itemgetter(*dims)
            want_strides = tuple(stride[d] for d in dims)
            cond = (f"{a.name}.shape != {shape!r} or {pick}({a.name}.stride()) != "
                    f"{want_strides if len(dims) > 1 else want_strides[0]!r}")
        where = f"{producer.target}'s output {a.name}, argument {j} of {n.target}"
        lines.append(f"    if {cond}:")
        lines.append(f"        {a.name} = _relayout({a.name}, {shape!r}, {stride!r}, {where!r})")
    return lines


def _relayout(t: Any, shape: tuple[int, ...], stride: tuple[int, ...], where: str, warned: set[str]) -> torch.Tensor:
    """``t`` in the layout a compiled piece expects: a copy where only the strides differ; an
    error where the shape does (the op's fake kernel and its real one disagree)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ShapewiseError(
            f"{where}: the next piece was compiled for shape {shape}, got {got}. The op's fake (meta) "
            "kernel promised one shape and the op returned another: fix its register_fake (torch.library.opcheck "
            "tests it)")
    if where not in warned:
        warned.add(where)
        log.warning("shapewise: %s has strides %s where the next piece was compiled for %s (the op's fake kernel "
                    "gives another layout than the op): copied into that layout on every call; make the fake "
                    "return the real layout to save the copy", where, tuple(t.stride()), stride)
    return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).copy_(t)
