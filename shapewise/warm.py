"""Warm starts: ``sw.compile(model, ..., warm_start=True)`` (and ``compile_generate``) save each
Dynamo trace whole, and the next start loads them instead of tracing.

Each trace is made by torch's ``aot_compile`` (``_compat.aot_trace``: Dynamo's full-graph capture,
its guards and its bytecode, which torch can save) with shapewise's pipeline as the backend; what
the backend returns, the ``Runnable``, saves its program (``dispatch.saved``: the graphs, shape
facts, plans and artifact keys, not the compiled code). After each new trace, the model's traces
are written together as one file of the artifact cache, under a key of everything that can change
the answer: the torch / Triton / CUDA build and the GPUs, Inductor's config, shapewise's version
and options, the model's class and config, grad mode. Loading checks the file as every cache file
is checked, then each trace's traced source lines (a model whose code changed since is traced
again), and lowers each program again from the artifact cache by its saved keys (a missing
artifact compiles). A call runs the first trace whose guards pass (Dynamo's own guards, loaded
with it); a call no trace serves traces again and the file is written anew.

Anything that goes wrong (no key: an option that is a live object; a file from another build, a
broken one, a changed model; a program that does not save) is a cold start with a log line saying
why, never a failed call. ``ShapewiseModule.warm_info`` says what happened.

Direct calls (``direct_call=True``, ``shapewise.direct``) work as after a trace: each trace's is
built at its first call, from where its inputs come from in a call (the saved program keeps each
input's Dynamo ``Source``, which that call's arguments resolve) and what the trace sets in Python
state (saved with it: constants, and a tensor's previous value by its metadata; a trace that sets an
attribute that held another object has none, and ``direct_info`` says why).

Limits: models given as a module, a function or a bound method; the disk cache must be on.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shapewise import _compat
from shapewise.dispatch.saved import NotSaved
from shapewise.lower.cache import CacheCorrupt, resolve_cache
from shapewise.version import __version__

__all__ = ["FORMAT", "WarmTraces"]

log = logging.getLogger("shapewise")

FORMAT = "shapewise-warm/2"
SECTION = "traces"


def _config_text(model: Any) -> str:
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json):
        try:
            return to_json(use_diff=False)
        except Exception:  # noqa: BLE001 - a config that will not print is keyed by its repr
            pass
    return repr(config) if config is not None else ""


# Options that change how the compiles run, not what they make: not in a saved trace's key.
_HOW_NOT_WHAT = ("progress", "compile_workers", "wait_for_workers")


class WarmTraces:
    """The saved traces of one compiled model: ``load()`` once, ``serve()`` per call, ``trace()``
    for a call none serves (then ``save()``). ``info``: what happened, for ``warm_info``."""

    def __init__(self, model: Any, options: Mapping[str, Any], dynamic_dims: Any) -> None:
        self.model = model
        self.traces: list[Any] = []  # _compat.AOTTrace, most recent last
        self.fixed: list[dict[str, int | None]] = []
        #: Per trace, what it sets in Python state (``_saved_effects``), for its direct call.
        self.effects: list[Any] = []
        #: ``(index, trace, effects, args, kwargs)`` before a trace's first call (the module's direct
        #: calls: ``install_direct``); None: nothing to do.
        self.first_call: Callable[..., None] | None = None
        self._called: set[int] = set()
        self._lock = threading.Lock()
        self.loaded_from: str | None = None
        self.info = "warm start: nothing saved or loaded yet"
        self.tried = False  # load() ran (the calls after need no lock to know it)
        # The traced function's own first argument: the module (its forward traced), a bound method's self.
        self.owner = model.__self__ if inspect.ismethod(model) else model
        self._self = (self.owner,) if isinstance(model, torch.nn.Module) or inspect.ismethod(model) else ()
        self.cache = resolve_cache(options.get("cache"))
        self.key, why = self._key(options, dynamic_dims)
        if why is not None:
            self.info = f"warm start off: {why}"
            log.info("shapewise: %s", self.info)

    def _key(self, options: Mapping[str, Any], dynamic_dims: Any) -> tuple[str | None, str | None]:
        if not _compat.HAS_AOT_COMPILE:
            return None, f"torch {torch.__version__} has no torch._dynamo.aot_compile"
        if self.cache is None:
            return None, "the disk cache is off (cache=False or SHAPEWISE_CACHE=0): traces are saved there"
        model = self.owner
        if not isinstance(self.model, torch.nn.Module) and not inspect.isfunction(self.model) \
                and not inspect.ismethod(self.model):
            return None, f"the model is a {type(self.model).__name__}, not a module, a function or a method"
        opts = repr(sorted((k, v) for k, v in options.items() if k not in _HOW_NOT_WHAT))
        if " at 0x" in opts or " at 0x" in repr(dynamic_dims):
            return None, "an option is a live object with no stable identity (a callable, an instrument)"
        devices = sorted({str(p.device) for p in model.parameters()} if isinstance(model, torch.nn.Module) else ())
        cls = type(model) if isinstance(model, torch.nn.Module) else model
        parts = [FORMAT, f"shapewise={__version__}", f"build={sorted(_compat.build_fingerprint(devices).items())}",
                 f"inductor={_compat.inductor_config_fingerprint()}",
                 f"model={getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}",
                 f"config={_config_text(model)}", f"options={opts}", f"dims={dynamic_dims!r}",
                 f"grad={torch.is_grad_enabled()}"]
        autocast = _compat.autocast_state()
        if autocast:  # compiled code bakes autocast in (see ``_compat.autocast_state``)
            parts.append(f"autocast={autocast}")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest(), None

    @property
    def enabled(self) -> bool:
        return self.key is not None

    # -- loading ---------------------------------------------------------------------------
    def load(self) -> list[tuple[Any, dict[str, int | None]]]:
        """The saved traces' (Runnable, fixed dims), once (later calls: []); [] on a cold start."""
        if self.tried or not self.enabled:
            return []
        self.tried = True
        path = self.cache.path(self.key)
        t0 = time.perf_counter()
        try:
            entry = self.cache.read(self.key, section=SECTION)
            if entry is None:
                self.info = "cold start: no saved traces for this model and options yet"
                return []
            saved = pickle.loads(entry.sections[SECTION])
            traces = [_compat.load_aot_trace(data, self.model) for data, _, _ in saved]
            changed = [c for t in traces for c in t.changed_sources()]
            if changed:
                raise CacheCorrupt(f"the model's code changed since its traces were saved ({', '.join(changed[:4])})")
        except Exception as e:  # noqa: BLE001 - whatever it is, a cold start, and the file is replaced
            why = str(e) if isinstance(e, CacheCorrupt) else f"{type(e).__name__}: {str(e)[:300]}"
            self.info = f"cold start: the saved traces in {path} are unusable: {why}"
            log.warning("shapewise: %s; tracing again", self.info)
            self.cache.remove(self.key)
            return []
        self.traces = traces
        self.fixed = [dict(fixed) for _, fixed, _ in saved]
        self.effects = [effects for _, _, effects in saved]
        self.loaded_from = str(path)
        self.info = (f"warm start: {len(traces)} trace(s) loaded from {path} in {time.perf_counter() - t0:.2f} s "
                     "(no Dynamo trace)")
        log.info("shapewise: %s", self.info)
        return [(t.compiled, f) for t, f in zip(traces, self.fixed)]

    # -- calls -----------------------------------------------------------------------------
    def serve(self, args: tuple, kwargs: dict, miss: Any) -> Any:
        """The output of the most recent trace whose guards pass, or ``miss``."""
        full = (*self._self, *args)
        for i in range(len(self.traces) - 1, -1, -1):
            t = self.traces[i]
            if t.check(*full, **kwargs):
                if i not in self._called:
                    with self._lock:  # (two first calls at once: one builds its direct call)
                        if i not in self._called:
                            self._first(i, full, kwargs)
                return t(*full, **kwargs)
        return miss

    def trace(self, args: tuple, kwargs: dict, backend: Callable[..., Any]) -> Any:
        """A new trace of this call (Dynamo, then ``backend``), kept; returns the call's output."""
        fn = self.model
        t = _compat.aot_trace(fn, args, kwargs, backend)
        self.traces.append(t)
        self.effects.append(_saved_effects(_compat.captured_side_effects()))
        full = (*self._self, *args)
        self._first(len(self.traces) - 1, full, kwargs)
        return t(*full, **kwargs)

    def _first(self, i: int, full: tuple, kwargs: dict) -> None:
        self._called.add(i)
        if self.first_call is not None:
            self.first_call(i, self.traces[i], _loaded_effects(self.effects[i]), full, kwargs)

    def forget(self, count: int) -> None:
        """Drop the traces past the first ``count`` (a trace the caller refused after it was made)."""
        del self.traces[count:], self.effects[count:]
        self._called = {i for i in self._called if i < count}

    # -- saving ----------------------------------------------------------------------------
    def save(self, fixed: list[dict[str, int | None]]) -> None:
        """Write every trace (with each one's fixed dims) as the model's file; a trace that does
        not save leaves the file as it was, with a log line saying why."""
        if not self.enabled:
            return
        self.fixed = [dict(f) for f in fixed]
        try:
            data = pickle.dumps([(t.dumps(), f, e) for t, f, e in zip(self.traces, self.fixed, self.effects)])
            path = self.cache.write(self.key, {SECTION: data}, {"what": "shapewise traces", "traces": len(self.traces)})
        except NotSaved as e:
            self.info = f"warm start: not saved: {e}"
            log.info("shapewise: %s", self.info)
            return
        except Exception as e:  # noqa: BLE001 - a failed save costs the next start its warmth, nothing else
            self.info = f"warm start: not saved: {type(e).__name__}: {str(e)[:300]}"
            log.warning("shapewise: %s", self.info)
            return
        self.info = f"warm start: {len(self.traces)} trace(s) saved to {path}" + (
            f" (loaded from it: {self.loaded_from})" if self.loaded_from else "")


