"""Lower: compile every variant of every compute piece with a backend.

One compile is ``lower_variant`` (``shapewise.lower.compile``). Pieces with the same content
(see ``shapewise.ir.keys``) compile once per binding and share the artifact; Inductor artifacts
go through the on-disk cache (``shapewise.lower.cache``). Variants compile up front
(``compile="eager_all"``), on first use (``"lazy"``) or in a background thread
(``"background"``); the last two are run by the dispatch table (``BuildDispatch``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx

from shapewise import _compat
from shapewise.errors import CompileError, ConfigError
from shapewise.ir.effects import restore_values
from shapewise.ir.keys import binding_key, graph_key
from shapewise.ir.program import Binding, Piece, Program, TensorMeta, Variant
from shapewise.ir.runner import LAYOUTS_ATTR
from shapewise.lower.cache import ArtifactCache, resolve_cache
from shapewise.lower.compile import lower_variant, reads_item_values
from shapewise.lower.lean import drop_size_asserts, expected_layouts, lean_call, lean_splitting_call
from shapewise.lower.parallel import eager_refused, pending_variant, start_workers
from shapewise.lower.workers import WorkerPool, resolve_workers  # (placement's, which workers uses too)
from shapewise.passes.base import Pass, register_pass
from shapewise.version import __version__

__all__ = ["BACKENDS", "COMPILE_MODES", "CompileSession", "Lower", "lower_variant", "summary_line"]

log = logging.getLogger("shapewise")

BACKENDS = ("inductor", "eager", "aot_eager")
COMPILE_MODES = ("eager_all", "lazy", "background")
SOURCES = ("compiled", "worker", "reused", "cache", "fallback", "pending")


def _input_layouts(variant: Variant) -> str:
    """The strides and offsets of a variant's tensor inputs (ints, or expressions over its own
    fresh symbols s0, s1, ... for a range): eager, or a range compile, may lay an input out
    otherwise than the trace says (see ``concretize.observed_inputs``), so two equal pieces
    share a compile only when their inputs agree. A subclass input (a DTensor) by its outer
    strides: its inner tensors' layouts are in the graph key."""
    def layout(a: Any) -> str:
        if not isinstance(a, torch.Tensor):
            return "."
        if _compat.is_traceable_wrapper_subclass(a):
            return f"{tuple(a.stride())}+subclass"
        return f"{tuple(a.stride())}+{a.storage_offset()}"

    return ";".join(layout(a) for a in variant.example_args)


def _backend_id(backend: Any) -> tuple[str, bool]:
    """(an id of the backend for keys, whether artifacts of it may go to disk)."""
    if isinstance(backend, str):
        return backend, backend == "inductor"
    name = f"{getattr(backend, '__module__', '?')}.{getattr(backend, '__qualname__', type(backend).__qualname__)}"
    return f"callable:{name}@{id(backend)}", False  # identity only holds in this process


def summary_line(counts: Mapping[str, int], seconds: float, what: str = "") -> str:
    """``"shapewise: 18 variants: 6 compiled, 12 reused, 0 from cache in 7.3 s"``."""
    n = sum(counts.get(s, 0) for s in SOURCES)
    workers = f" (+{counts['worker']} in worker processes)" if counts.get("worker") else ""
    line = (f"shapewise: {what}{n} variants: {counts.get('compiled', 0)} compiled{workers}, "
            f"{counts.get('reused', 0)} reused, {counts.get('cache', 0)} from cache")
    if counts.get("fallback"):
        line += f", {counts['fallback']} fell back to eager"
    if counts.get("pending"):
        line += f", {counts['pending']} left to worker processes (loaded on first use)"
    return f"{line} in {seconds:.1f} s"


