"""The run-time objects of piecewise CUDA graphs (made by ``cudagraphs.CudaGraphs``): a
compiled piece at one size (``GraphedPiece``: warm-up, capture, replay), the caller's tensors
copied in once per call (``StagedInputs``), and the graphs of one size together
(``SizeGraphs``), whose splitting ops allocate in a private pool so that the next graph reads
their outputs where they are, with no copy (vLLM's attention-with-output without the out variant).
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shapewise import _compat
from shapewise.dispatch.copies import CopyIn, clone_tensors, outputs_borrowed
from shapewise.ir.program import TensorMeta
from shapewise.ir.runner import LAYOUTS_ATTR

__all__ = ["GraphPool", "GraphedPiece", "SizeGraphs", "StagedInputs", "StaticBuffer", "is_fixed", "tensors_of"]

log = logging.getLogger("shapewise")

# An input used in place that moves after this many replays of its graph is captured in place
# again (a cache made per generate() call, which may stop early at an end token); one that moves
# sooner (a tensor the caller alternates) is copied in from then on.
KEEP_AFTER = 2


class GraphPool:
    """The memory pool and the addresses of graph outputs, per captured size."""

    def __init__(self) -> None:
        self.handle = None
        self.static_ptrs: dict[tuple, set[int]] = {}
        self.lock = threading.Lock()
        # Graphs dropped to be captured again, kept until a capture replaces them: the allocator
        # frees a pool that no graph uses, and refuses a capture into it (an internal assert).
        self.retired: list[torch.cuda.CUDAGraph] = []

    def get(self):
        if self.handle is None:
            self.handle = torch.cuda.graph_pool_handle()
        return self.handle


class StaticBuffer:
    """One static input buffer of a piece, sized for the largest captured layout."""

    def __init__(self, meta: TensorMeta, layouts: Mapping[tuple, tuple[Sequence[int], Sequence[int], int]]) -> None:
        self.meta = meta
        self.layouts = dict(layouts)
        self.storage: torch.Tensor | None = None

    def view(self, key: tuple) -> torch.Tensor:
        if self.storage is None:
            length = max(_compat.storage_length(shape, stride, off) for shape, stride, off in self.layouts.values())
            self.storage = torch.empty(max(length, 1), dtype=self.meta.dtype, device=self.meta.device)
        shape, stride, off = self.layouts[key]
        return self.storage.as_strided(shape, stride, off)


class AddressCheck:
    """Whether the inputs a graph reads in place are where its capture found them: (input,
    address) or (input, address, strides) rows, checked per replay in one pass over C calls
    (``map`` of ``data_ptr``, ~40 ns a tensor, not a Python loop's ~130: a 1B model's graph reads
    ~150 parameters in place). ``moved(args)``: the first input that is not, or None."""

    def __init__(self, rows: Sequence[tuple]) -> None:
        self.rows = list(rows)
        idx = [r[0] for r in self.rows]
        get = operator.itemgetter(*idx)
        self._get = get if len(idx) > 1 else (lambda args: (get(args),))
        self._ptrs = tuple(r[1] for r in self.rows)
        self._strides = tuple(r[2] for r in self.rows) if len(self.rows[0]) > 2 else None

    def moved(self, args: tuple) -> int | None:
        tensors = self._get(args)
        if tuple(map(_DATA_PTR, tensors)) == self._ptrs and (
                self._strides is None or tuple(map(_STRIDE, tensors)) == self._strides):
            return None
        for r, a in zip(self.rows, tensors):
            if a.data_ptr() != r[1] or (self._strides is not None and a.stride() != r[2]):
                return r[0]
        return None


_DATA_PTR, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.stride


class InnerAddressCheck:
    """Whether the tensor-subclass inputs a graph reads in place (DTensor weights) hold their inner
    tensors where the capture found them: ``(input, inner attribute names, their addresses)`` rows.
    Rows whose inner tensors were plain tensors at capture are checked per replay in one pass of C
    calls per set of names (``map`` of ``attrgetter`` then of ``data_ptr``: a 1B model's ~150 DTensor
    weights in ~10 µs, not a Python loop's ~40); the others (nested subclasses), and any failure of
    the fast pass, one by one as ``address`` says. ``moved(args)``: the first input that is not where
    it was, or None."""

    def __init__(self, rows: Sequence[tuple[int, tuple[str, ...], tuple]]) -> None:
        self.rows = list(rows)
        groups: dict[tuple[str, ...], list[tuple[int, tuple]]] = {}
        self._nested = []
        for i, names, ptrs in self.rows:
            if all(type(p) is int for p in ptrs):
                groups.setdefault(names, []).append((i, ptrs))
            else:
                self._nested.append((i, names, ptrs))
        self._groups = []
        for names, members in groups.items():
            get = operator.itemgetter(*(i for i, _ in members))
            self._groups.append((get if len(members) > 1 else (lambda args, get=get: (get(args),)),
                                 operator.attrgetter(*names), len(names) > 1,
                                 tuple(p for _, ptrs in members for p in ptrs)))

    def moved(self, args: tuple) -> int | None:
        try:
            for get, inner, several, want in self._groups:
                got = map(inner, get(args))
                if tuple(map(_DATA_PTR, itertools.chain.from_iterable(got) if several else got)) != want:
                    return self._first_moved(args)
            if any(_inner_addresses(args[i], names) != ptrs for i, names, ptrs in self._nested):
                return self._first_moved(args)
        except Exception:  # noqa: BLE001 - an inner tensor without storage, or no subclass, now: row by row
            return self._first_moved(args)
        return None

    def _first_moved(self, args: tuple) -> int | None:
        for i, names, ptrs in self.rows:
            try:
                if _inner_addresses(args[i], names) != ptrs:
                    return i
            except Exception:  # noqa: BLE001 - not a subclass with those tensors any more: moved
                return i
        return None


def _inner_addresses(t: Any, names: tuple[str, ...]) -> tuple:
    """The addresses of ``t``'s inner tensors ``names`` (each by ``address``)."""
    return tuple(address(getattr(t, name)) for name in names)


class GraphedPiece:
    """A compiled piece at one size: warm-up, capture and replay on first call; replay after."""

    def __init__(self, fn: Callable[..., Any], name: str, key: tuple, pool: GraphPool,
                 buffers: Sequence[StaticBuffer | None], group: SizeGraphs | None = None,
                 adoptable: frozenset[int] = frozenset(), layout_guarded: bool = False) -> None:
        self.fn = fn
        self.name = name
        self.key = key
        self.pool = pool
        self.buffers = list(buffers)
        self.group = group
        self.adoptable = adoptable  # inputs a splitting op of the group makes: read where they are
        # Its inputs are the program's own (a whole-forward graph), whose layouts Dynamo's guards (or
        # a direct call's checks) fix at each size: a kept input's strides need no check per replay
        # (Inductor's CUDA graph trees check only static inputs' addresses too), and its address is
        # checked in the parameters' pass.
        self.layout_guarded = layout_guarded
        # Its outputs cloned out of the pool (but inside ``borrowed_outputs()``): a whole-forward
        # graph's own ``copy_out``, one Python call of all the inputs less per replay.
        self.copy_outputs = False
        if group is not None:
            group.pieces.append(self)
        layouts = getattr(fn, LAYOUTS_ATTR, None)
        if layouts is not None:  # the runner checks (and fixes) what a splitting op hands this piece
            setattr(self, LAYOUTS_ATTR, layouts)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self.copy_slots: list[tuple[int, torch.Tensor]] = []
        self.write_back: list[tuple[int, torch.Tensor]] = []  # copied inputs the graph writes in place
        self.fixed_slots: list[tuple[int, int]] = []  # (input, data pointer) used in place
        # Subclass inputs (DTensor weights): (input, its inner tensors' attributes, their addresses).
        self.fixed_inner: list[tuple[int, tuple[str, ...], tuple]] = []
        self.adopted: list[tuple[int, int, tuple[int, ...]]] = []  # (input, address, strides) read in place
        # Inputs that were the same tensor, at the same address, on the warm-up and capture calls (a
        # KV cache the model keeps, a persistent buffer), marked or not: (input, address, strides).
        self.kept: list[tuple[int, int, tuple[int, ...]]] = []
        self._copy_in: CopyIn | None = None  # copy_slots, in one launch
        self._fixed_check: AddressCheck | None = None  # fixed_slots (and kept, layout_guarded), in one pass
        self._inner_check: InnerAddressCheck | None = None  # fixed_inner, in one pass per set of names
        self._kept_check: AddressCheck | None = None  # kept, with strides (not layout_guarded)
        self._kept_at: frozenset[int] = frozenset()  # the kept inputs
        self.warm_at: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}  # the warm-up's tensors (_seen)
        self.moved_inputs: set[int] = set()  # inputs that moved soon after a capture: copied in from then on
        self.replays = 0  # since the last capture
        self.mutated: set[int] = set()  # inputs the warm-up wrote in place (their version moved)
        self.warmed = False
        self.uncaptured: str | None = None  # why this piece runs without a graph (a host tensor input)
        self.fallbacks = 0
        self.recaptures = 0  # captures again after an input used in place moved

    def __call__(self, *args: Any) -> Any:
        graph = self.graph
        if graph is None:
            if self.uncaptured:
                return self.fn(*args)
            if self.group is not None and self.group.resetting:  # the rest of a call that captures again
                self.warm_at = _seen(args)
                return self.fn(*args)
            return self._capture(args) if self.warmed else self._warm_up(args)
        if self._fixed_check is not None and (i := self._fixed_check.moved(args)) is not None:
            return self._kept_moved(args, i) if i in self._kept_at else self._fallback(args, i)
        if self._inner_check is not None and (i := self._inner_check.moved(args)) is not None:
            return self._fallback(args, i)  # (by attribute: __tensor_flatten__ per call costs ~1.4 µs)
        for i, ptr, stride in self.adopted:
            a = args[i]
            if a.data_ptr() != ptr or a.stride() != stride:
                self.group.moved(self, i)  # this size is captured again, copying it in
                return self.fn(*args)
        if self._kept_check is not None and (i := self._kept_check.moved(args)) is not None:
            return self._kept_moved(args, i)
        if self._copy_in is not None:
            self._copy_in(args)
        self.replays += 1
        graph.replay()
        for i, static in self.write_back:
            args[i].copy_(static)
        return clone_tensors(self.outputs) if self.copy_outputs and not outputs_borrowed() else self.outputs

    def _fallback(self, args: tuple, i: int) -> Any:
        # A parameter (or an upstream output) moved since capture: the graph would read the
        # old memory. Run the compiled piece directly instead: right, just not graphed.
        if self.fallbacks == 0:
            log.warning("shapewise: %s at %s: input %d is not at its captured address; running it "
                        "without its CUDA graph", self.name, self.key, i)
        self.fallbacks += 1
        return self.fn(*args)

    def _kept_moved(self, args: tuple, i: int) -> Any:
        """An input used in place is elsewhere this call. Its owner made it anew (transformers
        makes a new static cache per ``generate()``): the next call captures again, reading this
        call's tensor in place if it is still there. One that moved within ``KEEP_AFTER`` replays
        of its capture comes fresh each call after all: copied in from then on."""
        copied = self.replays < KEEP_AFTER
        (log.warning if copied else log.info)(
            "shapewise: %s at %s: input %d is not where the capture found it (after %d replays); capturing this "
            "size again on the next call%s", self.name, self.key, i, self.replays,
            ", with that input copied in" if copied else "")
        if copied:
            self.moved_inputs.add(i)
        if self.group is not None:
            self.group.recapture(self, i)
        else:
            torch.cuda.synchronize()  # no replay in flight while the graph goes
            with self.pool.lock:
                self.reset(self.pool.static_ptrs.setdefault(self.key, set()))
        self.recaptures += 1
        self.warm_at = _seen(args)
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
        subclass = [i for i, a in enumerate(args) if _compat.is_traceable_wrapper_subclass(a) and not is_fixed(a)]
        if subclass and not host:
            # A DTensor that is not a weight (an activation): static buffers are plain tensors.
            self.uncaptured = f"tensor-subclass input(s) {subclass} that are not parameters"
        if self.uncaptured:
            log.info("shapewise: %s at %s is not captured in a CUDA graph: %s", self.name, self.key, self.uncaptured)
            return self.fn(*args)
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        self.warm_at = _seen(args)
        out = self.fn(*args)
        self.mutated = {i for i, (a, v) in enumerate(zip(args, versions)) if v is not None and a._version != v}
        return out

    def _capture(self, args: tuple) -> Any:
        with self.pool.lock:
            live = self.pool.static_ptrs.setdefault(self.key, set())
            static_args = list(args)
            fixed, inner, copies, write_back, adopted, kept = [], [], [], [], [], []  # committed with the graph
            adopt = self.group is not None and self.group.adopt
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    continue
                # Parameters, outputs of an earlier graph, and tensors marked as living at one
                # address (a static KV cache, which the graph also writes) are used in place.
                at = address(a)
                if is_fixed(a) or at in live:
                    if _compat.is_traceable_wrapper_subclass(a):
                        names = tuple(n for n, x in _compat.subclass_inner(a) if isinstance(x, torch.Tensor))
                        inner.append((i, names, at))
                    else:
                        fixed.append((i, at))
                    continue
                if adopt and i in self.adoptable and i not in self.mutated:  # (never a subclass: see _warm_up)
                    adopted.append((i, a.data_ptr(), a.stride()))  # where the splitting op put it
                    continue
                if i not in self.moved_inputs and _same_tensor(self.warm_at.get(i), a):
                    kept.append((i, at, a.stride()))  # the warm-up's tensor, where it was: read and written there
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
            for t in tensors_of(outputs):
                live.add(address(t))
            self.fixed_slots, self.fixed_inner, self.copy_slots = fixed, inner, copies
            self.write_back, self.adopted, self.kept = write_back, adopted, kept
            self._copy_in = CopyIn(copies) if copies else None
            checked = fixed + [(i, at) for i, at, _ in kept] if self.layout_guarded else fixed
            self._fixed_check = AddressCheck(checked) if checked else None
            self._inner_check = InnerAddressCheck(inner) if inner else None
            self._kept_check = AddressCheck(kept) if kept and not self.layout_guarded else None
            self._kept_at = frozenset(i for i, *_ in kept)
            self.outputs = outputs
            self.graph, self.replays = graph, 0
            self.pool.retired.clear()
        graph.replay()
        for i, static in self.write_back:
            args[i].copy_(static)
        return clone_tensors(outputs) if self.copy_outputs and not outputs_borrowed() else outputs

    def reset(self, live: set[int]) -> None:
        """Drop the graph; the piece captures again on its next call (``SizeGraphs.moved``)."""
        for t in tensors_of(self.outputs):
            live.discard(address(t))
        if self.graph is not None:
            self.pool.retired.append(self.graph)
        self.graph, self.outputs = None, None
        self.fixed_slots, self.fixed_inner, self.copy_slots, self.write_back, self.adopted = [], [], [], [], []
        self.kept, self._kept_at = [], frozenset()
        self._fixed_check = self._kept_check = self._inner_check = self._copy_in = None


