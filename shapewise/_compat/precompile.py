"""Saving what a compile made, with torch's own machinery: fx graphs with their fake values
(``torch.fx._graph_pickler.GraphPickler``, what Inductor's and AOTAutograd's caches use) and
Dynamo's output with its guards (``torch._dynamo.aot_compile``: the capture, its guards and its
bytecode, saved and loaded; what ``torch.compile(...).aot_compile`` and
``torch.compiler.load_compiled_function`` are built on). Both exist in torch 2.11 and 2.13;
``HAS_AOT_COMPILE`` says whether this torch has the second."""

from __future__ import annotations

import contextlib
import functools
import importlib
import pickle
import re
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shapewise._compat.dynamo import SOURCE_META
from shapewise._compat.inductor import autocast_as, autocast_state

__all__ = ["HAS_AOT_COMPILE", "AOTTrace", "SerializableCallable", "TraceNotSaved", "aot_trace", "captured_side_effects",
           "compiles_as_usual", "graph_dumps", "graph_loads", "guard_stand_in", "load_aot_trace", "recompile_loaded"]

try:  # torch >= 2.10
    from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph
    from torch._dynamo.aot_compile_types import SerializableCallable
    from torch._dynamo.hooks import Hooks

    HAS_AOT_COMPILE = True
except ImportError:  # pragma: no cover - older torch
    HAS_AOT_COMPILE = False

    class SerializableCallable:  # type: ignore[no-redef]
        """Stand-in base where torch has no ``aot_compile_types``."""


class TraceNotSaved(RuntimeError):
    """torch traced and compiled the call but cannot package the trace (its guards or its code
    hold something that does not save); the message says what. Trace it the usual way instead."""


_DROPPED_META: frozenset[str] = frozenset({SOURCE_META})  # a Dynamo Source: the trace's, not the graph's
# What precompile has turned on in this thread (``_turned_on``): "saving" (``guard_stand_in``), and
# the torch patches' "builtins" and "sources" (``_wrap_once``).
_ON = threading.local()


@contextlib.contextmanager
def _turned_on(flag: str) -> Any:
    was = getattr(_ON, flag, False)
    setattr(_ON, flag, True)
    try:
        yield
    finally:
        setattr(_ON, flag, was)


class _StandIn:
    """What a live shapewise object (a compiled model set as ``model.forward``) is in a saved trace's
    guard state: torch pickles the traced module's attributes, and guards never read this one."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}, not saved>"


def guard_stand_in(obj: Any) -> tuple[Any, tuple[Any, ...]]:
    """``__reduce__`` for live objects a model may hold: a stand-in while ``aot_trace`` saves its
    guards, else a TypeError that says what to do."""
    if getattr(_ON, "saving", False):
        return _StandIn, (type(obj).__name__,)
    raise TypeError(f"a {type(obj).__name__} does not pickle: it holds compiled code; save its traces with "
                    "warm_start=True instead")


def _options() -> Any:
    from torch.fx import _graph_pickler as gp

    safe = gp._node_metadata_key_filter_safe
    # Every op is allowed (custom ops are looked up by name on load: their library must be imported).
    return gp.Options(ops_filter=None, node_metadata_key_filter=lambda k: k not in _DROPPED_META and safe(k))


def graph_dumps(obj: Any, gms: Any = ()) -> bytes:
    """``obj`` (GraphModules, fake tensors, SymInts, sympy, plain data inside) as bytes. ``gms``: the
    GraphModules in it, whose nodes' fake values that are views are saved as plain tensors of the
    same layout (a view's description holds its base in Dynamo's fake mode, which does not pickle)."""
    from torch.fx._graph_pickler import GraphPickler

    with _views_detached(gms):
        return GraphPickler.dumps(obj, _options())


@contextlib.contextmanager
def _views_detached(gms: Any) -> Any:
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensor

    def detach(v: Any) -> Any:
        if not isinstance(v, FakeTensor) or not v._is_view():
            return v
        with v.fake_mode:
            out = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        return out.requires_grad_(v.requires_grad) if v.requires_grad and v.is_leaf else out

    swapped = []
    for gm in gms:
        for m in gm.modules():
            if not isinstance(m, torch.fx.GraphModule):
                continue
            for node in m.graph.nodes:
                for k in ("example_value", "val"):
                    if k in node.meta:
                        new = pytree.tree_map(detach, node.meta[k])
                        swapped.append((node.meta, k, node.meta[k]))
                        node.meta[k] = new
    try:
        yield
    finally:
        for meta, k, v in reversed(swapped):
            meta[k] = v


def graph_loads(data: bytes) -> Any:
    """What ``graph_dumps`` saved; fake values come back in one fresh fake mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler, _NodePickleData
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    _wrap_once(_NodePickleData, "unpickle", _nodes_mapped_directly)
    with _turned_on("nodes"):
        return GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))


