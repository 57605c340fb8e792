"""Inductor and AOTAutograd: static and range compiles, their generated code, and the
artifacts the on-disk cache stores (bytes, kernel binaries, build fingerprints)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx

__all__ = [
    "aot_eager", "artifact_bytes", "autocast_as", "autocast_enabled", "autocast_state", "backward_source",
    "build_fingerprint", "compile_state", "compile_state_as", "compiled_backward",
    "compiled_source", "eager_backward", "inductor_config_fingerprint", "inductor_config_kept", "inference_entry",
    "install_kernel_binaries", "kernel_binaries", "load_artifact", "no_inductor_caches", "post_grad_pass",
    "set_grad_enabled", "specialise_region_sizes", "standalone_compile", "warm_compile_workers",
]


def warm_compile_workers() -> None:
    """Start Inductor's Triton compile workers now, as ``torch.compile``'s inductor backend does on
    its first call: their start-up (seconds: each imports torch) then overlaps the trace and
    whatever runs before the first compile instead of delaying it. A no-op without Triton."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:
        return
    try:
        maybe_warm_pool()
    except Exception as e:  # noqa: BLE001 - an optimisation: the first compile starts them otherwise
        import logging

        logging.getLogger("shapewise").debug("shapewise: could not start Inductor's compile workers early: %s", e)


def standalone_compile(gm: torch.fx.GraphModule, args: list[Any], *, static: bool,
                       options: dict[str, Any] | None = None, cache_salt: str | None = None):
    """Inductor compile of ``gm``: fully static from concrete ``args``, or symbolic from the
    active tracing context (see ``fresh_tracing_context(fake_mode)``); ``cache_salt`` (the
    range, for a symbolic compile) goes into Inductor's cache keys."""
    from torch._inductor import standalone_compile as _sc

    mode = "from_example_inputs" if static else "from_tracing_context"
    # standalone_compile forwards `options` to compile_fx as keyword arguments: Inductor
    # config (max_autotune, ...) goes in as compile_fx's config_patches.
    options = dict(options or {})
    if not static and cache_salt:
        # A range compile's code may rest on its ShapeEnv's value ranges (over (1, 2), ``(s + 1) //
        # 2`` is 1 with no guard), which the keys of Inductor's FX graph cache and AOTAutograd's
        # cache leave out: the same graph compiled over (8, 23) was served the (1, 2) code (found
        # by the fuzzer). A post-grad pass that does nothing but whose uuid names the range puts
        # it into both keys (the artifact stays saveable for shapewise's own cache).
        prior = options.get("post_grad_custom_post_pass")
        options["post_grad_custom_post_pass"] = post_grad_pass([prior] if prior is not None else [], salt=cache_salt)
    with eager_backward():
        return _sc(gm, args, dynamic_shapes=mode, options={"config_patches": options} if options else {})


