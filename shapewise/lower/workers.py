"""Cold compiles over the machine's cores: a compile session's static Inductor variants compiled in
worker processes, into the artifact cache the session shares with them, while the session itself
compiles the rest.

``Lower(compile_workers=N)`` (``sw.compile(..., compile_workers=N)``; ``"auto"``, the default: from the
CPUs this process may use, none below 8, or ``SHAPEWISE_COMPILE_WORKERS`` where set). Before
``CompileSession.compile_all`` goes through the variants one by one, the distinct content keys that
need a compile (static, Inductor, cacheable, not on disk yet) are handed to
N worker processes (``python -m shapewise.lower.worker_process``, started with the model's
``ShapewiseModule`` so that their imports run during Dynamo's trace, and kept for the process's later
compiles: a model's traces compile one after another). Each worker gets the piece's graph (pickled,
without its traced values), its inputs' sizes, strides and dtypes (it makes fake tensors of them,
and of the graph's values from them), the compile's
options and the session's Inductor config; it compiles under the key's file lock and writes the
artifact to the cache (``ArtifactCache.compile_or_load``: the rules every process sharing a cache
folder follows). Which variants go, and when the session takes the workers' (on first use, or in the
compile with ``wait_for_workers``), is ``shapewise.lower.parallel``'s: each such take is a
``compile_or_load`` that loads what a worker wrote, waits on the lock of one a worker is compiling,
or compiles one no worker has started. So a worker that fails (a graph that does not pickle, a
custom op its process does not know) costs nothing but its time: the session compiles that key
itself. Inductor's own compile threads keep working inside each worker: the CPUs shared out among
the workers (``worker_compile_threads``), not the session's count in each. How many workers:
``shapewise.lower.placement``.

Only with a disk cache (``cache`` not False): the cache is how artifacts come back.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import logging
import operator
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # (the builtin one only from Python 3.11)
from dataclasses import dataclass
from typing import Any

import torch

from shapewise import _compat
from shapewise.lower.placement import resolve_workers, worker_compile_threads

__all__ = ["WorkerPool", "compile_in_worker", "library_modules", "read_task", "serve", "task_bytes", "warm_up"]

log = logging.getLogger("shapewise")

# A graph whose pickle is larger than this holds tensors (constants, weights): compiled here.
MAX_TASK_BYTES = 64 << 20
# A worker's scheduling priority below the session's (``os.nice``): the session's own compile is the
# one its caller waits for, so under contention for the CPUs it goes first (a worker and its Inductor
# compile processes take what the session leaves). On the H200 machine's 16 CPUs, six workers at the
# session's priority slowed the session's own compile of the first prompt size from 9.7-11.1 s to 14.1 s.
WORKER_NICENESS = 10
# How long a session waits to hear from a worker whose artifact it loaded (to report it as the
# worker's); it wrote the file and reports at once, so this is only a bound.
OUTCOME_WAIT_S = 10.0


@dataclass(frozen=True)
class TensorSpec:
    """What a worker needs to make a fake stand-in for one tensor input."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: str
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), int(t.storage_offset()),
                   t.dtype, str(t.device), bool(t.requires_grad))

    def make(self) -> torch.Tensor:
        length = _compat.storage_length(self.shape, self.stride, self.offset)
        base = torch.empty(max(length, 1), dtype=self.dtype, device=self.device)
        out = base.as_strided(self.shape, self.stride, self.offset)
        return out.requires_grad_() if self.requires_grad else out


def task_bytes(key: str, gm: torch.fx.GraphModule, args: Sequence[Any], options: dict[str, Any],
               info: dict[str, Any]) -> bytes | None:
    """One compile, pickled for a worker; None where it cannot go (an input that is neither a
    tensor nor a number, a graph or option that does not pickle, a graph holding large tensors)."""
    specs: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor) and not _compat.is_traceable_wrapper_subclass(a):
            specs.append(TensorSpec.of(a))
        elif isinstance(a, (int, float, bool)) or a is None:
            specs.append(a)
        else:
            return None
    buf = io.BytesIO()
    try:
        pickle.dump(library_modules(), buf)  # read first: the worker imports them before the graph's ops unpickle
        _TaskPickler(buf).dump({"key": key, "gm": _graph_payload(gm), "args": specs, "options": options, "info": info,
                                "state": _compat.compile_state()})
    except Exception as e:  # noqa: BLE001 - such a variant is compiled in the session
        log.debug("shapewise: %s... is compiled here, not in a worker: %s: %s", key[:12], type(e).__name__, e)
        return None
    data = buf.getvalue()
    return data if len(data) <= MAX_TASK_BYTES else None