class _Unusual(Exception):
    """An argument of a kind ``_mapped`` leaves to pytree."""


def _nodes_mapped_directly(unpickle: Callable[..., Any]) -> Callable[..., Any]:
    """GraphPickler's node unpickle, whose arguments (tuples, lists, dicts, slices of saved nodes
    and constants) are mapped to the new nodes directly instead of through pytree: pytree's
    generality took 1.1 of the 1.8 s a 16-layer warm start spent unpickling its graphs (2-core
    CPU). Any other kind of argument, or a node laid out otherwise, goes through torch's own."""
    from torch.fx._graph_pickler import _NodePickleData

    def unpickle_node(self: Any, graph: Any, mapping: Any, unpickle_state: Any) -> Any:
        if not getattr(_ON, "nodes", False):
            return unpickle(self, graph, mapping, unpickle_state)
        try:
            args = _mapped(self.args, mapping, _NodePickleData)
            kwargs = _mapped(self.kwargs, mapping, _NodePickleData)
            target = self.target.unpickle(unpickle_state)
            op, name, type_, meta = self.op, self.name, self.type, self.meta
        except (_Unusual, AttributeError):
            return unpickle(self, graph, mapping, unpickle_state)
        if not (callable(target) or isinstance(target, str)):
            return unpickle(self, graph, mapping, unpickle_state)  # torch's own says what is wrong
        node = graph.create_node(op, target, args, kwargs, name, type_)
        node.meta = meta
        return node

    return unpickle_node


_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _mapped(x: Any, mapping: Any, node_type: type) -> Any:
    """``x`` with each saved node replaced by its new node, as ``pytree.tree_map_only`` maps it."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    t = type(x)
    if t is node_type:
        return mapping[x]
    if t in _LEAVES:
        return x
    if t is tuple:
        return tuple(_mapped(v, mapping, node_type) for v in x)
    if t is list or t is immutable_list:
        return t(_mapped(v, mapping, node_type) for v in x)
    if t is dict or t is immutable_dict:
        return t((k, _mapped(v, mapping, node_type)) for k, v in x.items())
    if t is slice:
        return slice(*(_mapped(v, mapping, node_type) for v in (x.start, x.stop, x.step)))
    raise _Unusual(t.__name__)


def compiles_as_usual() -> Any:
    """A context for compiles made while torch loads a saved trace: it loads the backend's callable
    with ``enable_autograd_for_aot`` on, under which Inductor's artifacts do not save."""
    from torch._inductor import config

    return config.patch(enable_autograd_for_aot=False) if hasattr(config, "enable_autograd_for_aot") else \
        contextlib.nullcontext()


def recompile_loaded(gm: torch.fx.GraphModule, *, lazy: bool = False) -> None:
    """Give a GraphModule ``graph_loads`` made (and its GraphModule submodules) their ``forward``
    again (GraphPickler restores the graph, not the code generated from it), and each node the
    ``example_value`` Dynamo gave it, as its saved ``val`` (AOTAutograd's cache reads it). With
    ``lazy``, the code is generated at the first call of ``forward`` (a graph a warm start keeps
    for its facts, or for a compile its cached artifact makes unneeded, is never run)."""
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            for node in m.graph.nodes:
                if "val" in node.meta:
                    node.meta.setdefault("example_value", node.meta["val"])
            if "forward" in type(m).__dict__:
                continue  # done already: a submodule of a graph given before (a stitching graph's piece)
            if lazy:
                type(m).forward = _forward_on_first_call  # (its own class: GraphModule makes one per instance)
            else:
                m.recompile()


