"""Every use of torch internals lives here, so a torch upgrade touches one module.

Supported: torch >= 2.11 (GPU machine: 2.11.0; CPU machines: 2.13.0).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch._prims_common import compute_required_storage_length
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._sympy.functions import CeilDiv, FloorDiv, Max, Min, Mod, PythonMod

__all__ = [
    "CeilDiv",
    "FakeTensor",
    "FakeTensorMode",
    "FloorDiv",
    "Max",
    "Min",
    "Mod",
    "PythonMod",
    "backward_source",
    "compiled_backward",
    "compiled_source",
    "eager_backward",
    "fresh_tracing_context",
    "no_zero_one_specialisation",
    "own_recompile_budget",
    "evaluate_at",
    "has_static_address",
    "is_graph_break",
    "is_trace_error",
    "node_value",
    "placeholder_source",
    "scalars_passed_as_tensors",
    "shape_env_of",
    "standalone_compile",
    "storage_length",
    "sym_expr",
    "symbol_hints",
    "trace_guards",
    "unmark_dynamic",
    "value_range",
]

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def node_value(node: torch.fx.Node) -> Any:
    """The fake value an FX node carries: ``val`` (AOT / make_fx) or ``example_value`` (Dynamo)."""
    meta = node.meta
    if "val" in meta:
        return meta["val"]
    return meta.get("example_value")


def sym_expr(value: Any) -> sympy.Expr:
    """A SymInt or int as a sympy expression."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(int(value))


def shape_env_of(values: Sequence[Any]):
    """The ShapeEnv behind the first symbolic value found in ``values`` (or None)."""
    for v in values:
        if isinstance(v, torch.SymInt):
            return v.node.shape_env
        if isinstance(v, FakeTensor) and v.fake_mode.shape_env is not None:
            return v.fake_mode.shape_env
    return None


def symbol_hints(shape_env) -> dict[sympy.Symbol, int]:
    """Traced (example) values of the backed symbols."""
    if shape_env is None:
        return {}
    table = getattr(shape_env, "backed_var_to_val", None)
    if table is None:  # torch 2.11 spelling
        table = shape_env.var_to_val
    return {k: int(v) for k, v in table.items()}


def value_range(shape_env, symbol: sympy.Symbol) -> tuple[int | None, int | None]:
    """The (lower, upper) bounds the trace proved for ``symbol``; None where unbounded."""
    vr = shape_env.var_to_range.get(symbol) if shape_env is not None else None
    if vr is None:
        return None, None

    def as_int(b):
        b = sympy.sympify(b)
        return int(b) if b.is_Integer else None

    return as_int(vr.lower), as_int(vr.upper)


def trace_guards(shape_env) -> list[tuple[sympy.Basic, str]]:
    """The shape guards of a trace, as (sympy boolean, where it came from), over the trace's
    final symbols: a guard made before Dynamo replaced a symbol by another (labels' length,
    later proven equal to the tokens') is rewritten with the replacement, not lost."""
    if shape_env is None:
        return []
    replacements = dict(getattr(shape_env, "replacements", {}) or {})
    out = []
    for g in shape_env.guards:
        where = ""
        sloc = getattr(g, "sloc", None)
        if sloc is not None:
            where = _repair_location(str(getattr(sloc, "maybe_user_loc", "") or "").strip())
        expr = g.expr.xreplace(replacements) if replacements else g.expr
        if expr in (sympy.true, sympy.false) and expr is not g.expr:
            expr = g.expr  # decided by the replacement alone: keep it as written
        out.append((expr, where))
    return out


def _repair_location(where: str) -> str:
    """torch shortens a file path by its common path with torch's folder; for a file outside
    it that is ``/``, and the first letter after it is lost (``/tmp/m.py`` → ``mp/m.py``).
    Put it back when exactly that path exists."""
    import os
    import re

    m = re.search(r"# (\S+):(\d+) in ", where)
    if m is None or os.path.isabs(m.group(1)) or os.path.exists(m.group(1)):
        return where
    path = m.group(1)
    try:
        roots = os.listdir("/")
    except OSError:
        return where
    fixed = [f"/{e[0]}{path}" for e in roots if e and path.startswith(e[1:] + "/") and os.path.exists(f"/{e[0]}{path}")]
    return where[:m.start(1)] + fixed[0] + where[m.end(1):] if len(fixed) == 1 else where