class _TaskPickler(pickle.Pickler):
    """Pickles torch's op objects by name (``_compat.op_by_name``): a graph pass puts OpOverloads into
    graphs (``shapewise::linear_group``, ``aten::_foreach_add_``), which do not pickle themselves;
    and higher-order operators (``wrap_with_autocast``), which would come back as copies."""

    def reducer_override(self, obj: Any) -> Any:
        named = _compat.op_qualname(obj)
        if named is not None:
            return _compat.op_by_name, named
        hop = _compat.hop_name(obj)
        return (_compat.hop_by_name, (hop,)) if hop is not None else NotImplemented


# The node meta a worker's graph keeps: source lines, and the user's annotations
# (``torch.fx.traceback.annotate``), which Inductor may read; a value that does not pickle keeps
# the variant in the session.
_TASK_META = ("stack_trace", "custom")


def _graph_payload(gm: torch.fx.GraphModule) -> tuple[torch.fx.Graph, dict[str, Any]]:
    """``gm`` as a worker rebuilds it: its graph without the nodes' traced values (fake tensors,
    which do not pickle; the worker traces them again from its inputs) and with no meta but their
    source lines and annotations (``_TASK_META``; ``nn_module_stack`` holds the model's classes, which
    need not pickle: a class made inside a function), and the attributes its ``get_attr`` nodes read.
    The graph itself, not the GraphModule: unpickling a GraphModule traces its generated code again
    with FX's symbolic tracer, which a Dynamo graph does not survive (slices by sizes, ``if`` on a
    tensor)."""
    import copy

    graph = copy.deepcopy(gm.graph)
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        node.meta = {k: v for k, v in node.meta.items() if k in _TASK_META}
        if node.op == "call_module":
            raise TypeError(f"a call_module node ({node.target}): the worker would need the module")
        if node.op == "get_attr":
            attrs[str(node.target)] = operator.attrgetter(str(node.target))(gm)
    return graph, attrs


def _rebuilt(payload: tuple[torch.fx.Graph, dict[str, Any]]) -> torch.fx.GraphModule:
    graph, attrs = payload
    return torch.fx.GraphModule(attrs, graph)


# -- the worker side ---------------------------------------------------------------------------

_STATE: dict[str, Any] = {}


