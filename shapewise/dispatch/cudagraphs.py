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
tensors marked with ``torch._dynamo.mark_static_address`` (a static KV cache, which the graph
writes in place). A piece with a host tensor input is not captured (a replay would skip its
host work) and runs as compiled. Graph outputs live in the pool and are overwritten by the
next call, so the model's final outputs are cloned before they are
returned (``copy_outputs``).

``mode="full"`` captures one graph per size around the whole forward (splitting ops included);
``"full_and_piecewise"`` (vLLM's default) does that for the sizes up to ``full_up_to`` (decode)
and piecewise graphs above. ``capture="startup"`` captures every size when the model is compiled
(``capture.capture_now``: dummy inputs, a progress bar, the memory the graphs took reported) instead of
on the first two calls at each size.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import sympy
import torch
import torch.fx

from shapewise import _compat
from shapewise._compat import evaluate_at
from shapewise.concretize import resolve_names
from shapewise.dispatch.padding import padded_entries
from shapewise.errors import ConfigError
from shapewise.ir.effects import mutated_inputs
from shapewise.ir.program import Binding, Piece, Program, TensorMeta
from shapewise.ir.runner import make_runner
from shapewise.passes.base import Pass, register_pass

__all__ = ["MODES", "CudaGraphs", "GraphedPiece", "StagedInputs", "graphed_pieces", "is_fixed", "staged_inputs"]

#: The capture modes: piecewise graphs, one full graph per size, or full up to a size and piecewise above.
MODES = ("piecewise", "full", "full_and_piecewise")

log = logging.getLogger("shapewise")


class _Pool:
    """The memory pool and the addresses of graph outputs, per captured size."""

    def __init__(self) -> None:
        self.handle = None
        self.static_ptrs: dict[tuple, set[int]] = {}
        self.lock = threading.Lock()

    def get(self):
        if self.handle is None:
            self.handle = torch.cuda.graph_pool_handle()
        return self.handle


class _Buffer:
    """One static input buffer of a piece, sized for the largest captured layout."""

    def __init__(self, meta: TensorMeta, layouts: Mapping[tuple, tuple[list[int], list[int], int]]) -> None:
        self.meta = meta
        self.layouts = dict(layouts)
        self.storage: torch.Tensor | None = None

    def view(self, key: tuple) -> torch.Tensor:
        if self.storage is None:
            length = max(_compat.storage_length(shape, stride, off) for shape, stride, off in self.layouts.values())
            self.storage = torch.empty(max(length, 1), dtype=self.meta.dtype, device=self.meta.device)
        shape, stride, off = self.layouts[key]
        return self.storage.as_strided(shape, stride, off)


class GraphedPiece:
    """A compiled piece at one size: warm-up, capture and replay on first call; replay after."""

    def __init__(self, fn: Callable[..., Any], name: str, key: tuple, pool: _Pool,
                 buffers: Sequence[_Buffer | None]) -> None:
        self.fn = fn
        self.name = name
        self.key = key
        self.pool = pool
        self.buffers = list(buffers)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self.copy_slots: list[tuple[int, torch.Tensor]] = []
        self.write_back: list[tuple[int, torch.Tensor]] = []  # copied inputs the graph writes in place
        self.fixed_slots: list[tuple[int, int]] = []
        self.mutated: set[int] = set()  # inputs the warm-up wrote in place (their version moved)
        self.warmed = False
        self.uncaptured: str | None = None  # why this piece runs without a graph (a host tensor input)
        self.fallbacks = 0

    def __call__(self, *args: Any) -> Any:
        graph = self.graph
        if graph is None:
            if self.uncaptured:
                return self.fn(*args)
            return self._capture(args) if self.warmed else self._warm_up(args)
        for i, ptr in self.fixed_slots:
            if args[i].data_ptr() != ptr:
                return self._fallback(args, i)
        for i, static in self.copy_slots:
            static.copy_(args[i])
        graph.replay()
        for i, static in self.write_back:
            args[i].copy_(static)
        return self.outputs

    def _fallback(self, args: tuple, i: int) -> Any:
        # A parameter (or an upstream output) moved since capture: the graph would read the
        # old memory. Run the compiled piece directly instead: right, just not graphed.
        if self.fallbacks == 0:
            log.warning("shapewise: %s at %s: input %d is not at its captured address; running it "
                        "without its CUDA graph", self.name, self.key, i)
        self.fallbacks += 1
        return self.fn(*args)

    def _warm_up(self, args: tuple) -> Any:
        """The first call at this size: run as compiled (lazy initialisation stays out of the
        graph), noting which inputs it writes in place. Capture waits for the next call, so
        every call does its work once (a graph that writes a KV cache would write it twice)."""
        self.warmed = True
        host = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_cuda]
        if host:
            # Work on host tensors is not recorded in a graph (a replay would skip it), and a copy
            # from pageable host memory cannot be captured: run this one as compiled, every call
            # (transformers' static cache counter lives on the host until its first update).
            self.uncaptured = f"input(s) {host} on the host"
            log.info("shapewise: %s at %s is not captured in a CUDA graph: %s", self.name, self.key, self.uncaptured)
            return self.fn(*args)
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        out = self.fn(*args)
        self.mutated = {i for i, (a, v) in enumerate(zip(args, versions)) if v is not None and a._version != v}
        return out

    def _capture(self, args: tuple) -> Any:
        with self.pool.lock:
            live = self.pool.static_ptrs.setdefault(self.key, set())
            static_args = list(args)
            fixed, copies, write_back = [], [], []  # committed only once the graph exists
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    continue
                # Parameters, outputs of an earlier graph, and tensors marked as living at one
                # address (a static KV cache, which the graph also writes) are used in place.
                if is_fixed(a) or a.data_ptr() in live:
                    fixed.append((i, a.data_ptr()))
                    continue
                buf = self.buffers[i]
                view = buf.view(self.key) if buf is not None else torch.empty_like(a)
                view.copy_(a)
                static_args[i] = view
                copies.append((i, view))
                if i in self.mutated:  # the graph writes the static copy: write it back to the caller's
                    write_back.append((i, view))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool.get()):
                outputs = self.fn(*static_args)
            for t in _tensors(outputs):
                live.add(t.data_ptr())
            self.fixed_slots, self.copy_slots, self.write_back = fixed, copies, write_back
            self.outputs = outputs
            self.graph = graph
        graph.replay()
        for i, static in self.write_back:
            args[i].copy_(static)
        return outputs


