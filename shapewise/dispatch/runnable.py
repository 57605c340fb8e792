"""The runnable a pipeline returns: read sizes, look up a runner, call it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.fx

from shapewise.dispatch.guards import InputGuards
from shapewise.dispatch.table import DispatchTable
from shapewise.passes.base import Pass, PassRecord, register_pass
from shapewise.passes.display import Report
from shapewise.passes.program import Binding, Program

__all__ = ["BuildDispatch", "Runnable", "make_runner"]


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


def _callables_for(program: Program, binding: Binding | None) -> dict[str, Callable[..., Any]]:
    out = {}
    for p in program.pieces:
        if p.is_splitting or binding is None:
            out[p.name] = p.gm.forward
        else:
            v = p.variant_for(binding)
            out[p.name] = v.compiled if v is not None and v.compiled is not None else p.gm.forward
    return out


@register_pass
@dataclass(frozen=True)
class BuildDispatch(Pass):
    """Build the dispatch table: one runner per binding. ``on_miss``: "error" (default),
    "dynamic" (compile a general variant on the first miss) or "eager"."""

    name: ClassVar[str] = "build_dispatch"
    on_miss: str = "error"

    def requires(self, program: Program) -> Sequence[Pass]:
        if program.bindings is None or any(
            v.compiled is None for p in program.compute_pieces for v in p.variants
        ):
            from shapewise.passes.lower import Lower

            return [Lower()]
        return ()

    def apply(self, program: Program) -> Program:
        shapes = program.shapes
        on_miss = program.attrs.get("on_miss", self.on_miss)
        exact, ranges = {}, []
        guards = InputGuards(program)  # checks inputs (no-op when Dynamo's guards sit in front)
        for b in program.bindings:
            runner = guards.wrap(b, make_runner(program.graph, _callables_for(program, b)))
            if b.is_static:
                exact[b.key] = runner
            else:
                ranges.append((b, runner))
        miss_runner = None
        if on_miss == "eager":
            eager = make_runner(program.graph, _callables_for(program, None))
            miss_runner = lambda key: eager  # noqa: E731
        elif on_miss == "dynamic":
            miss_runner = _GeneralVariant(program)
        table = DispatchTable(shapes.symbols, [shapes.sources[s] for s in shapes.symbols], exact, ranges,
                              shapes.names, on_miss, guards.wrap_miss(miss_runner))
        return program.replace(dispatch=table)


class _GeneralVariant:
    """Compiles, on the first miss, one variant with every symbol dynamic, and reuses it."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.runner: Callable[..., Any] | None = None
        self.rows: list[dict[str, Any]] = []

    def __call__(self, key: tuple) -> Callable[..., Any]:
        if self.runner is None:
            from shapewise.concretize.concretize import attach_variants, make_bindings
            from shapewise.passes.lower import Lower

            (general,) = make_bindings(self.program.shapes)
            pieces = attach_variants(self.program.pieces, [general])
            lower = self.program.lowering or Lower()
            callables = {}
            for p in pieces:
                if p.is_splitting:
                    callables[p.name] = p.gm.forward
                    continue
                v = lower.compile_variant(p, p.variants[0])
                self.rows.append({**v.report, "key": "general (on_miss='dynamic')"})
                callables[p.name] = v.compiled
            self.runner = make_runner(self.program.graph, callables)
        return self.runner


class Runnable:
    """What ``Pipeline.run`` returns: call it like the traced graph.

    ``program``: the final Program; ``trace``: each stage's record; ``report()``: one row per
    (piece, variant) with piece, key, static, seconds, source.
    """

    def __init__(self, program: Program, trace: Sequence[PassRecord] = ()) -> None:
        self.program = program
        self.trace = tuple(trace)
        table: DispatchTable = program.dispatch
        self.table = table
        self._key = table.key_fn
        self._exact = table.exact
        self._resolve = table.resolve

    def __call__(self, *args: Any) -> Any:
        key = self._key(args)
        fn = self._exact.get(key)
        if fn is None:
            fn = self._resolve(key)
        return fn(*args)

    def report(self) -> Report:
        rows = [dict(v.report) for p in self.program.compute_pieces for v in p.variants]
        miss = getattr(self.table._miss_runner, "__wrapped__", self.table._miss_runner)
        if isinstance(miss, _GeneralVariant):
            rows += miss.rows
        return Report(rows)

    def __repr__(self) -> str:
        return f"<shapewise.Runnable {len(self.program.pieces)} pieces, {len(self.table)} dispatch entries>"