__all__ += ["compute_required_storage_length", "make_symint", "range_guard_violations", "symbolic_env"]


def storage_length(shape: Sequence[int], stride: Sequence[int], offset: int) -> int:
    """Exact number of storage elements a strided view needs."""
    return int(compute_required_storage_length(tuple(shape), tuple(stride), int(offset)))


@contextlib.contextmanager
def no_zero_one_specialisation(on: bool = True) -> Iterator[None]:
    """Trace so that a dynamic size of 0 or 1 does not get specialised (one trace for all sizes);
    ``on=False``: the default reasoning, also inside a trace that has it on."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=on):
        yield


@contextlib.contextmanager
def own_recompile_budget(extra: int = 1024) -> Iterator[None]:
    """Let this trace go past Dynamo's recompile limit for the code it traces. Each
    ``shapewise.compile`` has its own backend, so Dynamo keeps one cache entry per compiled
    model on the shared ``forward`` code of their class; the 9th model of a class would hit the
    limit (8), which fullgraph=True makes an error. shapewise bounds its own traces per model."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(recompile_limit=dynamo_config.recompile_limit + extra,
                             accumulated_recompile_limit=dynamo_config.accumulated_recompile_limit + extra):
        yield


@contextlib.contextmanager
def fresh_tracing_context(fake_mode: FakeTensorMode | None = None) -> Iterator[None]:
    """Leave any surrounding Dynamo tracing context, so a compile sees only its own inputs.

    ``compile_fx`` and AOTAutograd look up the active context's fake mode; inside a Dynamo
    backend that is Dynamo's (symbolic) one, which would make a "static" compile dynamic and
    let the compile's guards leak into Dynamo's. With ``fake_mode``, that mode's context.
    """
    from torch._guards import TracingContext, tracing

    with tracing(TracingContext(fake_mode) if fake_mode is not None else None):
        yield


def symbolic_env(symbols: dict[sympy.Symbol, tuple[int, int, int]]):
    """A fresh ShapeEnv + FakeTensorMode with one backed symbol per entry of
    ``{old symbol: (low, high, hint)}``; returns (mode, {old symbol: new sympy symbol})."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    new = {}
    for old, (lo, hi, hint) in symbols.items():
        e = env.create_symbol(hint, ConstantSource(f"shapewise_{old}"), dynamic_dim=DimDynamic.DYNAMIC,
                              do_not_specialize_zero_one=True)
        env.constrain_symbol_range(e, compiler_min=lo, compiler_max=hi)
        new[old] = e
    # The ranges as made: a guard that specialises a symbol narrows var_to_range to the
    # hint, so a later check must compare against these, not the env's current ranges.
    _MADE_RANGES[env] = {e: (lo, hi) for (lo, hi, _), e in zip(symbols.values(), new.values())}
    return mode, new


_MADE_RANGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def evaluate_at(value: Any, values: Mapping[sympy.Symbol, int]) -> int:
    """An int, or a SymInt of a ``symbolic_env`` (its symbols stand for the trace's symbols
    they were made for), evaluated at ``values`` given over the trace's symbols."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    expr = value.node.expr
    env = value.node.shape_env
    by_name = {f"shapewise_{s}": sympy.Integer(v) for s, v in values.items()}
    subs = {}
    for sym in expr.free_symbols:
        names = [src.name for src in env.var_to_sources.get(sym, [])]
        subs[sym] = next(by_name[n] for n in names if n in by_name)
    return int(expr.xreplace(subs))


def make_symint(mode: FakeTensorMode, expr: sympy.Expr, hint: int) -> Any:
    """A SymInt (or int, if constant) for ``expr`` over ``mode``'s symbols."""
    if not expr.free_symbols:
        return int(expr)
    return mode.shape_env.create_symintnode(expr, hint=hint)