@contextlib.contextmanager
def no_inductor_caches() -> Iterator[None]:
    """Inductor's FX graph cache and AOTAutograd's cache off. A range compile's code may rest on
    its ShapeEnv's value ranges (over (1, 2), ``(s + 1) // 2`` is 1 with no guard), which those
    caches' keys leave out: the same graph compiled over (8, 23) was served the (1, 2) code
    (found by the fuzzer). shapewise's own artifact cache keys the range and stays on."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


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


_WRAPPER_ATTRS = ("_compiled_fn", "compiled_fn", "fn", "__wrapped__", "__self__", "_torchdynamo_orig_callable",
                  "compiled_fw", "compiled_bw", "current_callable")


def _wrapped(fn: Any, max_depth: int = 10) -> Iterator[Any]:
    """``fn`` and every object behind it, breadth first: the one walk over Inductor's and
    AOTAutograd's wrappers (attributes, closures, lists). A training artifact is a bound
    ``CompiledFunction.apply`` whose ``__self__`` holds compiled_fw / compiled_bw; the backward
    sits behind a dynamo-disable wrapper."""
    seen: set[int] = set()
    todo = [(fn, 0)]
    while todo:
        obj, depth = todo.pop(0)
        if obj is None or id(obj) in seen or depth > max_depth:
            continue
        seen.add(id(obj))
        yield obj
        for attr in _WRAPPER_ATTRS:
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


def compiled_source(fn: Any) -> str | None:
    """The Python wrapper code Inductor generated for a compiled artifact (forward and, for
    training graphs, backward, joined)."""
    found: list[str] = []
    for obj in _wrapped(fn):
        src = getattr(obj, "source_code", None)
        if isinstance(src, str) and src not in found:
            found.append(src)
    return "\n".join(found) if found else None


def compiled_backward(fn: Any) -> Any:
    """The compiled backward of a training artifact (AOTAutograd's ``compiled_bw``), or None:
    an inference artifact, or a backward not compiled yet (see ``eager_backward``)."""
    for obj in _wrapped(fn):
        try:
            bw = getattr(obj, "compiled_bw", None)
        except Exception:  # noqa: BLE001 - some wrappers raise on unknown attributes
            continue
        if bw is not None:
            return bw
    return None


def inference_entry(artifact: Any) -> tuple[Any, list[Any] | None] | None:
    """(Inductor's ``CompiledFxGraph``, the parameters AOTAutograd prepends to every call, None
    where the chain keeps none: an artifact loaded from bytes) of an inference artifact, or None
    when it is not one (a training artifact, a non-Inductor callable) or its wrappers are not
    the known chain. The graph's ``current_callable(list)``
    is what the artifact's runtime wrappers end up calling."""
    from torch._inductor.output_code import CompiledFxGraph

    graphs, params = [], None
    for obj in _wrapped(artifact):
        if isinstance(obj, CompiledFxGraph):
            graphs.append(obj)
        code = getattr(obj, "__code__", None)
        if code is not None and "params_buffers_flat" in code.co_freevars and getattr(obj, "__closure__", None):
            params = obj.__closure__[code.co_freevars.index("params_buffers_flat")].cell_contents
        try:
            if getattr(obj, "compiled_bw", None) is not None:
                return None
        except Exception:  # noqa: BLE001 - some wrappers raise on unknown attributes
            continue
    if len(graphs) != 1 or not callable(getattr(graphs[0], "current_callable", None)):
        return None
    return graphs[0], None if params is None else list(params)


#: ``autocast_enabled()``: whether any autocast (CPU, CUDA, ...) is on in this thread (the C
#: function itself: it is called on the hot path).
autocast_enabled = torch._C._is_any_autocast_enabled

# The device types whose autocast ``autocast_state`` reads: torch's list where it has one (one this
# build has no autocast for is skipped).
_AUTOCAST_DEVICES = tuple(getattr(torch._C, "_autocast_supported_devices", lambda: ())()) or (
    "cpu", "cuda", "xpu", "mps", "hpu")


def autocast_state() -> tuple[tuple[str, str], ...]:
    """The autocast this thread is under: (device type, dtype name) for each device type it is on
    for; () where none is (one C call). A compile bakes it into the code (AOTAutograd traces under
    it: a matmul of float32 inputs comes out bfloat16), so it is part of every key of compiled code,
    and a compile on another thread or in another process (a worker, a pending variant, a background
    compile) runs under the trace's (``autocast_as``)."""
    if not autocast_enabled():
        return ()
    out = []
    for device_type in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device_type):
                out.append((device_type, str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")))
        except (RuntimeError, ValueError):  # a device type this build has no autocast for
            continue
    return tuple(out)


@contextlib.contextmanager
def autocast_as(state: Sequence[tuple[str, str]]) -> Iterator[None]:
    """This thread under exactly ``state`` (an ``autocast_state()``) for the block: autocast turned
    on (at its dtype) or off per device type where the thread's differs."""
    want = dict(state)
    with contextlib.ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICES:
            try:
                on = torch.is_autocast_enabled(device_type)
            except (RuntimeError, ValueError):
                continue
            if device_type in want:
                dtype = getattr(torch, want[device_type])
                if not on or torch.get_autocast_dtype(device_type) != dtype:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
            elif on:
                stack.enter_context(torch.autocast(device_type, enabled=False))
        if autocast_state() != tuple(state):  # torch.autocast turns itself off (a warning) where it cannot run
            raise RuntimeError(f"cannot put this thread under autocast {tuple(state)} (it is under {autocast_state()}):"
                               " is that device type available in this process?")
        yield


def compile_state() -> tuple[bool, tuple[tuple[str, str], ...]]:
    """What a compile bakes in from its thread, and a content key holds: (grad mode,
    ``autocast_state()``). A compile made later, on another thread or in another process, runs
    under the trace's (``compile_state_as``)."""
    return torch.is_grad_enabled(), autocast_state()


@contextlib.contextmanager
def compile_state_as(state: tuple[bool, Sequence[tuple[str, str]]] | None) -> Iterator[None]:
    """This thread under a ``compile_state()`` for the block (None: as it is)."""
    if state is None:
        yield
        return
    grad, autocast = state
    with torch.set_grad_enabled(grad), autocast_as(autocast):
        yield


#: ``set_grad_enabled(flag)``: switch grad mode without a context object (the hot path).
set_grad_enabled = torch._C._set_grad_enabled


def post_grad_pass(passes: Sequence[Any], salt: str = "") -> Any:
    """One Inductor ``CustomGraphPass`` (for the ``post_grad_custom_post_pass`` option) that runs
    ``passes`` (callables on the post-grad ``torch.fx.Graph``, each with a ``uuid()``) in order;
    ``salt`` joins its uuid (and so Inductor's cache keys)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Chain(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for p in passes:
                p(graph)

        def uuid(self) -> str:
            return hashlib.sha256("|".join([salt, *(str(p.uuid()) for p in passes)]).encode()).hexdigest()

    return _Chain()


def backward_source(fn: Any) -> str | None:
    """The code Inductor generated for a training artifact's backward (None if there is none)."""
    bw = compiled_backward(fn)
    return compiled_source(bw) if bw is not None else None


def aot_eager(gm: torch.fx.GraphModule, args: list[Any]):
    from torch._dynamo.backends.debugging import aot_eager as _aot_eager

    with eager_backward():
        return _aot_eager(gm, args)


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


def inductor_config_kept() -> Any:
    """Inductor's global config now (the part ``inductor_config_fingerprint`` hashes): a callable
    that returns a context manager putting it back, for a compile made later under a key of now."""
    from torch._inductor import config as inductor_config

    portable = inductor_config.save_config_portable()
    return lambda: inductor_config.patch(portable)


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
    for obj in _wrapped(artifact):
        for value in (getattr(obj, "__globals__", None) or {}).values():
            mod = getattr(value, "__self__", None)
            path = getattr(mod, "__file__", None) if isinstance(mod, types.ModuleType) else None
            if path and path.endswith(".so") and os.path.commonpath([root, os.path.abspath(path)]) == root:
                rel = os.path.relpath(path, root)
                if rel not in found and os.path.isfile(path):
                    with open(path, "rb") as f:
                        found[rel] = f.read()
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


def specialise_region_sizes(gm: torch.fx.GraphModule, args: Sequence[Any]) -> torch.fx.GraphModule:
    """``gm`` (owned by the caller) for a static compile from ``args``: each region of
    ``torch.compiler.nested_compile_region`` (an ``invoke_subgraph`` call) that takes one of ``gm``'s
    int inputs (a size Dynamo traced symbolic) gets a copy of its subgraph with that int written in, and
    the call loses that operand. Inductor's compile from static example inputs otherwise passes the int
    to the region as a literal and then fails on it ("Expected Node with 'val' in meta"; seen on torch
    2.13, not tried on 2.11). Calls of one region with the same ints share one copy, so it still compiles
    once."""
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ints = {p: a for p, a in zip(placeholders, args) if isinstance(a, int) and not isinstance(a, bool)}
    if hop is None or not ints:
        return gm
    made: dict[tuple, tuple[torch.fx.Node, str]] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not hop or len(node.args) < 2:
            continue
        sub, ident, *operands = node.args
        fixed = {i: ints[o] for i, o in enumerate(operands) if isinstance(o, torch.fx.Node) and o in ints}
        if not fixed or not (isinstance(sub, torch.fx.Node) and sub.op == "get_attr"):
            continue
        key = (sub.target, tuple(sorted(fixed.items())))
        if key not in made:
            region = getattr(gm, sub.target)
            copied = torch.fx.GraphModule(region, copy.deepcopy(region.graph), class_name=type(region).__name__)
            inputs = [n for n in copied.graph.nodes if n.op == "placeholder"]
            for i, value in fixed.items():
                def written_in(a: torch.fx.Node, p: torch.fx.Node = inputs[i], v: int = value) -> Any:
                    return v if a is p else a

                for user in list(inputs[i].users):
                    user.args, user.kwargs = (torch.fx.node.map_arg(user.args, written_in),
                                              torch.fx.node.map_arg(user.kwargs, written_in))
                copied.graph.erase_node(inputs[i])
            copied.recompile()
            suffix = "_at_" + "_".join(f"{i}x{v}" for i, v in sorted(fixed.items()))
            name = f"{sub.target}{suffix}".replace(".", "_")
            setattr(gm, name, copied)
            with gm.graph.inserting_before(node):
                made[key] = (gm.graph.get_attr(name), f"{ident}{suffix}")
        attr, new_ident = made[key]
        node.args = (attr, new_ident, *(o for i, o in enumerate(operands) if i not in fixed))
        if not sub.users:
            gm.graph.erase_node(sub)
    if made:
        gm.graph.lint()
        gm.recompile()
    return gm