def _forward_on_first_call(self: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    if type(self).forward is _forward_on_first_call:
        self.recompile()  # sets its class's forward to the generated one
    return type(self).forward(self, *args, **kwargs)


_AOT_PATCHED = ("strict_autograd_cache", "bypass_autograd_cache_key", "bundled_autograd_cache",
                "force_non_lazy_backward_lowering", "force_autograd_cache")


class AOTTrace:
    """One Dynamo trace made ahead of its call, savable: ``check(*args, **kwargs)`` runs its guards,
    ``__call__`` its bytecode (which calls the backend's callable), ``dumps()`` its bytes."""

    def __init__(self, fn: Any, autocast: Any = ()) -> None:
        self._fn = fn
        #: The guards left out because torch cannot save them ("ID_MATCH L['x'].attr"), at trace time.
        self.dropped_guards: list[str] = []
        #: The autocast it was traced under (``autocast_state()``): saved, and its load builds the guards
        #: under it (Dynamo's tensor guards expect the dispatch keys their build saw, ``AutocastCPU``).
        self.autocast = tuple(autocast)

    def check(self, *args: Any, **kwargs: Any) -> bool:
        return bool(self._fn.guard_check(*args, **kwargs))

    def why_not(self, *args: Any, **kwargs: Any) -> str:
        """The first guard that fails for these arguments."""
        f_locals = self._fn.prepare_f_locals(*args, **kwargs)
        return "; ".join(self._fn._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn.fn(*args, **kwargs)

    @property
    def compiled(self) -> Any:
        """What the backend returned for this trace."""
        return self._fn._artifacts.compiled_fn

    def call_through(self, fn: Callable[..., Any]) -> None:
        """Make the trace's bytecode call ``fn`` where it calls what the backend returned (a
        recorder of its outputs around it); what the trace saves is unchanged."""
        self._fn.fn.__globals__[self._fn._artifacts.backend_id] = fn

    def source_values(self, sources: Sequence[Any], args: tuple, kwargs: dict) -> list[Any]:
        """The objects ``sources`` (Dynamo's: ``L['x']``, ``L['self'].layers[0].weight``,
        ``G['mod'].attr``) name in a call of this trace at ``(args, kwargs)``; a ``LookupError``
        that says which where one cannot be found."""
        env = {"L": self._fn.prepare_f_locals(*args, **kwargs), "G": self._fn.fn.__globals__, "__builtins__": {}}
        out = []
        for source in sources:
            name = source.name() if callable(source.name) else source.name  # (a property in torch >= 2.12)
            try:
                out.append(eval(name, env))  # noqa: S307 - Dynamo's own spelling of a place in the call
            except Exception as e:  # noqa: BLE001 - said, and the caller goes on without it
                raise LookupError(f"{name}: {type(e).__name__}: {e}") from None
        return out

    def dumps(self) -> bytes:
        env = self._fn._artifacts.runtime_env
        data = type(self._fn).serialize(self._fn, _closure_data(env.closure)).serialized_data
        # Modules Dynamo's bytecode reads as globals it installed in the traced function's module
        # ("___module_collections_<id>_c0"): named here, imported again on load.
        scope = self._fn._extra_globals or {}
        modules = {ref: scope[ref].__name__ for ref in getattr(env, "external_refs", ())
                   if isinstance(scope.get(ref), types.ModuleType)}
        return pickle.dumps({"trace": data, "modules": modules, "autocast": self.autocast})

    def changed_sources(self) -> list[str]:
        """The traced functions whose source changed since the trace (module:first line); [] when none."""
        from torch._dynamo.package import _hash_sourcelines

        out = []
        for src in sorted(self._fn.source_info().inlined_sources, key=lambda s: (s.module, s.firstlineno)):
            try:
                same = _hash_sourcelines(importlib.import_module(src.module), src.firstlineno,
                                         src.lastlineno) == src.checksum
            except Exception:  # noqa: BLE001 - a module that is gone or unreadable changed
                same = False
            if not same:
                out.append(f"{src.module}:{src.firstlineno}")
        return out


# torch methods precompile wraps, once per process: each wrapper does its part only in a thread
# whose flag on _ON is turned on (another thread's trace, a user's own torch.compile, is untouched).
_INSTALL = threading.Lock()


def _wrap_once(owner: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``owner.name`` by ``wrap(original)`` unless done already; False where it is absent."""
    with _INSTALL:
        current = getattr(owner, name, None)
        if current is None:
            return False
        if not getattr(current, "_shapewise_wrapper", False):
            wrapper = functools.wraps(current)(wrap(current))
            wrapper._shapewise_wrapper = True
            setattr(owner, name, wrapper)
        return True


def _with_builtins(check: Callable[..., Any]) -> Callable[..., Any]:
    import builtins

    def check_with_builtins(self: Any, f_globals: dict[str, Any]) -> Any:
        if getattr(_ON, "builtins", False):
            f_globals = {**vars(builtins), **f_globals}
        return check(self, f_globals)

    return check_with_builtins


@contextlib.contextmanager
def _builtins_are_external_refs() -> Any:
    """torch 2.11 checks that every global a trace's bytecode reads is in the globals it builds the
    function with, and forgets the builtins (``Missing required external references: ['type']``),
    which the function finds at run time all the same (torch 2.13 puts the builtins a trace uses
    among its globals). While a trace is made or loaded here, the check counts the builtins."""
    from torch._dynamo.convert_frame import GraphRuntimeEnv

    _wrap_once(GraphRuntimeEnv, "_check_external_refs", _with_builtins)
    with _turned_on("builtins"):
        yield


def _keeping_sources(cleanup: Callable[..., Any]) -> Callable[..., Any]:
    def cleanup_keeping_sources(self: Any) -> Any:
        if getattr(_ON, "sources", False):
            for node in self.graph.nodes:
                arg = node.meta.get("grapharg") if node.op == "placeholder" else None
                if arg is not None and getattr(arg, "source", None) is not None:
                    node.meta[SOURCE_META] = arg.source
            # ... and what the trace sets in Python state, which the backend, called after this
            # clean-up, can no longer ask Dynamo (``captured_side_effects``).
            from shapewise._compat.dynamo import trace_side_effects

            _ON.side_effects = trace_side_effects()
        return cleanup(self)

    return cleanup_keeping_sources


def captured_side_effects() -> Any:
    """``trace_side_effects`` of the trace ``aot_trace`` is making in this thread, as its clean-up
    saw it (None where it saw none: a trace not made by ``aot_trace``)."""
    return getattr(_ON, "side_effects", None)


@contextlib.contextmanager
def placeholder_sources_kept() -> Any:
    """While it is on, Dynamo's clean-up of a finished trace (which drops each placeholder's
    ``grapharg``) leaves the placeholder's ``Source`` under ``SOURCE_META``, for a backend that
    torch calls after it (``aot_compile_fullgraph``): shapewise names its dims by those sources."""
    from torch._dynamo.output_graph import OutputGraph

    _wrap_once(OutputGraph, "cleanup", _keeping_sources)
    with _turned_on("sources"):
        yield


def aot_trace(fn: Callable[..., Any], args: tuple, kwargs: dict, backend: Callable[..., Any]) -> AOTTrace:
    """Dynamo's full-graph trace of ``fn`` at ``(args, kwargs)`` (their dynamic marks apply),
    its graph compiled by ``backend``, which must return a ``SerializableCallable``."""
    if not HAS_AOT_COMPILE:  # pragma: no cover
        raise RuntimeError(f"torch {torch.__version__} has no torch._dynamo.aot_compile")
    from torch._dynamo.exc import BackendCompilerFailed

    # aot_compile patches AOTAutograd's cache config for its own backends (a bundled, forced cache);
    # shapewise's compiles run under the session's own, so their artifacts save as they do elsewhere.
    functorch = torch._functorch.config
    own = {k: getattr(functorch, k) for k in _AOT_PATCHED if hasattr(functorch, k)}

    compiled: list[bool] = []

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        try:
            with functorch.patch(own):
                out = backend(gm, example_inputs)
        except Exception as e:  # as torch.compile raises it: backend_error_cause finds the backend's own error
            raise BackendCompilerFailed(backend, e, None) from e
        compiled.append(True)
        return out

    from torch._dynamo.convert_frame import get_traced_fn

    dropped: list[str] = []
    # The traced function's closure (a decorator's wrapped forward): fixed by the model's class,
    # whose source the saved trace checks; its objects do not save, so neither do guards on them.
    cells = set(get_traced_fn(fn)[0].__code__.co_freevars)

    def keep(entries: Any) -> list[bool]:
        # Guards torch cannot save are left out, as torch's own default filter does, and listed:
        # object identities (ID_MATCH, a module's or function's match), dict versions, globals, the
        # type of an object whose class is local to a function (the kernels package's hub-function
        # modules in transformers >= 5.2x's layers), and values read through a function's closure
        # (torch cannot find them again on load). What they pinned is fixed by the model's class,
        # config and source, which the warm key and the load check.
        from torch._dynamo.guards import CheckFunctionManager

        bad = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
        out = []
        for g in entries:
            ok = not (g.is_global or g.guard_type in bad or bad.intersection(g.derived_guard_types or ())
                      or getattr(getattr(g, "orig_guard", None), "_unserializable", False)
                      or ".__closure__[" in g.name  # a function's closure: fixed by its source, checked on load
                      or re.match(r"\w*", g.name).group() in cells)
            if not ok:
                dropped.append(f"{g.guard_type} {g.name}")
            out.append(ok)
        return out

    _ON.side_effects = None
    try:
        with _turned_on("saving"), _builtins_are_external_refs(), placeholder_sources_kept():
            # dynamic=False: only the marked dims are dynamic (no automatic dynamic on a second
            # trace), as shapewise.compile's torch.compile(dynamic=False) has it.
            t = AOTTrace(aot_compile_fullgraph(fn, (args, kwargs), hooks=Hooks(guard_filter_fn=keep),
                                               backend=compile_graph, dynamic=False), autocast_state())
    except Exception as e:
        from shapewise._compat.dynamo import is_trace_error

        # Before the backend returned: Dynamo's or the backend's own error, as a plain trace raises
        # it. After: a trace error (a dim marked dynamic was specialised) is Dynamo's too; anything
        # else is torch packaging what it traced (a guard that does not save; torch 2.11's check of
        # the bytecode's globals, "Missing required external references: ['type']").
        if not compiled or (is_trace_error(e) and not _is_package_error(e)):
            raise
        raise TraceNotSaved(f"{type(e).__name__}: {str(e)[:300]}") from e
    t.dropped_guards = dropped
    return t


def _is_package_error(e: BaseException | None) -> bool:
    """Whether ``e`` (or what caused it) is torch saying it cannot package a trace (``PackageError``:
    a guard on an object of a class defined inside a function, say), a Dynamo exception all the same."""
    from torch._dynamo.exc import PackageError

    while e is not None:
        if isinstance(e, PackageError):
            return True
        e = e.__cause__
    return False


def _closure_data(closure: Any) -> dict[str, Any]:
    """The functions a traced function's closure holds (a decorator's wrapped ``forward``, which
    pickle cannot find by name: the name is the wrapper's), saved by position and given back on
    load from the live function's closure."""
    return {f"closure:{i}": c.cell_contents for i, c in enumerate(closure or ())
            if callable(c.cell_contents) and not isinstance(c.cell_contents, type)}


def load_aot_trace(data: bytes, traced: Any = None) -> AOTTrace:
    """An ``AOTTrace`` from ``dumps()``'s bytes (raises on a foreign build or a broken file);
    ``traced``: the model (module, function or method) it was traced from, live in this process."""
    if not HAS_AOT_COMPILE:  # pragma: no cover
        raise RuntimeError(f"torch {torch.__version__} has no torch._dynamo.aot_compile")
    from torch._dynamo.convert_frame import get_traced_fn

    saved = pickle.loads(data)
    fn = get_traced_fn(traced)[0] if traced is not None else None
    closure = fn.__closure__ if fn is not None else None
    # The bytecode reads the traced function's globals by name (the output class it rebuilds, e.g.
    # transformers' CausalLMOutput): the live module's, as a traced call has them; then the modules
    # Dynamo installed there.
    f_globals = {**(fn.__globals__ if fn is not None else {}),
                 **{ref: importlib.import_module(name) for ref, name in saved["modules"].items()}}
    autocast = saved.get("autocast", ())
    with _builtins_are_external_refs(), autocast_as(autocast):
        return AOTTrace(AOTCompiledFunction.deserialize(saved["trace"], f_globals, _closure_data(closure)), autocast)