def range_guard_violations(mode: FakeTensorMode) -> list[str]:
    """Guards a compile added to ``mode``'s ShapeEnv that do not hold at every corner of
    the symbols' ranges (e.g. a compile that specialised a ranged size to its hint)."""
    env = mode.shape_env
    if env is None:
        return []
    made = _MADE_RANGES.get(env, {})
    corners: list[dict[sympy.Symbol, int]] = [{}]
    # Only the symbols the range was made of: a compile's own symbols (a view's -1, an
    # unbacked size) have no corners, and a guard over them cannot be decided here.
    # Besides the ends, the sizes next to them and to the middle: a guard with a floor or a
    # modulus (T even: Eq(4*T, 8*((T + 1)//2))) can hold at both ends and fail between them.
    for sym, vr in (made.items() if made else env.var_to_range.items()):
        lo, hi = vr if made else (vr.lower, vr.upper)
        ends = [int(b) for b in (lo, hi) if sympy.sympify(b).is_Integer]
        vals = set(ends)
        if len(ends) == 2:
            mid = (ends[0] + ends[1]) // 2
            vals |= {v for v in (ends[0] + 1, ends[1] - 1, mid, mid + 1) if ends[0] <= v <= ends[1]}
        corners = [{**c, sym: v} for c in corners for v in sorted(vals)] or corners
    bad = [f"{sym} was fixed to {value}" for sym, value in env.replacements.items()
           if sym in made and sympy.sympify(value).is_number]
    for g in env.guards:
        if made and not g.expr.free_symbols <= made.keys():
            continue
        for c in corners:
            try:
                ok = bool(g.expr.xreplace({k: sympy.Integer(v) for k, v in c.items()}))
            except TypeError:
                continue
            if not ok:
                bad.append(f"{g.expr} fails at {c}")
                break
    return bad


def standalone_compile(gm: torch.fx.GraphModule, args: list[Any], *, static: bool,
                       options: dict[str, Any] | None = None):
    """Inductor compile of ``gm``: fully static from concrete ``args``, or symbolic from the
    active tracing context (see ``fresh_tracing_context(fake_mode)``)."""
    from torch._inductor import standalone_compile as _sc

    mode = "from_example_inputs" if static else "from_tracing_context"
    # standalone_compile forwards `options` to compile_fx as keyword arguments: Inductor
    # config (max_autotune, ...) goes in as compile_fx's config_patches.
    with eager_backward():
        return _sc(gm, args, dynamic_shapes=mode, options={"config_patches": dict(options)} if options else {})


@contextlib.contextmanager
def eager_backward() -> Iterator[None]:
    """Compile a training graph's backward together with its forward.

    AOTAutograd otherwise lowers a static backward lazily, on the first ``backward()``: outside
    Lower (its time, errors and fallback), and after the compile's tracing context is gone.
    """
    from torch._functorch import config as functorch_config

    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        yield
        return
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        yield


def compiled_source(fn: Any) -> str | None:
    """The Python wrapper code Inductor generated for a compiled artifact (forward and, for
    training graphs, backward, joined), found by walking the artifact's wrappers."""
    found: list[str] = []
    seen: set[int] = set()
    todo = [(fn, 0)]
    while todo:
        obj, depth = todo.pop(0)
        if obj is None or id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        src = getattr(obj, "source_code", None)
        if isinstance(src, str) and src not in found:
            found.append(src)
        # Training artifacts: a bound ``CompiledFunction.apply`` (``__self__`` holds compiled_fw /
        # compiled_bw); the backward sits behind a dynamo-disable wrapper.
        for attr in ("_compiled_fn", "compiled_fn", "fn", "__wrapped__", "__self__", "_torchdynamo_orig_callable",
                     "compiled_fw", "compiled_bw"):
            try:
                todo.append((getattr(obj, attr, None), depth + 1))
            except Exception:  # noqa: BLE001 - some wrappers raise on unknown attributes
                continue
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                todo.append((cell.cell_contents, depth + 1))
            except ValueError:
                continue
    return "\n".join(found) if found else None