class StagedInputs:
    """Piecewise graphs at one size: the caller's tensors copied once per call into static
    buffers that every graph reads in place (a graph input several pieces read, such as the
    residual stream of the first layer, is not copied once per piece). Which inputs are staged
    is decided on the first call: the CUDA tensors that are not used at their own address
    (``is_fixed``) and that no piece writes in place (those keep the pieces' copy-in and
    write-back)."""

    def __init__(self, run: Callable[..., Any], key: tuple, pool: _Pool, buffers: Sequence[_Buffer | None],
                 written: frozenset[int]) -> None:
        self.run = run
        self.__wrapped__ = run
        self.key = key
        self.pool = pool
        self.buffers = list(buffers)
        self.written = written
        self.slots: list[tuple[int, torch.Tensor]] | None = None

    def __call__(self, *args: Any) -> Any:
        slots = self.slots
        if slots is None:
            slots = self._decide(args)
        if slots:
            args = list(args)
            for i, static in slots:
                static.copy_(args[i])
                args[i] = static
        return self.run(*args)

    def _decide(self, args: tuple) -> list[tuple[int, torch.Tensor]]:
        slots = []
        with self.pool.lock:
            live = self.pool.static_ptrs.setdefault(self.key, set())
            for i, a in enumerate(args):
                buf = self.buffers[i] if i < len(self.buffers) else None
                if buf is None or not isinstance(a, torch.Tensor) or not a.is_cuda or is_fixed(a) or i in self.written:
                    continue
                static = buf.view(self.key)
                live.add(static.data_ptr())  # the pieces read it in place, as an earlier graph's output
                slots.append((i, static))
        self.slots = slots
        return slots


def is_fixed(t: torch.Tensor) -> bool:
    """A tensor graphs use at its own address: a parameter, or one marked as living at one address
    (``torch._dynamo.mark_static_address``: a static KV cache)."""
    return isinstance(t, torch.nn.Parameter) or _compat.has_static_address(t)


