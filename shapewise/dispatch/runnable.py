"""The runnable a pipeline returns: read sizes, look up a runner, call it.

In: the final Program of a pipeline (its ``dispatch`` a ``DispatchPlan``). Out: a callable whose
run-time state (``runtime``: table, guards, compile session, background thread, CUDA graphs) is
built from that plan when it is made, and read by reports and tests from its named fields.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from shapewise import _compat
from shapewise.dispatch.capture import capture_now
from shapewise.dispatch.runtime import DispatchRuntime, _GeneralVariant, build_runtime
from shapewise.dispatch.table import DispatchTable
from shapewise.errors import CompileError
from shapewise.ir.program import Program
from shapewise.ir.report import REPORT_COLUMNS, Report, html_table
from shapewise.lower.parallel import PendingVariant
from shapewise.passes.base import PassRecord, register_runnable

__all__ = ["CompileReport", "Runnable"]

log = logging.getLogger("shapewise")


class CompileReport(Report):
    """``Runnable.report()``: one row per (piece, variant) (piece, key, static, seconds,
    source, backend, artifact) and a ``total``; prints as a table with a total line.

    ``source``: "compiled", "worker" (compiled in a worker process for this call, loaded from
    disk: ``compile_workers``), "reused" (an identical piece's artifact, this process), "cache"
    (loaded from disk), "fallback" (failed, runs eagerly) or "pending" (lazy / background, or a compile
    worker's, loaded on first use).
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
        kinds = ("compiled", "worker", "reused", "cache", "fallback", "pending")
        counts = ", ".join(f"{t[k]} {k}" for k in kinds if t.get(k))
        return f"total: {t['variants']} variants ({counts or 'none'}), {t['seconds']:.2f} s"

    def __str__(self) -> str:
        return super().__str__() + "\n" + self.total_line()

    def _repr_html_(self) -> str:
        return html_table(self, self.columns, caption=self.total_line())


class Runnable(_compat.SerializableCallable):
    """What ``Pipeline.run`` returns: call it like the traced graph.

    ``program``: the final Program; ``trace``: each stage's record; ``report()``: one row per
    (piece, variant) with piece, key, static, seconds, source. Savable (``dispatch.saved``): as
    what a backend returns, ``torch.compile(model, backend="shapewise").aot_compile(...)`` saves
    it with Dynamo's trace, and ``torch.compiler.load_compiled_function`` loads it again.
    """

    @classmethod
    def serialize_compile_artifacts(cls, fn: Runnable) -> bytes:
        from shapewise.dispatch.saved import program_bytes

        return program_bytes(fn)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Runnable:
        from shapewise.dispatch.saved import load_program

        program, under = load_program(data)
        with _compat.compile_state_as(under):  # (its background compiles and lazy variants: as when it was traced)
            return cls(program)

    def __init__(self, program: Program, trace: Sequence[PassRecord] = ()) -> None:
        self.program = program
        self.trace = tuple(trace)
        #: (grad mode, autocast) of its compiles (``_compat.compile_state``): what a saved program loads under.
        self.compiled_under = _compat.compile_state()
        #: The live objects built from ``program.dispatch``: table, guards, compile session,
        #: background thread, CUDA graphs (``dispatch.runtime.DispatchRuntime``).
        self.runtime: DispatchRuntime = build_runtime(program)
        table = self.table
        self._key = table.key_fn
        self._exact = table.exact
        self._resolve = table.resolve
        graphs = program.dispatch.graphs
        self._capture_at_startup = graphs is not None and graphs.at_startup and bool(graphs.sizes)
        #: What start-up capture did (``capture()``): sizes, seconds, memory; None until then.
        self.capture_info: dict[str, Any] | None = None
        self._capture_lock = threading.Lock()
        self._resolver: threading.Thread | None = None  # wait()'s loader of the variants left to compile workers
        self._resolver_lock = threading.Lock()
        if self._capture_at_startup:
            self._exact = {}  # every call misses until the first one has captured every size

    @property
    def table(self) -> DispatchTable:
        """The dispatch table: key → runner."""
        return self.runtime.table

    def __call__(self, *args: Any) -> Any:
        key = self._key(args)
        fn = self._exact.get(key)
        if fn is None:
            if self._capture_at_startup and self.capture_info is None:
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
        self.capture_info = capture_now(self.program, self.runtime, example_inputs, progress)
        self._exact = self.table.exact
        return self.capture_info

    def report(self) -> CompileReport:
        session = self.runtime.session
        done = session.results if session is not None else {}
        rows = []
        for p in self.program.compute_pieces:
            for v in p.variants:
                got = done.get((p.name, v.binding))
                rows.append(dict(got.report if got is not None else v.report))
        background = self.runtime.background
        for general in (background.general if background is not None else None, self.runtime.general):
            if isinstance(general, _GeneralVariant):
                rows += general.rows
        return CompileReport(rows)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles (``compile="background"``) and load the variants left to
        compile workers (``PendingVariant``); True when all are done (False: ``timeout`` s passed).
        Raises ``CompileError`` if one failed and ``on_compile_error`` is "raise"."""
        start = time.monotonic()
        if not self._resolve_pending(timeout):
            return False
        background = self.runtime.background
        if background is None:
            return True
        if not background.done.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - start))):
            return False
        lowering = self.program.lowering
        if background.errors and lowering is not None and lowering.on_compile_error == "raise":
            raise CompileError(f"{len(background.errors)} background compile(s) failed; the first: "
                               f"{background.errors[0]}") from background.errors[0]
        return True

    def _resolve_pending(self, timeout: float | None) -> bool:
        """Every ``PendingVariant`` of the program got (loaded, waited for, or compiled), on one thread
        of this runnable's (started by the first ``wait``; one that timed out keeps loading, and the
        next ``wait`` joins the same thread), so that ``timeout`` holds; a failed one's error raised here."""
        pending = [v.compiled for p in self.program.compute_pieces for v in p.variants
                   if isinstance(v.compiled, PendingVariant) and not v.compiled.ready]
        if not pending:
            return True
        with self._resolver_lock:
            thread = self._resolver
            if thread is None or not thread.is_alive():
                thread = self._resolver = threading.Thread(target=self._resolve_all, args=(pending,), daemon=True,
                                                           name="shapewise-pending")
                thread.start()
        thread.join(timeout)
        if thread.is_alive():
            return False
        for fn in pending:  # each raises its error again (or returns its callable)
            fn.resolve()
        return True

    @staticmethod
    def _resolve_all(pending: list[PendingVariant]) -> None:
        for fn in pending:
            try:
                fn.resolve()
            except Exception:  # noqa: BLE001 - kept by the variant, raised by wait() in the caller's thread
                log.debug("shapewise: loading %r failed", fn, exc_info=True)

    def __repr__(self) -> str:
        return f"<shapewise.Runnable {len(self.program.pieces)} pieces, {len(self.table)} dispatch entries>"


register_runnable(Runnable)