# -- direct calls of warm traces ---------------------------------------------------------------

_SENTINELS = {"stored tensor": _compat.STORED_TENSOR, "not set": _compat.NOT_SET}
_PLAIN = (type(None), bool, int, float, str)


def _saved_effects(effects: Any) -> Any:
    """``trace_side_effects`` as it saves: ``[(source, attr, new, before), ...]`` (the object set
    is found again from its source on load; the markers by name), or why it cannot be (a str)."""
    if effects is None:
        return "what the trace sets in Python state is not known (torch did not say)"
    if isinstance(effects, str):
        return effects
    from shapewise.direct_checks import tensor_meta

    out, names = [], {id(v): k for k, v in _SENTINELS.items()}
    for source, attr, new, was, _obj in effects:
        if isinstance(was, torch.Tensor):
            was = ("shapewise", "tensor", tensor_meta(was))  # as the direct call checks it: by its metadata
        elif id(was) in names:
            was = ("shapewise", names[id(was)])
        elif type(was) not in _PLAIN:
            return f"the trace sets {attr!r}, which was a {type(was).__name__} (a constant's or a tensor's " \
                   "previous value saves)"
        item = (source, attr, ("shapewise", names[id(new)]) if id(new) in names else new, was)
        try:
            pickle.dumps(item)
        except Exception as e:  # noqa: BLE001 - said in direct_info; the trace still saves
            return f"what the trace sets in Python state does not save ({type(e).__name__}: {e})"
        out.append(item)
    return out