class SizeGraphs:
    """The piecewise graphs of one captured size. Its splitting ops allocate in a private pool
    (``split_pool``: one per size, only they allocate from it, and their outputs are freed before
    the next call), so each call puts their outputs where the capture found them, and the next
    graph reads them in place: no copy into a static buffer per call. A graph checks the address
    and strides before each replay; if one moved (the pool emptied, an output kept past the
    call, an output the runner had to lay out again), the rest of that call runs uncaptured
    (``resetting``, cleared when the next call starts) and the next call captures every piece of
    the size again, in order, with copies (``adopt`` off): slower, never wrong. Graphs that share a
    pool must replay in the order they were captured; capturing all of them in one call keeps it."""

    def __init__(self, key: tuple, pool: GraphPool, split_pool: _compat.PrivatePool | None) -> None:
        self.key = key
        self.pool = pool
        self.split_pool = split_pool
        self.adopt = split_pool is not None
        self.pieces: list[GraphedPiece] = []
        self.recaptures = 0
        self.resetting = False

    def route(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A splitting op's call, allocating in the private pool while outputs are adopted."""
        return fn if self.split_pool is None else self.split_pool.route(fn, lambda: self.adopt)

    def moved(self, piece: GraphedPiece, i: int) -> None:
        log.warning("shapewise: %s at %s: input %d (a splitting op's output) is not where the capture found "
                    "it; capturing this size again on the next call, with the splitting ops' outputs copied in",
                    piece.name, self.key, i)
        self.adopt = False
        self.recapture(piece, i)

    def recapture(self, piece: GraphedPiece, i: int) -> None:
        """Drop every graph of the size: the rest of this call runs uncaptured, the next call
        captures them again in order (graphs that share a pool replay in capture order)."""
        torch.cuda.synchronize()  # no replay in flight while the graphs go
        with self.pool.lock:
            self.resetting = True
            self.recaptures += 1
            live = self.pool.static_ptrs.setdefault(self.key, set())
            for p in self.pieces:
                p.reset(live)


class StagedInputs:
    """Piecewise graphs at one size: the caller's tensors copied once per call into static
    buffers that every graph reads in place (a graph input several pieces read, such as the
    residual stream of the first layer, is not copied once per piece). Which inputs are staged
    is decided on the second call (the one that captures): the CUDA tensors that are not used at
    their own address (``is_fixed``), that are not the first call's tensor again at its address (a
    KV cache or a persistent buffer the caller keeps is read where it is, as ``GraphedPiece`` reads
    it) and that no piece writes in place (those keep the pieces' own copy-in and write-back)."""

    def __init__(self, run: Callable[..., Any], key: tuple, pool: GraphPool, buffers: Sequence[StaticBuffer | None],
                 written: frozenset[int], group: SizeGraphs | None = None) -> None:
        self.run = run
        self.group = group  # its calls start here: the end of a call that captures the size again
        self.key = key
        self.pool = pool
        self.buffers = list(buffers)
        self.written = written
        self.slots: list[tuple[int, torch.Tensor]] | None = None
        self._copy_in: CopyIn | None = None  # the slots, in one launch
        self.first_at: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] | None = None  # the first call's (_seen)

    def __call__(self, *args: Any) -> Any:
        group = self.group
        if group is not None and group.resetting:
            group.resetting = False  # a new call: the size captures again, piece by piece in order
        slots = self.slots
        if slots is None:
            if self.first_at is None:  # the pieces' warm-up: note the caller's tensors
                self.first_at = _seen(args)
                return self.run(*args)
            slots = self._decide(args)
        if slots:
            self._copy_in(args)
            args = list(args)
            for i, static in slots:
                args[i] = static
        return self.run(*args)

    def _decide(self, args: tuple) -> list[tuple[int, torch.Tensor]]:
        slots = []
        with self.pool.lock:
            live = self.pool.static_ptrs.setdefault(self.key, set())
            for i, a in enumerate(args):
                buf = self.buffers[i] if i < len(self.buffers) else None
                if buf is None or not isinstance(a, torch.Tensor) or not a.is_cuda or is_fixed(a) or i in self.written \
                        or _compat.is_traceable_wrapper_subclass(a) or _same_tensor(self.first_at.get(i), a):
                    continue
                static = buf.view(self.key)
                live.add(static.data_ptr())  # the pieces read it in place, as an earlier graph's output
                slots.append((i, static))
        self.slots, self._copy_in = slots, CopyIn(slots)
        return slots