def _numerics() -> dict[str, Any]:
    """The process-wide settings that change what a compile makes, outside Inductor's config."""
    return {"matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "deterministic": torch.are_deterministic_algorithms_enabled()}


def _set_numerics(state: dict[str, Any]) -> None:
    torch.set_float32_matmul_precision(state["matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = state["cuda_matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = state["cudnn_tf32"]
    torch.use_deterministic_algorithms(state["deterministic"])


def _init_worker(config: bytes, fingerprint: str, cache_root: str, modules: Sequence[str],
                 numerics: dict[str, Any] | None = None, compile_threads: int | None = None) -> None:
    from torch._inductor import config as inductor_config

    inductor_config.load_config(config)
    if compile_threads is not None:  # not part of the fingerprint (Inductor's cache does not key on it)
        inductor_config.compile_threads = compile_threads
    if numerics is not None:
        _set_numerics(numerics)
    _STATE["config_ok"] = _compat.inductor_config_fingerprint() == fingerprint
    _STATE["cache_root"] = cache_root
    _import_modules(modules)


def _import_modules(modules: Sequence[str]) -> None:
    """Import what registered the custom ops the graphs call (shapewise's library): at the worker's
    start, the modules the session had then; with each task, those it has now (a kernel's module is
    imported on its first launch, which may come after the workers started)."""
    for name in modules:
        if name in sys.modules:
            continue
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 - a graph calling its op fails and compiles in the session
            log.debug("shapewise worker: cannot import %s: %s", name, e)


def compile_in_worker(data: bytes) -> tuple[str, str, float]:
    """(key, outcome, seconds): ``"compiled"``, ``"present"`` (on disk already), ``"busy"``
    (another process holds its lock) or ``"failed: ..."``."""
    from shapewise.lower.cache import ArtifactCache
    from shapewise.lower.compile import compile_static

    t0 = time.perf_counter()
    key = "?"
    try:
        task = read_task(data)
        key = task["key"]
        if not _STATE.get("config_ok"):
            return key, "failed: the worker's Inductor config differs from the session's", 0.0
        cache = ArtifactCache(_STATE["cache_root"])
        if cache.path(key).exists():
            return key, "present", 0.0
        gm = _rebuilt(task["gm"])
        mode = _compat.FakeTensorMode(allow_non_fake_inputs=True)  # (a graph's own constants are real)
        with mode:
            args = [a.make() if isinstance(a, TensorSpec) else a for a in task["args"]]
        _traced_values(gm, mode, args)
        with _compat.compile_state_as(task["state"]):
            got = cache.compile_or_load(key, lambda: compile_static(gm, args, task["options"]),
                                        task["info"], wait=False)
        if got is None:
            return key, "busy", time.perf_counter() - t0
        if got[1] == "compiled" and not cache.path(key).exists():
            return key, "failed: compiled, but the artifact could not be saved (logged above)", time.perf_counter() - t0
        return key, got[1], time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the session compiles this key itself
        return key, f"failed: {type(e).__name__}: {e}", time.perf_counter() - t0


def read_task(data: bytes) -> dict[str, Any]:
    """A task of ``task_bytes``: the modules it names imported, then the task unpickled."""
    stream = io.BytesIO(data)
    _import_modules(pickle.load(stream))
    return pickle.load(stream)


def _traced_values(gm: torch.fx.GraphModule, mode: Any, args: list[Any]) -> None:
    """Give ``gm``'s nodes the traced values the pickle left out (``example_value``, fake tensors
    at these sizes): AOTAutograd's cache, whose entry the saved artifact is, asks each method
    call whether its receiver is a tensor by them, and bypasses a graph that has none."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    with torch.no_grad() if not any(getattr(a, "requires_grad", False) for a in args) else contextlib.nullcontext():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])


def _send(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream: Any) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the other side closed the pipe")
    n = int.from_bytes(head, "little")
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the other side closed the pipe mid-message")
    return pickle.loads(data)


def serve(out: Any) -> None:
    """A worker process (``python -m shapewise.lower.worker_process``): its setup, then tasks, on stdin;
    each task's (key, outcome, seconds) on ``out`` (the process's stdout, which nothing else writes
    to); an empty task ends it. It runs ``WORKER_NICENESS`` below the session's priority."""
    inp = sys.stdin.buffer
    with contextlib.suppress(OSError):  # (a platform without it: the same priority as the session)
        os.nice(WORKER_NICENESS)
    _init_worker(*_receive(inp))
    while True:
        try:
            data = _receive(inp)
        except EOFError:
            return
        if not data:
            return
        _send(out, compile_in_worker(data))


# -- the session side --------------------------------------------------------------------------

class _Processes:
    """The worker processes (``python -m shapewise.lower.worker_process``), each fed through its
    pipes by one thread of this process: no ``multiprocessing``, so no re-import of the user's
    ``__main__``. Shared by the compile sessions of a process (``_processes``): a model's traces
    compile one after another, and a worker costs seconds to start (it imports torch)."""

    def __init__(self, workers: int, setup: tuple) -> None:
        self.setup = setup
        # (rank, order, task): a call's own size (rank 0) before the sizes no call waits for yet (1), in the
        # order given within each; rank 2 ends a feeding thread.
        self.queue: queue.PriorityQueue = queue.PriorityQueue()
        self.order = itertools.count()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.procs = [subprocess.Popen([sys.executable, "-m", "shapewise.lower.worker_process"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env) for _ in range(workers)]
        self.threads = [threading.Thread(target=self._feed, args=(p,), daemon=True, name="shapewise-compile-worker")
                        for p in self.procs]
        for t in self.threads:
            t.start()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs) and all(t.is_alive() for t in self.threads)

    def _feed(self, proc: subprocess.Popen) -> None:
        try:
            _send(proc.stdin, self.setup)
            while True:
                _, _, item = self.queue.get()
                if item is None:
                    break
                key, data, future = item
                if not future.set_running_or_notify_cancel():  # cancelled: its session did it
                    continue
                try:
                    _send(proc.stdin, data)
                    future.set_result(_receive(proc.stdout))
                except Exception as e:  # noqa: BLE001 - the worker died: its keys go back to the session
                    future.set_result((key, f"failed: the worker process ended ({type(e).__name__}: {e})", 0.0))
                    break
        finally:
            with contextlib.suppress(Exception):
                _send(proc.stdin, b"")
                proc.stdin.close()

    def submit(self, key: str, data: bytes, first: bool = False) -> Future:
        """Queue a compile; ``first``: before every task queued without it that no worker has started."""
        future: Future = Future()
        self.queue.put((0 if first else 1, next(self.order), (key, data, future)))
        return future

    def shutdown(self, grace: float = 10.0) -> None:
        """End the workers: what no worker has started is dropped (variants left pending by a session
        are then compiled where they are first used), each finishes the task it has, then is asked
        to stop; any still there after ``grace`` seconds in all is killed."""
        dropped = 0
        while True:
            try:
                _, _, item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[2].cancel():
                dropped += 1
        if dropped:
            log.info("shapewise: %d compiles no worker had started were dropped with the workers", dropped)
        for _ in self.threads:
            self.queue.put((2, next(self.order), None))
        deadline = time.monotonic() + grace
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()


_SHARED: list[_Processes] = []
_SHARED_LOCK = threading.Lock()


def _processes(workers: int, cache_root: str) -> _Processes:
    """The process-wide workers, started (again) where there are none, fewer than ``workers``,
    dead ones, or ones set up for another cache folder or Inductor config (not for library modules
    imported since: each task names the modules its worker imports first)."""
    from torch._inductor import config as inductor_config

    modules = library_modules()
    fingerprint, numerics = _compat.inductor_config_fingerprint(), _numerics()
    with _SHARED_LOCK:
        if _SHARED:
            old = _SHARED[0]
            why = _why_new(old, workers, fingerprint, cache_root, numerics)
            if why is None:
                return old
            log.info("shapewise: compile workers started again (%s)", why)
            _SHARED.clear()
            old.shutdown()
        else:
            atexit.register(_shutdown_shared)
        made = _Processes(workers, (inductor_config.save_config(), fingerprint, cache_root, modules, numerics,
                                    worker_compile_threads(workers)))
        _SHARED.append(made)
        return made


def _why_new(old: _Processes, workers: int, fingerprint: str, cache_root: str,
             numerics: dict[str, Any]) -> str | None:
    """Why ``old`` cannot serve (None: it can). Library modules imported since it started do not count:
    each task names the modules its worker imports first."""
    _, was_fingerprint, was_root, _, was_numerics, _ = old.setup
    if len(old.procs) < workers:
        return f"{workers} asked for, {len(old.procs)} running"
    if not old.alive():
        return "a worker process ended"
    if was_root != cache_root:
        return f"another cache folder: {cache_root}"
    if was_fingerprint != fingerprint:
        return "Inductor's config changed"
    return f"numerics changed: {numerics}" if was_numerics != numerics else None


def library_modules() -> list[str]:
    """shapewise's library modules imported in this process: what registers the custom ops a graph
    pass puts into graphs, which a worker imports before it unpickles a graph calling them."""
    return sorted(n for n in list(sys.modules) if n.startswith("shapewise.library"))  # (a copy: threads import)


def _shutdown_shared() -> None:
    with _SHARED_LOCK:
        for p in _SHARED:
            p.shutdown()
        _SHARED.clear()


def warm_up(options: Mapping[str, Any]) -> None:
    """Before a model's first trace (``ShapewiseModule``): Inductor's compile threads (on CUDA), and
    the compile worker processes its options ask for, so that their start (each imports torch)
    runs while Dynamo traces."""
    from shapewise.lower.cache import resolve_cache

    if torch.cuda.is_available():
        _compat.warm_compile_workers()
    if options.get("compile", "eager_all") != "eager_all":  # deferred compiles never hand work to workers
        return
    workers = resolve_workers(options.get("compile_workers", "auto"))  # (Lower's default)
    if workers > 1 and (options.get("backend", "inductor") == "inductor"):
        cache = resolve_cache(options.get("cache"))
        if cache is not None:
            _processes(workers, str(cache.root))


class WorkerPool:
    """One ``compile_all``'s use of the workers: ``submit(key, task)`` queues a compile;
    ``outcome(key)`` is what became of it ("compiled", "present", "busy", "failed: ...", "not
    started"; None: never sent); ``close(keep)`` drops what no worker has started but ``keep`` (the
    session has done the rest itself by then). The processes stay for the next session."""

    def __init__(self, workers: int, cache_root: str) -> None:
        self.processes = _processes(workers, cache_root)
        self.futures: dict[str, Future] = {}

    def submit(self, key: str, data: bytes, first: bool = False) -> None:
        self.futures[key] = self.processes.submit(key, data, first)

    def outcome(self, key: str, timeout: float = OUTCOME_WAIT_S) -> str | None:
        future = self.futures.get(key)
        if future is None:
            return None
        if future.cancelled():
            return "not started"
        if not (future.running() or future.done()):
            return "queued"  # still waiting for a worker: what this session loaded, another process wrote
        try:
            _, outcome, seconds = future.result(timeout=timeout)
        except FutureTimeout:
            return "running"
        log.debug("shapewise: compile worker: %s... %s (%.1f s)", key[:12], outcome, seconds)
        if outcome.startswith("failed"):
            log.info("shapewise: a compile worker did not compile %s...: %s", key[:12], outcome[8:])
        return outcome

    def close(self, keep: frozenset[str] = frozenset()) -> None:
        """Cancel what no worker has started but the keys in ``keep`` (left to the workers: their
        variants are loaded on first use)."""
        for key, f in self.futures.items():
            if key not in keep:
                f.cancel()  # not started yet: the session did it
        for key, f in self.futures.items():
            if f.done() and not f.cancelled():
                self.outcome(key)
