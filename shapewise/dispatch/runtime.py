"""The dispatch runtime: the live objects a ``Runnable`` calls, built from a ``DispatchPlan``.

In: a Program whose ``dispatch`` is a ``DispatchPlan`` (``BuildDispatch``, maybe ``CudaGraphs``).
Out: a ``DispatchRuntime`` holding, in named fields, the dispatch table and its input guards, the
compile session of the variants compiled at run time (lazy, background, on a miss), the background
compile thread, the general variant of ``on_miss="dynamic"``, and the CUDA graphs
(``cudagraphs.GraphRuntime``: pool, graphed pieces, staged inputs). Nothing here is stored in the
Program: each Runnable builds its own.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shapewise import _compat
from shapewise.concretize import attach_variants, make_bindings
from shapewise.dispatch.cudagraphs import GraphRuntime, build_graphs
from shapewise.dispatch.guards import InputGuards
from shapewise.dispatch.plan import DispatchPlan
from shapewise.dispatch.table import DispatchTable
from shapewise.errors import ConfigError
from shapewise.ir.program import Binding, Program
from shapewise.ir.runner import make_runner
from shapewise.lower.lower import SOURCES, CompileSession, Lower, summary_line

__all__ = ["CompileWatch", "DispatchRuntime", "build_runtime"]

log = logging.getLogger("shapewise")


@dataclass
class DispatchRuntime:
    """A Runnable's run-time state. ``table``: key → runner; ``guards``: the input checks around
    each runner (none when Dynamo's guards sit in front); ``session``: the compile session of the
    variants compiled at run time (None when every variant was compiled by ``Lower``);
    ``background``: the background compile thread (``compile="background"``); ``watch``: whether
    compiles may still run while the runnable is called (``shapewise.compile`` reads it);
    ``general``: the general variant ``on_miss="dynamic"`` compiles on a miss; ``graphs``: the
    CUDA graphs (``CudaGraphs``); ``deferred``: per binding compiled at run time, its stand-in
    (which compiles it, or serves from the fallback until it is compiled) and the table entry
    that calls the stand-in until the compiled runner is swapped in."""

    table: DispatchTable
    guards: InputGuards
    session: CompileSession | None = None
    background: _Background | None = None
    watch: CompileWatch | None = None
    general: _GeneralVariant | None = None
    graphs: GraphRuntime | None = None
    deferred: dict[Binding, tuple[_Deferred, Callable[..., Any]]] = field(default_factory=dict)


def build_runtime(program: Program) -> DispatchRuntime:
    """The live objects for ``program.dispatch`` (a ``DispatchPlan``); starts the background
    compile thread when the plan has one."""
    plan = program.dispatch
    if not isinstance(plan, DispatchPlan):
        raise ConfigError(f"a Runnable is built from a Program whose dispatch is a DispatchPlan (made by the "
                          f"build_dispatch pass), got {type(plan).__name__}")
    lowering = program.lowering
    guards = InputGuards(program)  # checks inputs (no-op when Dynamo's guards sit in front)
    runs_compiles = plan.compile != "eager_all" or plan.on_miss == "dynamic"
    session = lowering.session() if lowering is not None and runs_compiles else None
    watch = CompileWatch()
    background = None
    if plan.compile == "background" and plan.deferred:
        background = watch.background = _Background(program, session)
    deferred: dict[Binding, tuple[_Deferred, Callable[..., Any]]] = {}
    entries: dict[Binding, Callable[..., Any]] = {}
    for b in (*plan.exact, *plan.ranges):
        if b in plan.deferred:
            d = _Deferred(_binding_builder(program, session, b) if plan.compile == "lazy" else None, background, watch)
            entries[b] = guards.wrap(b, d)
            deferred[b] = (d, entries[b])
        else:
            entries[b] = guards.wrap(b, make_runner(program.graph, program.callables(b)))
    general = None
    miss_runner = None
    if plan.on_miss == "eager":
        eager = make_runner(program.graph, program.callables(None))
        miss_runner = lambda key: eager  # noqa: E731
    elif plan.on_miss == "dynamic" and background is not None:
        miss_runner = lambda key: background  # noqa: E731 - never compiles on the caller's thread
    elif plan.on_miss == "dynamic":
        miss_runner = general = _GeneralVariant(program, session)
    table = DispatchTable(plan.symbols, plan.sources, {b.key: entries[b] for b in plan.exact},
                          [(b, entries[b]) for b in plan.ranges], plan.names, plan.on_miss,
                          guards.wrap_miss(miss_runner), plan.fixed)
    for b, (d, entry) in deferred.items():
        d.on_ready = _swapper(table, guards, b, entry)
    graphs = None
    if plan.graphs is not None:
        graphs = build_graphs(program, plan.graphs)
        table.add_exact(graphs.entries)
        for gate in graphs.gates:
            gate.on_ready = functools.partial(table.replace_runner, gate, gate.graphed)
    if background is not None:
        background.start({b: d for b, (d, _) in deferred.items()})
    return DispatchRuntime(table, guards, session, background, watch if deferred else None, general, graphs, deferred)


def _binding_builder(program: Program, session: Any, binding: Binding) -> Callable[[], Callable[..., Any]]:
    def build() -> Callable[..., Any]:
        t0 = time.perf_counter()
        before = dict(session.counts)
        runner = make_runner(program.graph, session.compile_binding(program.pieces, binding))
        counts = {k: session.counts[k] - before.get(k, 0) for k in SOURCES}
        log.info("%s", summary_line(counts, time.perf_counter() - t0,
                                    f"{binding.describe(program.shapes.names)} on first use: "))
        return runner

    return build


def _swapper(table: DispatchTable, guards: InputGuards, binding: Binding,
             entry: Callable[..., Any]) -> Callable[[Callable[..., Any]], None]:
    def swap(runner: Callable[..., Any]) -> None:
        table.replace_runner(entry, guards.wrap(binding, runner))

    return swap


class CompileWatch:
    """Whether compiles can still happen while this runnable is called (a lazy binding not
    compiled yet, a background thread still running): ``shapewise.compile`` then lets calls
    pass Dynamo while another thread's compile is tracing (``_compat.calls_during_fx_trace``)."""

    def __init__(self) -> None:
        self.pending = 0
        self.background: _Background | None = None
        self._lock = threading.Lock()

    def done_one(self) -> None:
        with self._lock:
            self.pending -= 1

    @property
    def active(self) -> bool:
        bg = self.background
        return self.pending > 0 or (bg is not None and not bg.done.is_set())


class _Deferred:
    """A binding's runner until its variants are compiled: ``lazy`` compiles them on the first
    call (that call waits; concurrent callers of the same binding wait for the same compile);
    ``background`` never compiles here and serves from the fallback until the background
    thread hands in the real runner. Once ready it forwards, and the table entry is swapped
    for the real runner so later calls skip this object."""

    def __init__(self, build: Callable[[], Callable[..., Any]] | None, fallback: Callable[..., Any] | None,
                 watch: CompileWatch) -> None:
        self.build = build
        self.fallback = fallback
        self.final: Callable[..., Any] | None = None
        self.on_ready: Callable[[Callable[..., Any]], None] | None = None
        self.watch = watch
        self._lock = threading.Lock()
        watch.pending += 1

    def ready(self, runner: Callable[..., Any]) -> None:
        self.final = runner
        if self.on_ready is not None:
            self.on_ready(runner)
        self.watch.done_one()

    def __call__(self, *args: Any) -> Any:
        fn = self.final
        if fn is None:
            if self.build is None:
                return self.fallback(*args)
            with self._lock:
                if self.final is None:
                    self.ready(self.build())
            fn = self.final
        return fn(*args)


_RUNNING: weakref.WeakSet[_Background] = weakref.WeakSet()


@atexit.register
def _stop_background_compiles() -> None:
    # A thread still inside a compile when the interpreter tears down aborts the process:
    # let the current variant finish, start no other.
    for background in list(_RUNNING):
        background.stop()


class _Background:
    """The background compile thread of one dispatch table: first (with several bindings) a
    general dynamic variant that then serves every pending size, then each binding in order,
    each swapped into the table when ready. Calls never wait on it: until a binding is ready
    they run the general variant if it is compiled, else eagerly."""

    def __init__(self, program: Program, session: Any) -> None:
        self.program = program
        self.session = session
        self.pending: dict[Binding, _Deferred] = {}
        self.fallback: Callable[..., Any] = make_runner(program.graph, program.callables(None))
        self.errors: list[BaseException] = []
        self.seconds = 0.0
        self.done = threading.Event()
        self.stopping = threading.Event()
        self.general: _GeneralVariant | None = None
        self._state = _compat.compile_state()  # grad mode and autocast are per thread: compile as the caller would
        self.thread = threading.Thread(target=self._run, name="shapewise-compile", daemon=True)

    def __call__(self, *args: Any) -> Any:
        return self.fallback(*args)

    def start(self, pending: Mapping[Binding, _Deferred]) -> None:
        self.pending = dict(pending)
        _RUNNING.add(self)
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Compile nothing more (the variant being compiled finishes) and wait for the thread."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        t0 = time.perf_counter()
        before = dict(self.session.counts)
        try:
            with _compat.compile_state_as(self._state):
                if len(self.pending) > 1:
                    general = self._general()
                    if general is not None:
                        self.fallback = general
                for binding, deferred in self.pending.items():
                    if self.stopping.is_set():
                        break
                    try:
                        callables = self.session.compile_binding(self.program.pieces, binding)
                        deferred.ready(make_runner(self.program.graph, callables))
                    except Exception as e:  # noqa: BLE001 - no caller to raise to: kept for wait()
                        self.errors.append(e)
                        log.error("shapewise: background compile failed; %s keeps running on the fallback: %s",
                                  binding, e)
        finally:
            self.seconds = time.perf_counter() - t0
            counts = {k: self.session.counts[k] - before.get(k, 0) for k in SOURCES}
            log.info("%s", summary_line(counts, self.seconds, "background: "))
            self.done.set()
            _RUNNING.discard(self)

    def _general(self) -> Callable[..., Any] | None:
        self.general = _GeneralVariant(self.program, self.session, label="general (background fallback)")
        try:
            return self.general(())
        except Exception as e:  # noqa: BLE001 - eager keeps serving
            log.info("shapewise: the general dynamic variant did not compile (%s); pending sizes run eagerly "
                        "until their own variants are ready", e)
            return None


class _GeneralVariant:
    """Compiles, on first use, one variant with every symbol dynamic, and reuses it (through
    the program's compile session when there is one: dedupe and cache)."""

    def __init__(self, program: Program, session: Any = None, label: str = "general (on_miss='dynamic')") -> None:
        self.program = program
        self.session = session
        self.label = label
        self.runner: Callable[..., Any] | None = None
        self.rows: list[dict[str, Any]] = []

    def __call__(self, key: tuple) -> Callable[..., Any]:
        if self.runner is None:
            (general,) = make_bindings(self.program.shapes)
            pieces = attach_variants(self.program.pieces, [general])
            for rewrite in self.program.rewrites:  # the program's graph passes reach this variant too
                pieces = rewrite.apply(self.program.replace(pieces=pieces)).pieces
            session = self.session or (self.program.lowering or Lower()).session()
            callables = {}
            for p in pieces:
                if p.is_splitting:
                    callables[p.name] = p.call or p.gm.forward
                    continue
                v = session.compile(p, p.variants[0])
                self.rows.append({**v.report, "key": self.label})
                callables[p.name] = v.compiled
            self.runner = make_runner(self.program.graph, callables)
        return self.runner