def _tensors(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _tensors(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from _tensors(t)


def _clone_tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, tuple):
        return tuple(_clone_tensors(t) for t in tree)
    if isinstance(tree, list):
        return [_clone_tensors(t) for t in tree]
    if isinstance(tree, dict):
        return {k: _clone_tensors(v) for k, v in tree.items()}
    return tree


def _layout(meta: TensorMeta, values: Mapping[sympy.Symbol, int]) -> tuple[list[int], list[int], int]:
    shape, stride, offset = meta.at(values)
    return list(shape), list(stride), offset


Layout = tuple[list[int], list[int], int]


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
                layouts[key] = ([evaluate_at(d, values) for d in arg.shape],
                                [evaluate_at(d, values) for d in arg.stride()],
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
    """

    name: ClassVar[str] = "cudagraphs"
    capture_sizes: Any = None
    copy_outputs: bool = True
    mode: str = "piecewise"
    pad: bool = False
    full_up_to: int = 128
    capture: str = "first_call"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"cudagraphs mode must be one of {MODES}, got {self.mode!r}")
        if self.capture not in ("first_call", "startup"):
            raise ConfigError(f"cudagraphs capture must be 'first_call' or 'startup', got {self.capture!r}")
        if isinstance(self.full_up_to, bool) or not isinstance(self.full_up_to, int) or self.full_up_to < 1:
            raise ConfigError(f"cudagraphs full_up_to must be a positive int (the largest size captured whole), "
                              f"got {self.full_up_to!r}")
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
        if getattr(program.lowering, "deferred", False):
            raise ConfigError(
                f"CudaGraphs captures compiled pieces, but Lower(compile={program.lowering.compile!r}) compiles them "
                "later: use Lower(compile='eager_all') before CudaGraphs")
        if not torch.cuda.is_available():
            raise ConfigError("cudagraphs=True needs a CUDA GPU; none is available")
        keys = self.capture_keys(program)
        shapes = program.shapes
        pool = _Pool()

        def buffers_for(metas: Sequence[Any], piece: Piece | None = None) -> list[_Buffer | None]:
            return [_Buffer(meta, layouts) if layouts is not None else None
                    for meta, layouts in zip(metas, buffer_layouts(metas, shapes.symbols, keys, piece))]

        full = {key for key, _ in keys if self.is_full(key)}
        whole_keys = [(k, b) for k, b in keys if k in full]
        buffers = {p.name: buffers_for(p.shapes.inputs, p) for p in program.compute_pieces}
        whole_buffers = ([_Buffer(meta, layouts) if layouts is not None else None for meta, layouts in
                          zip(shapes.inputs, buffer_layouts(shapes.inputs, shapes.symbols, whole_keys))]
                         if full else [])
        pieces_keys = [(k, b) for k, b in keys if k not in full]
        staged_buffers = ([_Buffer(meta, layouts) if layouts is not None else None for meta, layouts in
                           zip(shapes.inputs, buffer_layouts(shapes.inputs, shapes.symbols, pieces_keys))]
                          if pieces_keys else [])
        written = frozenset(mutated_inputs(program.gm))
        overrides = {}
        for key, binding in keys:
            callables = program.callables(binding)
            if key not in full:
                for p in program.compute_pieces:
                    callables[p.name] = GraphedPiece(callables[p.name], p.name, key, pool, buffers[p.name])
            run = make_runner(program.graph, callables)
            if key in full:
                run = GraphedPiece(run, "forward", key, pool, whole_buffers)
            else:
                run = StagedInputs(run, key, pool, staged_buffers, written)
            overrides[key] = _copy_out(run) if self.copy_outputs else run
        if self.pad:
            overrides.update(padded_entries(program, overrides))
        table = program.dispatch.with_exact(overrides)
        return program.replace(dispatch=table, cudagraph_keys=tuple(k for k, _ in keys),
                               capture_at_startup=self.capture == "startup" and bool(keys))

    def is_full(self, key: tuple) -> bool:
        """Whether the size ``key`` gets one graph around the whole forward."""
        return self.mode == "full" or (self.mode == "full_and_piecewise" and max(key, default=0) <= self.full_up_to)


def _copy_out(run: Callable[..., Any]) -> Callable[..., Any]:
    def run_and_copy(*args: Any) -> Any:
        return _clone_tensors(run(*args))

    run_and_copy.__wrapped__ = run
    return run_and_copy


def graphed_pieces(program: Program) -> list[GraphedPiece]:
    """Every GraphedPiece reachable from the program's dispatch table (for tests and reports)."""
    out = []
    for fn in program.dispatch.exact.values():
        run = getattr(fn, "__wrapped__", fn)
        if isinstance(run, GraphedPiece):
            out.append(run)
            continue
        run = run.run if isinstance(run, StagedInputs) else run
        for value in getattr(run, "__globals__", {}).values():
            if isinstance(value, GraphedPiece):
                out.append(value)
    return out


def staged_inputs(program: Program) -> list[StagedInputs]:
    """Every StagedInputs (piecewise sizes' copy-in of the caller's tensors) in the dispatch table."""
    return [run for fn in program.dispatch.exact.values()
            if isinstance(run := getattr(fn, "__wrapped__", fn), StagedInputs)]