def compiled_backward(fn: Any) -> Any:
    """The compiled backward of a training artifact (AOTAutograd's ``compiled_bw``), or None:
    an inference artifact, or a backward not compiled yet (see ``eager_backward``)."""
    seen: set[int] = set()
    todo = [(fn, 0)]
    while todo:
        obj, depth = todo.pop(0)
        if obj is None or id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        try:
            bw = getattr(obj, "compiled_bw", None)
            if bw is not None:
                return bw
            todo.extend((getattr(obj, a, None), depth + 1) for a in ("_compiled_fn", "compiled_fn", "fn",
                                                                     "__wrapped__", "__self__"))
        except Exception:  # noqa: BLE001 - some wrappers raise on unknown attributes
            continue
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                todo.append((cell.cell_contents, depth + 1))
            except ValueError:
                continue
    return None


def backward_source(fn: Any) -> str | None:
    """The code Inductor generated for a training artifact's backward (None if there is none)."""
    bw = compiled_backward(fn)
    return compiled_source(bw) if bw is not None else None


def placeholder_source(node: torch.fx.Node):
    """The Dynamo ``Source`` a placeholder was lifted from (None outside Dynamo graphs)."""
    grapharg = node.meta.get("grapharg")
    return getattr(grapharg, "source", None) if grapharg is not None else None


def scalars_passed_as_tensors(gm: torch.fx.GraphModule) -> list[str]:
    """The Python floats Dynamo passed to ``gm`` as 0-d tensors (``torch.compile(dynamic=True)``
    leaves floats unspecialised: a module's ``Dropout.p`` becomes an input read with ``.item()``),
    by their source names."""
    out = []
    for node in gm.graph.nodes:
        arg = node.meta.get("grapharg") if node.op == "placeholder" else None
        if arg is not None and getattr(arg, "pass_arg_as_tensor", False):
            name = getattr(arg.source, "name", node.name)  # a method in older torch, a property now
            out.append(name() if callable(name) else str(name))
    return out


def local_name_of(source, positional: Sequence[str] = (), var_positional: str | None = None,
                  var_keyword: str | None = None, keywords: Collection[str] = ()) -> str | None:
    """The user argument a Dynamo source reads (``L['x']`` → ``x``), else None. When Dynamo
    traced a ``*args, **kwargs`` wrapper (as for torch's own modules, e.g. ``nn.Sequential``),
    ``L['args'][i]`` is the ``positional[i]`` argument (past them: the model's ``*args``, named
    ``var_positional``) and ``L['kwargs']['k']`` is ``k``; an element of a tuple/list argument
    (``L['xs'][0]``) reads that argument. A model whose own ``*args`` / ``**kwargs`` are called
    so is read as itself, except for ``L['kwargs']['k']`` with ``k`` one of its ``keywords``
    (its named parameters: transformers wraps ``forward(self, input_ids, ..., **kwargs)`` in
    decorators that take ``*args, **kwargs``, and Dynamo traces the wrapper)."""
    from torch._dynamo.source import DictGetItemSource, GetItemSource, LocalSource

    if isinstance(source, LocalSource):
        return source.local_name
    if isinstance(source, (GetItemSource, DictGetItemSource)):
        base, index = source.base, source.index
        if isinstance(base, LocalSource) and base.local_name == "args" and var_positional != "args":
            return positional[index] if isinstance(index, int) and 0 <= index < len(positional) else var_positional
        if isinstance(base, LocalSource) and base.local_name == "kwargs" and (
                var_keyword != "kwargs" or index in keywords):
            return index if isinstance(index, str) else None
        # An element of a tuple/list argument (or of the model's own *args): that argument.
        return local_name_of(base, positional, var_positional, var_keyword, keywords)
    if getattr(source, "base", None) is not None:  # an attribute of an object argument (cache.layers[0].keys)
        return local_name_of(source.base, positional, var_positional, var_keyword, keywords)
    return None


