"""The stitched runner: one generated Python function per binding that runs a split
program's pieces in order (``make_runner``), keeping its source (``run.__source__``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.fx

__all__ = ["make_runner"]


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
    standing for each piece, and frees each intermediate after its last use."""
    nodes = list(stitch.graph.nodes)
    last_use: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a.name] = i
    params = [n.name for n in nodes if n.op == "placeholder"]
    lines = [f"def run({', '.join(params)}):"]
    env: dict[str, Any] = {}
    for i, n in enumerate(nodes):
        if n.op == "call_module":
            env[f"_{n.target}"] = callables[n.target]
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
