"""The runnable a pipeline returns: read sizes, look up a runner, call it."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx

from shapewise.concretize import attach_variants, make_bindings
from shapewise.dispatch.capture import capture_now
from shapewise.dispatch.guards import InputGuards
from shapewise.dispatch.table import DispatchTable
from shapewise.errors import CompileError
from shapewise.ir.program import Binding, Program
from shapewise.ir.report import REPORT_COLUMNS, Report, html_table
from shapewise.ir.runner import make_runner
from shapewise.lower.lower import SOURCES, CompileSession, Lower, summary_line
from shapewise.passes.base import Pass, PassRecord, register_pass, register_runnable

__all__ = ["BuildDispatch", "CompileReport", "CompileWatch", "DispatchRuntime", "Runnable"]

log = logging.getLogger("shapewise")


@register_pass
@dataclass(frozen=True)
class BuildDispatch(Pass):
    """Build the dispatch table: one runner per binding. ``on_miss``: "error" (default),
    "dynamic" (compile a general variant on the first miss) or "eager"."""

    name: ClassVar[str] = "build_dispatch"
    on_miss: str = "error"

    def requires(self, program: Program) -> Sequence[Pass | str]:
        deferred = getattr(program.lowering, "deferred", False)  # lazy / background: compiled here
        if program.bindings is None or (not deferred and any(
            v.compiled is None for p in program.compute_pieces for v in p.variants
        )):
            return ["lower"]
        return ()

    def apply(self, program: Program) -> Program:
        shapes = program.shapes
        on_miss = program.on_miss or self.on_miss
        exact, ranges = {}, []
        guards = InputGuards(program)  # checks inputs (no-op when Dynamo's guards sit in front)
        lowering = program.lowering
        mode = getattr(lowering, "compile", "eager_all")
        # Lazy and background variants (and on_miss="dynamic") compile here, in a session of the
        # table's own: run-time state, held by the table (and shown by its Runnable), never the IR.
        session = lowering.session() if lowering is not None and (mode != "eager_all" or on_miss == "dynamic") \
            else None
        deferred: dict[Binding, tuple[_Deferred, Callable[..., Any]]] = {}
        background = None
        watch = CompileWatch()
        for b in program.bindings:
            if mode != "eager_all" and any(p.variant_for(b) is not None and p.variant_for(b).compiled is None
                                           for p in program.compute_pieces):
                if mode == "background" and background is None:
                    background = watch.background = _Background(program, session)
                d = _Deferred(_binding_builder(program, session, b) if mode == "lazy" else None, background, watch)
                runner = guards.wrap(b, d)
                deferred[b] = (d, runner)
            else:
                runner = guards.wrap(b, make_runner(program.graph, program.callables(b)))
            if b.is_static:
                exact[b.key] = runner
            else:
                ranges.append((b, runner))
        miss_runner = None
        if on_miss == "eager":
            eager = make_runner(program.graph, program.callables(None))
            miss_runner = lambda key: eager  # noqa: E731
        elif on_miss == "dynamic" and background is not None:
            miss_runner = lambda key: background  # noqa: E731 - never compiles on the caller's thread
        elif on_miss == "dynamic":
            miss_runner = _GeneralVariant(program, session)
        table = DispatchTable(shapes.symbols, [shapes.sources[s] for s in shapes.symbols], exact, ranges,
                              shapes.names, on_miss, guards.wrap_miss(miss_runner), program.fixed_sizes)
        for b, (d, entry) in deferred.items():
            d.on_ready = _swapper(table, guards, b, entry)
        table.runtime = DispatchRuntime(session, background, watch if deferred else None)
        if background is not None:
            background.start({b: d for b, (d, _) in deferred.items()})
        return program.replace(dispatch=table)


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


@dataclass
class DispatchRuntime:
    """What a dispatch table runs with besides its runners: the compile session of its lazy,
    background and on-miss variants, the background thread, and the watch ``shapewise.compile``
    reads (whether compiles may still run while it is called). Never part of the IR."""

    session: CompileSession | None = None
    background: _Background | None = None
    watch: CompileWatch | None = None


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
        self._grad = torch.is_grad_enabled()  # grad mode is per thread: compile as the caller would
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
            with torch.set_grad_enabled(self._grad):
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


class CompileReport(Report):
    """``Runnable.report()``: one row per (piece, variant) (piece, key, static, seconds,
    source, backend, artifact) and a ``total``; prints as a table with a total line.

    ``source``: "compiled", "reused" (an identical piece's artifact, this process), "cache"
    (loaded from disk), "fallback" (failed, runs eagerly) or "pending" (lazy / background).
    """

    def __init__(self, rows: Any = (), columns: Sequence[str] | None = (*REPORT_COLUMNS, "artifact")) -> None:
        super().__init__(rows, columns)

    @property
    def total(self) -> dict[str, Any]:
        """{"variants", "seconds", and a count per source}."""
        out: dict[str, Any] = {"variants": len(self), "seconds": sum(float(r.get("seconds", 0.0)) for r in self)}
        for r in self:
            src = str(r.get("source", ""))
            out[src] = out.get(src, 0) + 1
        return out

    def total_line(self) -> str:
        t = self.total
        counts = ", ".join(f"{t[k]} {k}" for k in ("compiled", "reused", "cache", "fallback", "pending") if t.get(k))
        return f"total: {t['variants']} variants ({counts or 'none'}), {t['seconds']:.2f} s"

    def __str__(self) -> str:
        return super().__str__() + "\n" + self.total_line()

    def _repr_html_(self) -> str:
        return html_table(self, self.columns, caption=self.total_line())


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
        #: What start-up capture did (``capture()``): sizes, seconds, memory; None until then.
        self.capture_info: dict[str, Any] | None = None
        self._capture_lock = threading.Lock()
        if program.capture_at_startup:
            self._exact = {}  # every call misses until the first one has captured every size

    def __call__(self, *args: Any) -> Any:
        key = self._key(args)
        fn = self._exact.get(key)
        if fn is None:
            if self.program.capture_at_startup and self.capture_info is None:
                self._capture_first(args)
                return self(*args)
            fn = self._resolve(key)
        return fn(*args)

    def _capture_first(self, args: tuple) -> None:
        """Start-up capture on the first call (one thread captures; the others wait). If it fails,
        the sizes not captured yet are captured on their own calls instead, as without it."""
        with self._capture_lock:
            if self.capture_info is not None:
                return
            try:
                self.capture(*args)
            except Exception as e:  # noqa: BLE001 - reported, and the calls go on without it
                self._exact = self.table.exact
                self.capture_info = {"error": f"{type(e).__name__}: {e}"}
                log.warning("shapewise: start-up CUDA-graph capture failed (%s); each size is captured on its own "
                            "calls instead", self.capture_info["error"])

    def capture(self, *example_inputs: Any, progress: bool | None = None) -> dict[str, Any]:
        """Capture every CUDA-graph size now, on dummy inputs shaped from ``example_inputs`` (the
        graph's inputs at any size: parameters and fixed-size inputs are used as they are; see
        ``cudagraphs.capture_now``). With ``CudaGraphs(capture="startup")`` the first call does this."""
        self.capture_info = capture_now(self.program, example_inputs, progress)
        self._exact = self.table.exact
        return self.capture_info

    @property
    def runtime(self) -> DispatchRuntime:
        """The table's run-time state: compile session, background thread, compile watch."""
        return getattr(self.table, "runtime", None) or DispatchRuntime()

    def report(self) -> CompileReport:
        session = self.runtime.session
        done = session.results if session is not None else {}
        rows = []
        for p in self.program.compute_pieces:
            for v in p.variants:
                got = done.get((p.name, v.binding))
                rows.append(dict(got.report if got is not None else v.report))
        background = self.runtime.background
        miss = getattr(self.table._miss_runner, "__wrapped__", self.table._miss_runner)
        for general in (getattr(background, "general", None), miss):
            if isinstance(general, _GeneralVariant):
                rows += general.rows
        return CompileReport(rows)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles (``compile="background"``); True when all are done.
        Raises ``CompileError`` if one failed and ``on_compile_error`` is "raise"."""
        background = self.runtime.background
        if background is None:
            return True
        if not background.done.wait(timeout):
            return False
        lowering = self.program.lowering
        if background.errors and getattr(lowering, "on_compile_error", "raise") == "raise":
            raise CompileError(f"{len(background.errors)} background compile(s) failed; the first: "
                               f"{background.errors[0]}") from background.errors[0]
        return True

    def __repr__(self) -> str:
        return f"<shapewise.Runnable {len(self.program.pieces)} pieces, {len(self.table)} dispatch entries>"


register_runnable(Runnable)