def _seen(args: tuple) -> dict[int, tuple[weakref.ref, int, tuple[int, ...]]]:
    """Per plain tensor argument: the tensor (weakly), its address and strides. The tensor itself,
    not only its address: a fresh input often lands where the last one was freed, and only a
    tensor the caller keeps is worth reading in place."""
    return {i: (weakref.ref(a), a.data_ptr(), a.stride()) for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and not _compat.is_traceable_wrapper_subclass(a)}


def _same_tensor(was: tuple[weakref.ref, int, tuple[int, ...]] | None, a: torch.Tensor) -> bool:
    """Whether ``a`` is the tensor ``_seen`` noted, still at its address and strides."""
    return was is not None and was[0]() is a and was[1:] == (a.data_ptr(), a.stride())


def address(t: torch.Tensor) -> int | tuple:
    """Where ``t``'s data is: its data pointer; for a tensor subclass (a DTensor, whose own
    pointer is 0), its inner tensors' addresses."""
    if _compat.is_traceable_wrapper_subclass(t):
        return tuple(address(x) for _, x in _compat.subclass_inner(t) if isinstance(x, torch.Tensor))
    return t.data_ptr()


def is_fixed(t: torch.Tensor) -> bool:
    """A tensor graphs use at its own address: a parameter, or one marked as living at one address
    (``torch._dynamo.mark_static_address``: a static KV cache)."""
    return isinstance(t, torch.nn.Parameter) or _compat.has_static_address(t)


def tensors_of(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from tensors_of(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from tensors_of(t)
