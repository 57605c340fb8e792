"""Piecewise CUDA graphs: one graph per (compiled piece, captured size), splitting ops
(attention) run eagerly between them.

Per captured size, the first call runs each piece as compiled (a warm-up: lazy
initialisation stays out of the graph), the second captures it into a graph in one memory
pool shared by every piece and size and replays it, later calls only replay: every call does
its work once.
Inputs that come from outside the graphs are copied into static buffers allocated at the
largest captured size (a call copies into a prefix view): the caller's tensors once per call
(``StagedInputs``; every piece then reads them in place), a splitting op's output once per piece
that reads it. Parameters and the outputs of earlier captured pieces are used in place, as are
tensors marked with ``torch._dynamo.mark_static_address`` and any input that is the same tensor,
at the same address, on the warm-up and the capture call (a KV cache the model keeps, marked or
not: the graph reads and writes it there, no copy in or back); each replay checks those
addresses, and an input that moved makes its size capture again with that input copied in. A piece with a host tensor
input is not captured (a replay would skip its host work) and runs as compiled. Graph outputs
live in the pool and are overwritten by the next call, so the model's final outputs are cloned
before they are returned (``copy_outputs``), but inside ``borrowed_outputs()``.

``mode="full"`` captures one graph per size around the whole forward (splitting ops included);
``"full_and_piecewise"`` (vLLM's default) does that for the sizes up to ``full_up_to`` (decode)
and piecewise graphs above. ``capture="startup"`` captures every size when the model is compiled
(``capture.capture_now``: dummy inputs, a progress bar, the memory the graphs took reported) instead of
on the first two calls at each size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import sympy
import torch
import torch.fx

from shapewise import _compat
from shapewise._compat import evaluate_at
from shapewise.concretize import resolve_names
from shapewise.dispatch.copies import copy_out
from shapewise.dispatch.graphed import (
    GraphedPiece,
    GraphPool,
    SizeGraphs,
    StagedInputs,
    StaticBuffer,
    is_fixed,
)
from shapewise.dispatch.padding import padded_entries
from shapewise.dispatch.plan import GraphPlan, GraphSize, Layout
from shapewise.errors import ConfigError
from shapewise.ir.effects import inputs_aliased_by_outputs, mutated_inputs
from shapewise.ir.program import Binding, Piece, Program, TensorMeta
from shapewise.ir.runner import make_runner
from shapewise.passes.base import Pass, register_pass

__all__ = ["MODES", "CudaGraphs", "GraphRuntime", "GraphedPiece", "SizeGraphs", "StagedInputs", "build_graphs",
           "is_fixed"]

#: The capture modes: piecewise graphs, one full graph per size, or full up to a size and piecewise above.
MODES = ("piecewise", "full", "full_and_piecewise")

log = logging.getLogger("shapewise")


def _layout(meta: TensorMeta, values: Mapping[sympy.Symbol, int]) -> Layout:
    shape, stride, offset = meta.at(values)
    return tuple(shape), tuple(stride), offset


def buffer_layouts(metas: Sequence[Any], symbols: Sequence[sympy.Symbol], keys: Sequence[tuple[tuple, Binding]],
                   piece: Piece | None = None) -> list[dict[tuple, Layout] | None]:
    """Per input (None for what is not a CUDA tensor): its layout at each captured key. A
    variant of ``piece`` was compiled for the layout eager makes at its size, or a range
    compile makes over its range (see ``concretize.observed_inputs``), which may differ from
    the trace's: the static buffer takes the layout of the variant's example input at the key,
    so the graph replays what the variant was compiled for. Graph inputs (no ``piece``) keep
    the traced layout (the input guards hold them to it)."""
    out: list[dict[tuple, Layout] | None] = []
    for i, meta in enumerate(metas):
        if not (isinstance(meta, TensorMeta) and meta.device.type == "cuda"):
            out.append(None)
            continue
        layouts = {}
        for key, binding in keys:
            values = dict(zip(symbols, key))
            variant = piece.variant_for(binding) if piece is not None else None
            arg = variant.example_args[i] if variant is not None and i < len(variant.example_args) else None
            if isinstance(arg, torch.Tensor):
                layouts[key] = (tuple(evaluate_at(d, values) for d in arg.shape),
                                tuple(evaluate_at(d, values) for d in arg.stride()),
                                evaluate_at(arg.storage_offset(), values))
            else:
                layouts[key] = _layout(meta, values)
        out.append(layouts)
    return out


@register_pass
@dataclass(frozen=True)
class CudaGraphs(Pass):
    """Capture each compiled piece per size into a CUDA graph (GPU only).

    ``capture_sizes``: dispatch keys to capture (ints when there is one dynamic size, or
    dicts {name: size}); default: every compiled single size. Each must be a compiled size or
    lie inside a compiled range (that range's kernels are then captured at that size).
    ``copy_outputs``: clone the model's outputs out of the graph pool (default True).
    ``mode``: ``"piecewise"`` (default: one graph per compiled piece, splitting ops run eagerly
    between graphs), ``"full"`` (one graph per size around the whole forward, splitting ops
    included: the fewest launches, for splitting ops that are safe to capture, as vLLM's
    full-graph decode mode) or ``"full_and_piecewise"`` (full graphs for the sizes whose every
    dim is at most ``full_up_to``, piecewise above: vLLM's default, for splitting ops that are
    safe to capture at decode sizes only).
    ``capture``: ``"first_call"`` (default: a size is warmed up on its first call and captured on
    its second) or ``"startup"`` (``sw.compile`` captures every size when it compiles, on dummy
    inputs; see ``capture_now``).
    ``pad``: run every size up to the largest captured one padded (with zeros) to the next
    captured size and slice the outputs back; only for models whose rows are independent
    (each output row depends only on its input row and earlier ones, as causal attention).
    ``split_pools``: piecewise sizes run their splitting ops with allocations in a private pool
    per size, and the graph after each op reads its output where it is (default True;
    ``graphed.SizeGraphs``); False: the outputs are copied into static buffers on every call.
    """

    name: ClassVar[str] = "cudagraphs"
    capture_sizes: Any = None
    copy_outputs: bool = True
    mode: str = "piecewise"
    pad: bool = False
    full_up_to: int = 128
    capture: str = "first_call"
    split_pools: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"cudagraphs mode must be one of {MODES}, got {self.mode!r}")
        if self.capture not in ("first_call", "startup"):
            raise ConfigError(f"cudagraphs capture must be 'first_call' or 'startup', got {self.capture!r}")
        if isinstance(self.full_up_to, bool) or not isinstance(self.full_up_to, int) or self.full_up_to < 1:
            raise ConfigError(f"cudagraphs full_up_to must be a positive int (the largest size captured whole), "
                              f"got {self.full_up_to!r}")
        if not isinstance(self.split_pools, bool):
            raise ConfigError(f"cudagraphs split_pools must be True or False, got {self.split_pools!r}")
        if self.capture_sizes is not None and not isinstance(self.capture_sizes, tuple):
            sizes = self.capture_sizes
            object.__setattr__(self, "capture_sizes", tuple(sizes) if isinstance(sizes, (list, tuple)) else (sizes,))

    def requires(self, program: Program) -> Sequence[Pass | str]:
        if program.dispatch is None:
            return ["build_dispatch"]
        return ()

    def capture_keys(self, program: Program) -> list[tuple[tuple, Binding]]:
        """Resolve capture sizes to (key, binding that serves it), validating each."""
        shapes = program.shapes
        table = program.dispatch
        static = {b.key: b for b in program.bindings if b.is_static}
        ranges = [b for b in program.bindings if not b.is_static]
        if self.capture_sizes is None:
            return [(k, b) for k, b in static.items()]
        out = []
        for size in self.capture_sizes:
            if isinstance(size, Mapping):
                resolved = resolve_names(shapes, size, "capture_sizes")
                key = tuple(resolved.get(s, shapes.hints.get(s)) for s in shapes.symbols)
            elif isinstance(size, int) and not isinstance(size, bool):
                if len(shapes.symbols) != 1:
                    raise ConfigError(f"capture size {size}: the graph has {len(shapes.symbols)} dynamic sizes; "
                                      "give capture sizes as dicts {name: size}")
                key = (size,)
            else:
                raise ConfigError(f"capture sizes are ints or {{name: size}} dicts, got {size!r}")
            binding = static.get(key) or next(
                (b for b in ranges if all(lo <= v <= hi for v, (lo, hi) in zip(key, b.bounds()))), None)
            if binding is None:
                raise ConfigError(
                    f"capture size {table.describe_key(key)} is not compiled: capture sizes must be compiled sizes "
                    f"or lie inside a compiled range ({', '.join(r['key'] for r in table.rows())})"
                )
            out.append((key, binding))
        return sorted(out, key=lambda kb: kb[0], reverse=True)  # largest first into the shared pool

    def apply(self, program: Program) -> Program:
        if program.lowering is not None and program.lowering.deferred:
            raise ConfigError(
                f"CudaGraphs captures compiled pieces, but Lower(compile={program.lowering.compile!r}) compiles them "
                "later: use Lower(compile='eager_all') before CudaGraphs")
        if not torch.cuda.is_available():
            raise ConfigError("cudagraphs=True needs a CUDA GPU; none is available")
        keys = self.capture_keys(program)
        shapes = program.shapes
        sizes = tuple(GraphSize(k, b, self.is_full(k)) for k, b in keys)
        whole = [(s.key, s.binding) for s in sizes if s.whole]
        per_piece = [(s.key, s.binding) for s in sizes if not s.whole]
        layouts: dict[str, tuple] = {p.name: tuple(buffer_layouts(p.shapes.inputs, shapes.symbols, per_piece, p))
                                     for p in program.compute_pieces}
        layouts["forward"] = tuple(buffer_layouts(shapes.inputs, shapes.symbols, whole))
        layouts["staged"] = tuple(buffer_layouts(shapes.inputs, shapes.symbols, per_piece))
        device = next((m.device for m in shapes.inputs if isinstance(m, TensorMeta) and m.device.type == "cuda"),
                      None)
        in_place = split_fed_inputs(program) if self.split_pools and _compat.private_pools_available() else {}
        split_pools = device is not None and any(in_place.values())
        graphs = GraphPlan(sizes, layouts, in_place if split_pools else {}, frozenset(mutated_inputs(program.gm)),
                           split_pools, self.copy_outputs, self.pad, self.capture == "startup")
        if self.pad:
            padded_entries(program, dict.fromkeys(graphs.keys))  # refuses a model padding cannot serve, now
        return program.replace(dispatch=program.dispatch.replace(graphs=graphs))

    def is_full(self, key: tuple) -> bool:
        """Whether the size ``key`` gets one graph around the whole forward."""
        return self.mode == "full" or (self.mode == "full_and_piecewise" and max(key, default=0) <= self.full_up_to)


def split_fed_inputs(program: Program) -> dict[str, frozenset[int]]:
    """Per compute piece, the positions of its inputs that a splitting piece makes (what a
    piecewise graph may read in place, ``SizeGraphs``), but for inputs an output of the piece
    aliases (the graph's output would keep the splitting op's memory; all of them where an
    output's memory is not known)."""
    splitting = {p.name for p in program.pieces if p.is_splitting}
    pieces = {p.name: p for p in program.compute_pieces}
    out: dict[str, frozenset[int]] = {}
    for n in program.graph.graph.nodes:
        if n.op != "call_module" or n.target not in pieces:
            continue
        aliased = inputs_aliased_by_outputs(pieces[n.target].gm)
        if aliased is None:
            continue
        fed = set()
        for i, a in enumerate(n.args):
            if isinstance(a, torch.fx.Node) and i not in aliased:
                src = a.args[0] if a.op == "call_function" and isinstance(a.args[0], torch.fx.Node) else a
                if src.op == "call_module" and src.target in splitting:
                    fed.add(i)
        out[n.target] = frozenset(fed)
    return out


@dataclass
class GraphRuntime:
    """The live CUDA graphs of one Runnable, built from its ``GraphPlan``: the shared memory
    ``pool``; ``entries``, the dispatch entries of the captured sizes (padded sizes too);
    ``pieces``, every ``GraphedPiece`` (one per compute piece and piecewise size, one per
    whole-forward size); ``staged``, the ``StagedInputs`` of each piecewise size; ``callables``,
    per piecewise size, what its runner calls for each piece (its ``GraphedPiece``, or the
    splitting op routed through the size's private pool)."""

    pool: GraphPool
    entries: dict[tuple, Callable[..., Any]]
    pieces: list[GraphedPiece]
    staged: list[StagedInputs]
    callables: dict[tuple, dict[str, Callable[..., Any]]] = field(default_factory=dict)
    gates: list[UntilCompiled] = field(default_factory=list)


class UntilCompiled:
    """A captured size's entry while variants it runs are still compile workers', each run eagerly in
    its place (``Lower(wait_for_workers="never")``, ``EagerStandIn``): calls go uncaptured through
    ``plain`` till every one is in (a pending variant loads its artifact on its first call after its
    worker is done), then to ``graphed``, whose graphs warm up and capture on their next calls as any
    size's do; ``on_ready`` (set by the dispatch) then puts ``graphed`` in this entry's place."""

    def __init__(self, graphed: Callable[..., Any], plain: Callable[..., Any], pending: Sequence[Any]) -> None:
        self.graphed, self.plain, self.pending = graphed, plain, list(pending)
        self.on_ready: Callable[[], None] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.pending:
            self.pending = [p for p in self.pending if not p.ready]
            if self.pending:
                return self.plain(*args)
            if self.on_ready is not None:
                self.on_ready()
        return self.graphed(*args)


def build_graphs(program: Program, plan: GraphPlan) -> GraphRuntime:
    """The graphs ``plan`` describes, each captured on its size's first calls."""
    pool = GraphPool()
    shapes = program.shapes

    def buffers(name: str, metas: Sequence[Any]) -> list[StaticBuffer | None]:
        return [StaticBuffer(meta, layouts) if layouts is not None else None
                for meta, layouts in zip(metas, plan.layouts[name])]

    per_piece = {p.name: buffers(p.name, p.shapes.inputs) for p in program.compute_pieces}
    whole = buffers("forward", shapes.inputs) if any(s.whole for s in plan.sizes) else []
    staged_buffers = buffers("staged", shapes.inputs) if not all(s.whole for s in plan.sizes) else []
    device = next((m.device for m in shapes.inputs if isinstance(m, TensorMeta) and m.device.type == "cuda"), None)
    entries: dict[tuple, Callable[..., Any]] = {}
    pieces: list[GraphedPiece] = []
    staged: list[StagedInputs] = []
    per_size: dict[tuple, dict[str, Callable[..., Any]]] = {}
    gates: list[UntilCompiled] = []
    for size in plan.sizes:
        callables = program.callables(size.binding)
        eager = [c for c in callables.values() if getattr(c, "stand_in", None) is not None and not c.ready]
        if size.whole:
            run: Callable[..., Any] = GraphedPiece(make_runner(program.graph, callables), "forward", size.key, pool,
                                                   whole, layout_guarded=True)
            pieces.append(run)
        else:
            split_pool = (_compat.PrivatePool(device.index if device.index is not None else torch.cuda.current_device())
                          if plan.split_pools else None)
            group = SizeGraphs(size.key, pool, split_pool)
            for p in program.pieces:
                if p.is_splitting:
                    callables[p.name] = group.route(callables[p.name])
                else:
                    graphed = GraphedPiece(callables[p.name], p.name, size.key, pool, per_piece[p.name], group,
                                           plan.in_place.get(p.name, frozenset()))
                    callables[p.name] = graphed
                    pieces.append(graphed)
            run = StagedInputs(make_runner(program.graph, callables), size.key, pool, staged_buffers, plan.written,
                               group)
            staged.append(run)
            per_size[size.key] = callables
        if size.whole:
            run.copy_outputs = plan.copy_outputs
        entries[size.key] = copy_out(run) if plan.copy_outputs and not size.whole else run
        if eager:  # graphs only once no variant of the size runs eagerly in a worker's stead
            gates.append(UntilCompiled(entries[size.key], make_runner(program.graph, program.callables(size.binding)),
                                       eager))
            entries[size.key] = gates[-1]
    if plan.pad:
        entries.update(padded_entries(program, entries))
    return GraphRuntime(pool, entries, pieces, staged, per_size, gates)


