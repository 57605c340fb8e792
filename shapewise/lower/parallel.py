"""A compile session's use of the worker processes (``shapewise.lower.workers``): which variants go to
them (``start_workers``), and the variants they compile that the session does not wait for
(``PendingVariant``: loaded on their first call).

With ``compile_workers`` > 1 a trace's compile (``CompileSession.compile_all``) hands the distinct
static Inductor compiles to workers, except the size the model was traced at (``is_now``): the call
that is waiting needs that one, and the session compiles it (and what no worker can do: ranges,
Inductor passes, graphs that read values) while the workers compile the rest. Where the traced size
has several distinct pieces (a graph split at attention: the first layer's, the middle layers' one,
the last), the session compiles the largest (in nodes) and the others go to the workers first of all,
so that the waiting call costs about its slowest piece, not their sum (an H100, the 1B's prompt trace
split at SDPA: 6.24 + 1.74 + 0.97 s one after another in the session, 2026-12-07). The trace then returns
at once, its workers' variants pending; each is loaded on its first call (``PendingVariant``: from
the cache where a worker wrote it, waiting on the key's lock where one is compiling it, compiled in
the call where none has started), or all of them by ``ShapewiseModule.wait()``. The first call of a
model so runs as soon as its own size is compiled, not once every size is.
``Lower(wait_for_workers=True)`` waits for every variant in the trace's compile instead (as before
2026-12-06: the session took the workers' variants from the far end of their queue); so do
``on_compile_error="fallback"`` (the runner, built now, would skip the layout checks an eager
fallback's outputs need) and start-up CUDA-graph capture (it runs every size on the first call).
``Lower(wait_for_workers="never")`` keeps nothing here: the traced size's variants go to the workers
too, and every pending variant's calls run an ``EagerStandIn`` (its graph, eagerly) until its worker is
done (``PendingVariant.arrived``); a captured size waits behind ``cudagraphs.UntilCompiled``. On an H100,
the 1B's first ``generate()`` at 0.38 of the serial cold start, every variant at 0.59 (2026-12-08).
A trace's own sizes are queued ahead of what an earlier trace left to the workers (``submit(first=)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

from shapewise import _compat
from shapewise.errors import ShapewiseError
from shapewise.ir.program import Binding, Piece, Variant
from shapewise.ir.runner import LAYOUTS_ATTR
from shapewise.lower.workers import WorkerPool, task_bytes

__all__ = ["EagerStandIn", "PendingVariant", "eager_refused", "is_now", "output_layouts", "pending_variant",
           "start_workers"]

log = logging.getLogger("shapewise")


def is_now(binding: Binding, now: Mapping[sympy.Symbol, int] | None) -> bool:
    """Whether ``binding`` is a static one at exactly the traced sizes ``now`` (a trace with no
    dynamic sizes left, ``now`` empty: its one binding)."""
    return now is not None and binding.is_static and all(now.get(s) == v for s, v in binding.items)


def start_workers(session: Any, pieces: Sequence[Piece], order: list[tuple[int, int]], most: int,
                  now: Mapping[sympy.Symbol, int] | None = None,
                  keep_now: bool = True) -> tuple[list[tuple[int, int]], dict]:
    """Hand the distinct keys that need a static Inductor compile, but not the one the session keeps at
    the traced sizes ``now`` (``_kept_here``; none with ``keep_now`` False), to at most ``most`` worker
    processes (``session.workers``); those at ``now`` are queued first, before any task of an earlier
    trace that no worker has started. Returns (the order the session takes the variants in,
    {(piece, variant) position: key} of those sent). The order: what no worker was given first, then
    the workers' from the far end of their queue (where the session waits for them). With ``now``
    (None: not a trace's compile) one task is worth a worker (the session compiles the traced size
    meanwhile, or with ``keep_now`` False, runs it eagerly)."""
    if session.cache is None or session.lower.backend != "inductor":
        return order, {}
    keys = _worker_keys(session, pieces, order)
    mine = _kept_here(pieces, order, keys, now) if keep_now else set()
    tasks: dict[str, bytes] = {}
    first: set[str] = set()
    sent: dict[tuple[int, int], str] = {}
    for i, j in sorted(order, key=lambda ij: not is_now(pieces[ij[0]].variants[ij[1]].binding, now)):
        key = keys.get((i, j))
        if key is None or (i, j) in mine:
            continue
        if is_now(pieces[i].variants[j].binding, now):
            first.add(key)
        if key not in tasks:
            piece, variant = pieces[i].as_compiled_for(pieces[i].variants[j]), pieces[i].variants[j]
            names = piece.shapes.names if piece.shapes else {}
            data = task_bytes(key, piece.gm, variant.example_args, session.options(piece, variant),
                              {"piece": piece.name, "binding": variant.binding.describe(names),
                               "backend": session.backend_id, "rank": session.rank, "worker": True})
            if data is None:
                continue
            tasks[key] = data
        sent[i, j] = key
    workers = min(most, len(tasks))
    if workers < (1 if now is not None else 2):
        return order, {}
    session.workers = WorkerPool(workers, str(session.cache.root))
    for key, data in tasks.items():
        session.workers.submit(key, data, first=key in first)
    log.info("shapewise: %d compiles handed to %d worker processes", len(tasks), workers)
    queue_place = {k: n for n, k in enumerate(tasks)}
    return [ij for ij in order if ij not in sent] + sorted((ij for ij in order if ij in sent),
                                                            key=lambda ij: -queue_place[sent[ij]]), sent


def _worker_keys(session: Any, pieces: Sequence[Piece], order: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """{(piece, variant) position: its cache key} for the variants a worker could compile: static, with no
    Inductor passes, not reading values, keyed on disk, neither compiled in this process (dedupe) nor on
    disk already."""
    from shapewise.lower.compile import reads_values

    out = {}
    for i, j in order:
        piece, variant = pieces[i].as_compiled_for(pieces[i].variants[j]), pieces[i].variants[j]
        if not variant.binding.is_static or variant.inductor_passes or reads_values(piece.gm):
            continue
        key, disk = session.variant_key(piece, variant)
        if key is not None and disk and not (session.lower.dedupe and key in session._memo) \
                and not session.cache.path(key).exists():
            out[i, j] = key
    return out


def _kept_here(pieces: Sequence[Piece], order: list[tuple[int, int]], keys: Mapping[tuple[int, int], str],
               now: Mapping[sympy.Symbol, int] | None) -> set[tuple[int, int]]:
    """The variants at the traced sizes ``now`` the session compiles itself: all of them, but where
    several distinct keys a worker could take (``keys``) are at those sizes, only the largest piece's
    (its graph's node count standing for its compile time); the others go to the workers first."""
    at_now = [(i, j) for i, j in order if is_now(pieces[i].variants[j].binding, now)]
    by_key: dict[str, list[tuple[int, int]]] = {}
    for ij in at_now:
        if ij in keys:
            by_key.setdefault(keys[ij], []).append(ij)
    if len(by_key) < 2:
        return set(at_now)
    largest = max(by_key.values(), key=lambda ijs: len(pieces[ijs[0][0]].gm.graph.nodes))
    return set(at_now) - {ij for ijs in by_key.values() if ijs is not largest for ij in ijs}


def eager_refused(session: Any, workers: int) -> str | None:
    """Why ``wait_for_workers="never"`` cannot leave this compile's variants to workers (None: it can)."""
    lower = session.lower
    if lower.on_compile_error == "fallback":
        return "on_compile_error='fallback' compiles every variant before the call"
    if workers <= 1:
        return f"compile_workers={lower.compile_workers!r} gives no worker process here"
    if session.cache is None or lower.backend != "inductor":
        return "workers hand artifacts back through the disk cache, for Inductor only (cache or backend off)"
    return None


def pending_variant(session: Any, piece: Piece, variant: Variant, key: str, pool: WorkerPool, config: Any,
                    eager: bool) -> Variant:
    """``variant`` left to a worker: a ``PendingVariant`` that loads it on its first call (``eager``: on
    the first once the worker is done, run eagerly before), its report row "pending" till then."""
    report = {**session.lower._pending_row(piece, variant), "artifact": key[:12]}
    with session._lock:
        session.counts["pending"] += 1
    compiled = PendingVariant(session, piece, variant, pool, report, config, key, eager)
    return dataclasses.replace(variant, compiled=compiled, report=report, artifact_key=(key, True))


class PendingVariant:
    """A variant a worker process compiles, as the dispatch table calls it: its first call (or
    ``resolve()``) gets the artifact through the session (``CompileSession.compile``: loaded from the
    cache, waited for, or compiled here), under the state of the trace's compile that its key or its
    compile depend on (grad mode, autocast, Inductor's config, the current CUDA device), then calls it; later
    calls go straight to it. A failed compile's error is raised again by every later call, not
    compiled again. ``report`` is the variant's report row, updated in place. Carries the layouts the
    runner checks (``LAYOUTS_ATTR``) from the start. ``unresolved``: how many are pending in the
    process (while any is, a compile may run in a call: ``ShapewiseModule`` lets other threads' calls
    pass Dynamo meanwhile, as for lazy compiles)."""

    unresolved = 0
    _count_lock = threading.Lock()

    def __init__(self, session: Any, piece: Piece, variant: Variant, workers: WorkerPool | None,
                 report: dict[str, Any], config: Any, key: str | None = None, eager: bool = False) -> None:
        self._args: tuple | None = (session, piece, variant, workers)
        self._key = key
        # Lower(wait_for_workers="never"): calls before the worker's artifact is in run the graph eagerly
        self.stand_in = EagerStandIn(piece.as_compiled_for(variant), variant) if eager else None
        self._state = _compat.compile_state()
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._config = config
        self._fn: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.report = report
        setattr(self, LAYOUTS_ATTR, session.layouts(piece, variant))
        with PendingVariant._count_lock:
            PendingVariant.unresolved += 1

    @property
    def ready(self) -> bool:
        return self._fn is not None

    def arrived(self) -> bool:
        """Whether loading would not wait for the worker: its compile is over (compiled, or failed or
        dropped: then compiled in the call), it was never sent, or no worker is left to take it."""
        args = self._args
        if args is None or args[3] is None:
            return True
        future = args[3].futures.get(self._key)
        return future is None or future.done() or not any(t.is_alive() for t in args[3].processes.threads)

    def resolve(self) -> Any:
        """The variant's callable, got once (thread-safe)."""
        if self._fn is None:
            with self._lock:
                if self._error is not None:
                    raise self._error
                if self._fn is None:
                    self._fn = self._get()
        return self._fn

    def _get(self) -> Any:
        session, piece, variant, workers = self._args
        device = torch.cuda.device(self._device) if self._device is not None else contextlib.nullcontext()
        try:
            with _compat.compile_state_as(self._state), self._config(), device:
                done = session.compile(piece, variant, workers=workers)
        except BaseException as e:
            self._error = e
            raise
        finally:  # resolved either way: the session and pool are no longer needed
            self._args = None
            with PendingVariant._count_lock:
                PendingVariant.unresolved -= 1
        self.report.update(done.report)
        return done.compiled

    @property
    def __wrapped__(self) -> Any:  # what Inductor generated, for the printer and the source views
        return self.resolve()

    def __call__(self, *args: Any) -> Any:
        fn = self._fn
        if fn is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # (eager's kernels too)
                raise ShapewiseError(
                    f"{self.report.get('piece')} at {self.report.get('key')} is still a compile worker's (not loaded "
                    "yet), and a CUDA graph is being captured: loading it inside the capture would break it. Call "
                    "the compiled model's wait() (it loads every such variant) before capturing")
            if self.stand_in is not None and not self.arrived():
                return self.stand_in(*args)
            fn = self.resolve()
        return fn(*args)

    def __repr__(self) -> str:
        return f"<shapewise.PendingVariant {self.report.get('piece')} {self.report.get('key')} " \
               f"{'ready' if self.ready else 'failed' if self._error is not None else 'pending'}>"


class EagerStandIn:
    """A pending variant's graph run eagerly (its forward, not compiled) while a worker compiles it
    (``Lower(wait_for_workers="never")``): the same answers, at eager's speed. Its outputs are laid
    out as the compiled variant's will be, which later pieces were compiled for: eager's own layout
    wherever it matches the graph's traced one at the variant's sizes (one comparison a call). Where
    they differ, the graph is run once on fake inputs laid out as the variant's example inputs (what
    Inductor compiles from: its outputs keep those layouts), and an output eager lays out otherwise
    than that is copied into it, with a warning. ``calls``: how many calls it served; ``relaid``: the
    outputs it copied."""

    def __init__(self, piece: Piece, variant: Variant) -> None:
        self.gm = piece.gm
        self.example_args = variant.example_args
        self.name = f"{piece.name} at {variant.binding}"
        self.want = output_layouts(piece.gm, variant.binding.static_values() if variant.binding.is_static else {})
        self.checked = False  # self.want is the compiled variant's layouts (fake propagation), not the trace's
        self.calls = 0
        self.relaid = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        out = self.gm.forward(*args)
        if not self.want or not isinstance(out, (tuple, list)) or len(out) != len(self.want):
            return out
        if not self.checked and any(_differs(t, want) for t, want in zip(out, self.want)):
            self.want, self.checked = self._compiled_layouts(), True
        if not self.checked:
            return out
        fixed = list(out)
        for i, (t, want) in enumerate(zip(out, self.want)):
            if _differs(t, want):
                if not self.relaid:
                    log.warning("shapewise: %s: eager laid out output %d with strides %s, the compiled variant with "
                                "%s; copied into that layout while it runs eagerly", self.name, i, t.stride(), want[1])
                self.relaid += 1
                fixed[i] = torch.empty_strided(want[0], want[1], dtype=t.dtype, device=t.device).copy_(t)
        return type(out)(fixed)

    def _compiled_layouts(self) -> tuple:
        """Per output, the (shape, stride) the graph gives on fake inputs laid out as the variant's
        example inputs (None per output where that cannot run: nothing is relaid then)."""
        try:
            mode = _compat.FakeTensorMode(allow_non_fake_inputs=True)  # (a graph's own constants are real)
            with mode, torch.no_grad():
                out = self.gm.forward(*_compat.refake(self.example_args, mode))
            return tuple((tuple(t.shape), tuple(t.stride())) if isinstance(t, torch.Tensor) else None for t in out)
        except Exception as e:  # noqa: BLE001 - a graph fake tensors cannot run: eager's layouts stand
            log.info("shapewise: %s: the compiled variant's output layouts could not be worked out (%s: %s); its "
                     "eager outputs are used as they are laid out", self.name, type(e).__name__, e)
            return tuple(None for _ in self.want)


def _differs(t: Any, want: tuple | None) -> bool:
    """Whether tensor ``t`` has ``want``'s shape but other strides (size-1 dims: any stride)."""
    return want is not None and isinstance(t, torch.Tensor) and tuple(t.shape) == want[0] and any(
        size != 1 and got != stride for size, got, stride in zip(want[0], t.stride(), want[1]))


def output_layouts(gm: torch.fx.GraphModule, values: Mapping[sympy.Symbol, int]) -> tuple | None:
    """Per output of ``gm`` (a tuple or list of them): its traced (shape, stride) at the sizes ``values``;
    None for an output that is not a tensor or whose layout these sizes do not fix (None in all:
    no flat outputs)."""
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if out is None or not isinstance(out.args[0], (tuple, list)):
        return None
    subs = {s: sympy.Integer(v) for s, v in values.items()}
    want: list[tuple | None] = []
    for a in out.args[0]:
        v = _compat.node_value(a) if isinstance(a, torch.fx.Node) else None
        try:
            want.append(None if not isinstance(v, torch.Tensor) else tuple(
                tuple(int(_compat.sym_expr(d).xreplace(subs)) for d in dims) for dims in (v.shape, v.stride())))
        except TypeError:  # a size these values leave symbolic
            want.append(None)
    return tuple(want)