def _loaded_effects(saved: Any) -> Any:
    if isinstance(saved, str):
        return saved

    from shapewise.direct_checks import tensor_before

    def value(v: Any) -> Any:
        if type(v) is tuple and len(v) >= 2 and v[0] == "shapewise":
            return tensor_before(v[2]) if v[1] == "tensor" else _SENTINELS[v[1]]
        return v

    return [(source, attr, value(new), value(was)) for source, attr, new, was in saved]


def direct_installer(compiled: Any) -> Callable[..., None]:
    """``WarmTraces.first_call`` for a ``ShapewiseModule`` with direct calls: ``install_direct``."""
    from shapewise.direct import bound_module

    def first_call(index: int, trace: Any, effects: Any, full: tuple, kwargs: dict) -> None:
        # The trace's own runnable (what its bytecode calls), and what keeps any direct call off
        # (on_miss past the guards, lazy compiles), as after a trace.
        install_direct(compiled._directs, index, trace, compiled._direct_off() or effects, trace.compiled, full,
                       kwargs, bound_module(compiled.model), compiled._source_positional, compiled._var_names,
                       compiled._signature.parameters)

    return first_call


def install_direct(directs: Any, index: int, trace: Any, effects: Any, runnable: Any, full: tuple, kwargs: dict,
                   module: Any, positional: Any, var_names: Any, keywords: Any) -> None:
    """Build trace ``index``'s direct call from this, its first call (``shapewise.direct``: what
    ``build_direct_call`` takes after a trace, with the call's own objects as the example inputs),
    and have the trace record its outputs for the call that arms it."""
    from shapewise.direct import build_direct_call

    built: Any = effects if isinstance(effects, str) else None
    gm = runnable.program.gm
    sources = [_compat.placeholder_source(n) for n in gm.graph.nodes if n.op == "placeholder"]
    if built is None and any(s is None for s in sources):
        built = "the saved trace does not say where each of its inputs comes from"
    if built is None:
        try:
            examples = trace.source_values(sources, full, kwargs)
            objects = trace.source_values([e[0] for e in effects], full, kwargs)
        except LookupError as e:
            built = f"an input of the trace is not found in the call ({e})"
        else:
            side = [(*e, obj) for e, obj in zip(effects, objects)]
            built = build_direct_call(gm, examples, runnable, module, positional, var_names, keywords, side)
    trace.call_through(directs.add_trace(index, built, runnable))