class CompileSession:
    """The compiles of one ``Lower`` run, shared with the dispatch table that runs the lazy and
    background ones.

    Each (piece, variant) gets a content key (graph key + binding over canonical symbols +
    backend, options, grad mode; for Inductor also the build and Inductor's config). A key seen
    before in this session is ``"reused"``; an Inductor artifact in the disk cache is loaded
    (``"cache"``); anything else is ``"compiled"`` (and stored). Thread-safe: one compile per key.
    """

    def __init__(self, lower: Lower) -> None:
        self.lower = lower
        self.backend_id, cacheable = _backend_id(lower.backend)
        self.cache = resolve_cache(lower.cache) if cacheable else None
        self.results: dict[tuple[str, Binding], Variant] = {}
        self.counts: dict[str, int] = dict.fromkeys(SOURCES, 0)
        self._memo: dict[str, tuple[Callable[..., Any], int | None]] = {}  # key -> (artifact, its rank)
        self._graph_keys: dict[int, Any] = {}
        self._key_locks: dict[str, threading.Lock] = {}
        self._lock = threading.RLock()
        self._build: dict[frozenset, str] = {}
        self.rank, self.world = _compat.rank_and_world()
        self.workers: WorkerPool | None = None  # compile_all's, while it runs (compile_workers > 1)
        #: a loaded program's saved keys (dispatch.saved), (piece name, binding) -> (content key, to disk?):
        #: within one program a piece's bindings are distinct, so they name its variants
        self.loaded_keys: dict[tuple[str, Binding], tuple[str | None, bool]] = {}

    def graph_key(self, piece: Piece):
        """The piece's ``GraphKey`` (memoised per graph), or None if it cannot be keyed."""
        with self._lock:
            k = id(piece.gm)
            if k not in self._graph_keys:
                self._graph_keys[k] = (piece.gm, graph_key(piece.gm, piece.shapes))
            return self._graph_keys[k][1]

    def _build_part(self, piece: Piece) -> str:
        devices = frozenset(str(m.device) for m in (piece.shapes.inputs if piece.shapes else ())
                            if isinstance(m, TensorMeta))
        with self._lock:
            if devices not in self._build:
                fp = _compat.build_fingerprint(sorted(devices))
                fp["inductor_config"] = _compat.inductor_config_fingerprint()
                fp["shapewise"] = __version__
                self._build[devices] = repr(sorted(fp.items()))
            return self._build[devices]

    def variant_key(self, piece: Piece, variant: Variant) -> tuple[str | None, bool]:
        """(content key of this compile or None, whether it may be stored on disk)."""
        known = self.loaded_keys.get((piece.name, variant.binding))
        if known is not None:
            return known
        gk = self.graph_key(piece)
        if gk is None:
            return None, False
        options = repr(sorted(self.options(piece, variant).items()))
        parts = [
            "shapewise-variant/2",
            f"graph={gk.digest}",
            f"binding={binding_key(gk, piece.shapes, variant.binding)}",
            f"static={variant.binding.is_static}",
            f"layouts={_input_layouts(variant)}",
            f"grad={torch.is_grad_enabled()}",
            f"backend={self.backend_id}",
            f"options={options}",
            f"passes={list(variant.passes)}",
            f"inductor_passes={[p.uuid() for p in variant.inductor_passes]}",
        ]
        # compiled code bakes autocast in (``_compat.autocast_state``); a part only where it is on
        parts += [f"autocast={state}" for state in [_compat.autocast_state()] if state]
        # A repr with an address differs in every process: such a key stays in memory.
        uuids = (*variant.passes, *[p.uuid() for p in variant.inductor_passes])
        disk = self.cache is not None and not any(" at 0x" in part for part in (options, *uuids))
        if self.lower.backend == "inductor":
            parts.append(f"build={self._build_part(piece)}")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest(), disk

    def options(self, piece: Piece, variant: Variant) -> dict[str, Any]:
        """The backend options of this compile: what the variant's graph passes need
        (``GraphPass.inductor_options``), ``Lower``'s for the binding over them, and for a static
        Inductor variant that may go without them, ``size_asserts=False`` (see ``drop_size_asserts``)."""
        options = self.lower.options_for(variant.binding)
        if self.lower.backend == "inductor" and variant.inductor_options:  # what graph passes need; the user's win
            options = {**dict(variant.inductor_options), **options}
        if self.lower.backend == "inductor" and self.lower.lean and drop_size_asserts(piece, variant, options):
            options["size_asserts"] = False
        return options

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    # -- compiling -------------------------------------------------------------------------
    def compile(self, piece: Piece, variant: Variant, *, wait: bool = True,
                workers: WorkerPool | None = None) -> Variant | None:
        """``variant`` compiled (or reused, or loaded), with its report row. With ``wait=False``,
        None when another process holds its cache key's lock (it is compiling it: come back later).
        ``workers``: the pool a worker's artifact came from (default: the running ``compile_all``'s)."""
        workers = workers or self.workers
        lower = self.lower
        names = piece.shapes.names if piece.shapes else {}
        t0 = time.perf_counter()
        source, error = "compiled", None
        key, disk = None, False
        compiled_by: int | None = self.rank
        piece = piece.as_compiled_for(variant)  # the variant's own graph, where graph passes rewrote it
        if variant.inductor_passes and lower.backend != "inductor":
            raise ConfigError(f"inductor passes ({', '.join(p.spec() for p in variant.inductor_passes)}) run inside "
                              f"Inductor, but Lower's backend is {lower.backend_name!r}: use backend='inductor'")

        def compile_it() -> Callable[..., Any]:
            restore_values(piece.gm)  # a loaded graph's inner values, which its save left out
            options = self.options(piece, variant)
            if variant.inductor_passes:
                options["post_grad_custom_post_pass"] = _compat.post_grad_pass(variant.inductor_passes)
            return lower_variant(piece, variant, lower.backend, options)

        try:
            key, disk = self.variant_key(piece, variant)
            if key is None:
                with _compat.compile_lock():
                    fn = compile_it()
            else:
                # Dynamo's lock first (compiles patch process-wide state: one at a time, and
                # never during a Dynamo trace), then this key's (one compile per key).
                with _compat.compile_lock(), self._key_lock(key):
                    memo = self._memo.get(key) if lower.dedupe else None
                    if memo is not None:
                        (fn, compiled_by), source = memo, "reused"
                    elif disk:
                        info = {"piece": piece.name, "binding": variant.binding.describe(names),
                                "backend": self.backend_id, "rank": self.rank}
                        got = self.cache.compile_or_load(key, compile_it, info, wait=wait)
                        if got is None:
                            return None
                        fn, source = got
                        if source == "cache" and workers is not None and workers.outcome(key) == "compiled":
                            source = "worker"  # compiled for this session in a worker process, loaded here
                        if source == "cache" and self.world > 1:
                            compiled_by = self.cache.compiled_by(key)
                    else:
                        fn = compile_it()
                    if lower.dedupe:
                        self._memo[key] = (fn, compiled_by)
        except Exception as e:  # noqa: BLE001 - reported with context below
            hint = ""
            if "DataDependent" in type(e).__name__ or "DataDependent" in str(e) or reads_item_values(piece.gm):
                hint = (" (the piece reads a tensor's value: .item(), nonzero, a data-dependent size, which a "
                        "compile from example inputs cannot; pass on_compile_error='fallback' to run this piece "
                        "eagerly, or register the op that does it as a splitting op)")
            msg = (f"compiling {piece.name} for {variant.binding.describe(names)} with backend "
                   f"{lower.backend_name!r} failed{hint}: {type(e).__name__}: {e}")
            if lower.on_compile_error != "fallback":
                raise CompileError(msg, reads_values=bool(hint)) from e
            log.warning("shapewise: %s; running this variant eagerly instead", msg)
            fn, source, error = piece.gm.forward, "fallback", f"{type(e).__name__}: {e}"
        # A rewritten graph's nodes carry no fake values to decide from: it keeps its wrappers.
        lean = lean_call(fn, piece, variant) if source != "fallback" and lower.backend == "inductor" and lower.lean \
            and variant.gm is None else None
        fn = lean or fn
        asserts = None
        if source != "fallback" and lower.backend == "inductor":
            asserts = self.options(piece, variant).get("size_asserts", True) is not False
            fn = _with_layouts(fn, self.layouts(piece, variant))
        report = {
            "piece": piece.name,
            "key": variant.binding.describe(names),
            "static": variant.binding.is_static,
            "seconds": time.perf_counter() - t0,
            "source": source,
            "backend": lower.backend_name,
            "artifact": key[:12] if key else None,
            "lean": lean is not None,
            "size_asserts": asserts,
            "passes": ", ".join(variant.pass_labels),
        }
        if self.world > 1:  # which rank compiled the artifact (None: not recorded); a fallback runs here
            report["rank"] = self.rank if source == "fallback" else compiled_by
        if error:
            report["error"] = error
        out = dataclasses.replace(variant, compiled=fn, report=report, artifact_key=(key, disk) if key else None)
        with self._lock:
            self.counts[source] += 1
            self.results[(piece.name, variant.binding)] = out
        return out

    def layouts(self, piece: Piece, variant: Variant) -> tuple:
        """The input layouts the runner checks before an Inductor variant (``LAYOUTS_ATTR``): none
        where Inductor asserts them itself."""
        piece = piece.as_compiled_for(variant)
        return () if self.options(piece, variant).get("size_asserts", True) is not False else expected_layouts(variant)

    def compile_all(self, pieces: Sequence[Piece], now: Mapping[Any, int] | None = None) -> tuple[Piece, ...]:
        """Every variant of every compute piece, with a progress bar and a summary log line. With
        compile workers and the traced sizes ``now`` (None: none traced), what workers compile is left
        to them, loaded on first use (``shapewise.lower.parallel``), unless ``Lower.wait_for_workers``."""
        todo = sum(len(p.variants) for p in pieces if not p.is_splitting)
        t0 = time.perf_counter()
        before = dict(self.counts)
        done: dict[tuple[int, int], Variant] = {}
        order, sent = self._order(pieces), {}
        workers = resolve_workers(self.lower.compile_workers)
        # (a variant that falls back to eager when its compile fails is not left pending: the runner, built
        # now, would take its outputs for a compiled piece's and skip the layout checks eager's need)
        wait = self.lower.wait_for_workers
        defer = now is not None and wait is not True and self.lower.on_compile_error != "fallback"
        eager = defer and wait == "never"  # the traced size's go to the workers too, run eagerly meanwhile
        if now is not None and wait == "never" and (why := eager_refused(self, workers)):
            log.warning("shapewise: wait_for_workers='never', but this trace's variants compile here: %s", why)
        if workers > 1:
            order, sent = start_workers(self, pieces, order, workers, now if defer else None, keep_now=not eager)
        pool, config = self.workers, _compat.inductor_config_kept() if sent and defer else None
        with self.progress(todo) as bar, contextlib.ExitStack() as stack:
            if pool is not None:
                stack.callback(self._stop_workers, frozenset(sent.values()) if defer else frozenset())
            later = []
            for i, j in order:  # never waiting for another rank: what one holds comes later
                if defer and (i, j) in sent:
                    done[i, j] = pending_variant(self, pieces[i], pieces[i].variants[j], sent[i, j], pool, config,
                                                 eager)
                    bar.update(1)
                    continue
                v = self.compile(pieces[i], pieces[i].variants[j], wait=self.world == 1)
                if v is None:
                    later.append((i, j))
                    continue
                done[i, j] = v
                bar.update(1)
            for i, j in later:  # by now compiled by their holders (or being: their locks wait), loaded here
                done[i, j] = self.compile(pieces[i], pieces[i].variants[j])
                bar.update(1)
        out = tuple(p if p.is_splitting else dataclasses.replace(
            p, variants=tuple(done[i, j] for j in range(len(p.variants)))) for i, p in enumerate(pieces))
        if todo:
            log.info("%s", summary_line({k: self.counts[k] - before.get(k, 0) for k in SOURCES},
                                        time.perf_counter() - t0))
        return out

    def _stop_workers(self, keep: frozenset = frozenset()) -> None:
        workers, self.workers = self.workers, None
        workers.close(keep)

    def _order(self, pieces: Sequence[Piece]) -> list[tuple[int, int]]:
        """(piece, variant) positions in compile order. Alone: in order. On ``world`` ranks of
        torch.distributed sharing the disk cache, the work is divided and balanced: the distinct
        content keys are dealt out round-robin, each rank takes its share first, then the others'
        shares from their far ends (work stealing: a key nobody has started is compiled here, one
        whose lock another rank holds is skipped, and ``compile_all`` loads it at the end)."""
        items = [(i, j) for i, p in enumerate(pieces) if not p.is_splitting for j in range(len(p.variants))]
        if self.world == 1 or self.cache is None:
            return items
        keys = {(i, j): self.variant_key(pieces[i].as_compiled_for(pieces[i].variants[j]),
                                         pieces[i].variants[j])[0] for i, j in items}
        distinct = list(dict.fromkeys(k for k in keys.values() if k is not None))
        owner = {k: n % self.world for n, k in enumerate(distinct)}
        rank = {k: n for n, k in enumerate(distinct)}

        def place(ij: tuple[int, int]) -> tuple[int, int]:
            k = keys[ij]
            if k is None or owner[k] == self.rank:
                return (0, rank.get(k, -1))
            return ((owner[k] - self.rank) % self.world, -rank[k])  # the next rank's share first, from its end

        return sorted(items, key=place)

    def compile_binding(self, pieces: Iterable[Piece], binding: Binding) -> dict[str, Callable[..., Any]]:
        """Compile every compute piece's variant for ``binding``: {piece name: callable};
        splitting pieces (and pieces without such a variant) run as they are."""
        out = {}
        for p in pieces:
            v = None if p.is_splitting else p.variant_for(binding)
            out[p.name] = (p.call or p.gm.forward) if v is None else self.compile(p, v).compiled
        return out

    def progress(self, total: int):
        """A tqdm bar over ``total`` variants: shown on a terminal (``progress=None``), always
        (``True``) or never (``False``); quiet for fewer than two variants."""
        from tqdm import tqdm

        want = self.lower.progress
        show = total >= 2 and (want is True or (want is None and sys.stderr.isatty()))
        return tqdm(total=total, disable=not show, desc="shapewise", unit="variant", leave=False)