def dynamo_unique_graphs() -> int:
    """Dynamo's own count of graphs it traced in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def mark_dynamic(t: torch.Tensor, dim: int, strict: bool = True) -> None:
    if strict:
        torch._dynamo.mark_dynamic(t, dim)
    else:
        torch._dynamo.maybe_mark_dynamic(t, dim)


def has_static_address(t: torch.Tensor) -> bool:
    """Whether ``t`` was marked as living at one address across calls
    (``torch._dynamo.mark_static_address``: transformers' static KV cache)."""
    return getattr(t, "_dynamo_static_input_type", None) is not None


def unmark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Undo ``mark_dynamic`` for one dim (Dynamo keeps the marks as sets on the tensor)."""
    for attr in ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices"):
        marks = getattr(t, attr, None)
        if isinstance(marks, set):
            marks.discard(dim)


def aot_eager(gm: torch.fx.GraphModule, args: list[Any]):
    from torch._dynamo.backends.debugging import aot_eager as _aot_eager

    with eager_backward():
        return _aot_eager(gm, args)


def is_trace_error(e: BaseException) -> bool:
    """Whether ``e`` was raised while Dynamo traced (it refused the code, a dim marked dynamic
    was specialised, or the backend failed), not by running what it compiled."""
    from torch._dynamo.exc import TorchDynamoException
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    return isinstance(e, (TorchDynamoException, ConstraintViolationError))


def is_graph_break(e: BaseException) -> bool:
    """Whether ``e`` is Dynamo refusing to trace some code in one graph (fullgraph=True)."""
    from torch._dynamo.exc import Unsupported

    return isinstance(e, Unsupported)


def backend_error_cause(e: BaseException) -> BaseException | None:
    """The exception a Dynamo backend raised, if ``e`` is Dynamo's wrapper around one."""
    from torch._dynamo.exc import BackendCompilerFailed

    if isinstance(e, BackendCompilerFailed):
        return getattr(e, "inner_exception", None) or e.__cause__
    return None


__all__ += ["op_schema", "storage_key"]


def storage_key(t: torch.Tensor) -> Any:
    """A hashable identity of ``t``'s storage (shared by all its views; fake tensors included)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def op_schema(target: Any):
    """The schema of an OpOverload (or of an OpOverloadPacket's default overload), else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    if isinstance(target, torch._ops.OpOverloadPacket):
        overload = getattr(target, "default", None)
        return overload._schema if overload is not None else None
    return None


# -- the artifact cache (shapewise.cache): saving, loading and fingerprinting Inductor artifacts --

__all__ += ["artifact_bytes", "build_fingerprint", "calls_during_fx_trace", "compile_lock",
            "inductor_config_fingerprint", "install_kernel_binaries", "kernel_binaries", "load_artifact"]


def build_fingerprint(devices: Sequence[Any] = ()) -> dict[str, str]:
    """What an artifact compiled here depends on besides its graph: torch version and build,
    Python, CPU vector ISA, CUDA / Triton versions and the GPU of each CUDA ``device`` used."""
    import platform
    import sys

    out = {
        "torch": torch.__version__,
        "torch_git": str(getattr(torch.version, "git_version", "")),
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "machine": platform.machine(),
        "cpu_isa": str(torch.backends.cpu.get_cpu_capability()),
        "cuda": str(torch.version.cuda),
        "hip": str(getattr(torch.version, "hip", None)),
    }
    try:
        import triton

        out["triton"] = str(triton.__version__)
    except ImportError:
        out["triton"] = "none"
    for d in sorted({str(torch.device(d)) for d in devices if torch.device(d).type == "cuda"}):
        props = torch.cuda.get_device_properties(torch.device(d))
        out[f"gpu:{d}"] = f"{props.name}|sm{props.major}{props.minor}"
    return out


def inductor_config_fingerprint() -> str:
    """A hash of Inductor's global config (the part its own cache keys on), so a changed
    global setting never serves an artifact compiled under another."""
    import hashlib

    from torch._inductor import config as inductor_config

    portable = inductor_config.save_config_portable()
    return hashlib.sha256(repr(sorted(portable.items())).encode()).hexdigest()


def artifact_bytes(artifact: Any, tmpdir: str) -> bytes:
    """A ``standalone_compile`` artifact in Inductor's own binary format (``CompiledArtifact.save``).
    Raises when the artifact cannot be saved (e.g. Inductor's caches are disabled)."""
    import os
    import tempfile

    save = getattr(artifact, "save", None)
    if save is None:
        raise TypeError(f"{type(artifact).__name__} is not an Inductor CompiledArtifact")
    fd, path = tempfile.mkstemp(prefix=".save-", suffix=".bin", dir=tmpdir)
    os.close(fd)
    try:
        save(path=path, format="binary")  # torch 2.11: plain write; 2.13: write_atomic; both to `path`
        with open(path, "rb") as f:
            return f.read()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def load_artifact(data: bytes, tmpdir: str) -> Any:
    """Load bytes written by ``artifact_bytes`` (``CompiledArtifact.load``, which checks the
    torch build); returns the callable artifact."""
    import os
    import tempfile

    from torch._inductor.standalone_compile import CompiledArtifact

    fd, path = tempfile.mkstemp(prefix=".load-", suffix=".bin", dir=tmpdir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return CompiledArtifact.load(path=path, format="binary")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def kernel_binaries(artifact: Any) -> list[tuple[str, bytes]]:
    """The compiled C++ kernel libraries (CPU) an artifact calls, as (path relative to
    Inductor's cache dir, bytes). Inductor's artifact holds their source only, so a load in a
    fresh cache would run the C++ compiler again; Triton kernels (GPU) are bundled by Inductor."""
    import os
    import types

    root = _inductor_cache_dir()
    found: dict[str, bytes] = {}
    seen: set[int] = set()
    todo = [(artifact, 0)]
    while todo:
        obj, depth = todo.pop(0)
        if obj is None or id(obj) in seen or depth > 10:
            continue
        seen.add(id(obj))
        for value in (getattr(obj, "__globals__", None) or {}).values():
            mod = getattr(value, "__self__", None)
            path = getattr(mod, "__file__", None) if isinstance(mod, types.ModuleType) else None
            if path and path.endswith(".so") and os.path.commonpath([root, os.path.abspath(path)]) == root:
                rel = os.path.relpath(path, root)
                if rel not in found and os.path.isfile(path):
                    with open(path, "rb") as f:
                        found[rel] = f.read()
        for attr in ("_compiled_fn", "compiled_fn", "fn", "__wrapped__", "__self__", "_torchdynamo_orig_callable",
                     "compiled_fw", "compiled_bw", "current_callable"):
            try:
                todo.append((getattr(obj, attr, None), depth + 1))
            except Exception:  # noqa: BLE001 - some wrappers raise on unknown attributes
                continue
        if isinstance(obj, (list, tuple)):
            todo.extend((o, depth + 1) for o in obj)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                todo.append((cell.cell_contents, depth + 1))
            except ValueError:
                continue
    return sorted(found.items())


def install_kernel_binaries(files: Sequence[tuple[str, bytes]]) -> int:
    """Put kernel libraries saved by ``kernel_binaries`` where Inductor looks for them (it
    compiles only when the library is missing). Returns how many were written."""
    import os
    import tempfile

    root = _inductor_cache_dir()
    written = 0
    for rel, data in files:
        parts = rel.replace("\\", "/").split("/")
        if os.path.isabs(rel) or ".." in parts or not rel.endswith(".so"):
            raise ValueError(f"refusing kernel path {rel!r} outside Inductor's cache")
        path = os.path.join(root, *parts)
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".shapewise-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
            written += 1
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return written


def compile_lock():
    """Dynamo's process-wide compile lock: a background compile holds it so that it never
    runs while Dynamo traces (both patch global config)."""
    try:
        from torch._dynamo.convert_frame import compile_lock as lock
    except ImportError:  # pragma: no cover - older layouts
        return contextlib.nullcontext()
    return lock


@contextlib.contextmanager
def calls_during_fx_trace() -> Iterator[None]:
    """Call a ``torch.compile``d model while another thread may be compiling: AOTAutograd's FX
    tracing raises a process-wide flag, and a call that sees it fails with "using FX to
    symbolically trace a dynamo-optimized function" unless this thread's Dynamo config says
    ``force_compile_during_fx_trace`` (then the call runs its compiled code as usual). Dynamo's
    config overrides are per thread, so the caller sets it. Absent in a torch: a no-op."""
    import torch._dynamo.config as cfg

    if not hasattr(cfg, "force_compile_during_fx_trace") or cfg.force_compile_during_fx_trace:
        yield
        return
    with cfg.patch(force_compile_during_fx_trace=True):
        yield