def _with_layouts(fn: Callable[..., Any], layouts: tuple) -> Callable[..., Any]:
    """``fn`` carrying ``LAYOUTS_ATTR`` (for the runner); wrapped where it takes no attribute."""
    try:
        setattr(fn, LAYOUTS_ATTR, layouts)
        return fn
    except (AttributeError, TypeError):
        def call(*args: Any) -> Any:
            return fn(*args)

        call.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(call, LAYOUTS_ATTR, layouts)
        return call


@register_pass
@dataclass(frozen=True)
class Lower(Pass):
    """Compile each variant: ``backend`` is "inductor", "eager", "aot_eager" or a
    ``callable(gm, example_inputs) -> callable``.

    ``options`` go to every Inductor compile; ``static_options`` only to single-size variants
    (e.g. ``{"max_autotune": True}``) and ``range_options`` only to range variants.
    ``on_compile_error="fallback"`` runs a variant that fails to compile eagerly instead.

    ``compile``: ``"eager_all"`` (every variant now), ``"lazy"`` (each binding on its first
    call) or ``"background"`` (calls served at once by a general dynamic variant, or eagerly
    until that is ready, while the variants compile in a background thread).
    ``dedupe``: pieces with the same content share one artifact per binding.
    ``cache``: None (the default folder unless ``SHAPEWISE_CACHE=0``), False, True or a folder;
    only Inductor artifacts are cached. ``progress``: None (a bar on a terminal), True, False.
    ``compile_workers``: processes that compile the static Inductor variants at the same time as
    this one compiles the rest (``shapewise.lower.workers``; through the disk cache, so only with
    one); ``"auto"`` (the default): from the CPUs (``default_workers``: none below 8 CPUs), or
    ``SHAPEWISE_COMPILE_WORKERS`` where that is set; 1: none. What workers compile
    is loaded on first use, the trace's own size compiled here (``shapewise.lower.parallel``);
    ``wait_for_workers=True`` (and always with ``on_compile_error="fallback"``): every variant before
    the compile returns; ``"never"``: the traced size's too go to the workers (queued first), and each
    pending variant's calls run its graph eagerly until its worker is done (``EagerStandIn``; CUDA graphs
    capture a size once its variants are all in): the first call waits for no compile a worker can take
    (not ranges, graphs reading values, Inductor passes; none without workers or cache: a warning).
    ``lean``: call Inductor inference artifacts past AOTAutograd's runtime wrappers where those
    have nothing to do (see ``lean_call``; the report's ``lean`` column says where), compile
    static pieces without Inductor's input asserts (the runner checks what needs it, see
    ``drop_size_asserts``; the ``size_asserts`` column) and call splitting custom ops past
    their dispatch where it has no work (``lean_splitting_call``); False: none of these.
    """

    name: ClassVar[str] = "lower"
    backend: Any = "inductor"
    options: Any = ()
    static_options: Any = ()
    range_options: Any = ()
    on_compile_error: str = "raise"
    compile: str = "eager_all"
    cache: Any = None
    dedupe: bool = True
    progress: Any = None
    lean: bool = True
    compile_workers: Any = "auto"
    wait_for_workers: bool | str = False

    def __post_init__(self) -> None:
        if not callable(self.backend) and self.backend not in BACKENDS:
            raise ConfigError(
                f"unknown backend {self.backend!r}: use one of {BACKENDS} or a callable(gm, example_inputs)")
        if self.on_compile_error not in ("raise", "fallback"):
            raise ConfigError(f"on_compile_error must be 'raise' or 'fallback', got {self.on_compile_error!r}")
        if self.compile not in COMPILE_MODES:
            raise ConfigError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if not isinstance(self.cache, (type(None), bool, str, os.PathLike, ArtifactCache)) or self.cache == "":
            raise ConfigError(f"cache must be None (default), True, False or a folder path, got {self.cache!r}")
        if not isinstance(self.lean, bool):
            raise ConfigError(f"lean must be True or False, got {self.lean!r}")
        if not (isinstance(self.wait_for_workers, bool)
                or self.wait_for_workers == "never" and self.compile == "eager_all"):
            raise ConfigError(f"wait_for_workers must be True, False or 'never' (with compile='eager_all': a lazy or "
                              f"background compile runs here), got {self.wait_for_workers!r}, compile={self.compile!r}")
        if not isinstance(self.dedupe, bool):
            raise ConfigError(f"dedupe must be True or False, got {self.dedupe!r}")
        if self.progress not in (None, True, False):
            raise ConfigError(f"progress must be None (auto: on a terminal), True or False, got {self.progress!r}")
        if not (self.compile_workers == "auto" or type(self.compile_workers) is int and self.compile_workers >= 1):
            raise ConfigError(f"compile_workers must be a number of processes >= 1 (1: compile here, one variant "
                              f"after another) or 'auto' (from the CPUs), got {self.compile_workers!r}")
        for f in ("options", "static_options", "range_options"):
            v = getattr(self, f)
            object.__setattr__(self, f, tuple(sorted(dict(v).items())) if v else ())

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "callable")

    @property
    def deferred(self) -> bool:
        """True when variants compile after this pass (lazy or background)."""
        return self.compile != "eager_all"

    def options_for(self, binding: Binding) -> dict[str, Any]:
        extra = self.static_options if binding.is_static else self.range_options
        return {**dict(self.options), **dict(extra)}

    def requires(self, program: Program) -> Sequence[Pass | str]:
        return [] if program.bindings is not None else ["concretize"]

    def session(self) -> CompileSession:
        """A fresh compile session (dedupe memo, cache, counters) for this pass's options."""
        return CompileSession(self)

    def compile_variant(self, piece: Piece, variant: Variant, session: CompileSession | None = None) -> Variant:
        """Compile one variant (through ``session`` when given: dedupe and cache)."""
        return (session or self.session()).compile(piece, variant)

    def apply(self, program: Program, session: CompileSession | None = None) -> Program:
        """The variants compiled (in ``session``: one that knows their keys, for a loaded program)."""
        if self.lean:  # splitting pieces that are one custom op's call: called past its dispatch where it has no work
            program = program.replace(pieces=tuple(
                dataclasses.replace(p, call=lean_splitting_call(p)) if p.is_splitting else p for p in program.pieces))
        if self.deferred:  # compiled by the dispatch, in a session of its own (see BuildDispatch)
            pieces = tuple(p if p.is_splitting else dataclasses.replace(
                p, variants=tuple(dataclasses.replace(v, compiled=None, report=self._pending_row(p, v))
                                  for v in p.variants)) for p in program.pieces)
        else:
            now = dict(program.shapes.hints) if program.shapes is not None else None
            pieces = (session or self.session()).compile_all(program.pieces, now=now)
        return program.replace(pieces=pieces, lowering=self)

    def _pending_row(self, piece: Piece, variant: Variant) -> dict[str, Any]:
        return {"piece": piece.name, "key": variant.binding.describe(piece.shapes.names if piece.shapes else {}),
                "static": variant.binding.is_static, "seconds": 0.0, "source": "pending",
                "backend": self.backend_name, "artifact": None}

