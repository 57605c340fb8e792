"""Dynamo: marking dims dynamic, reading argument names from guard sources, telling trace
errors apart, and the locks compiles share with it."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from shapewise._compat.shapes import is_traceable_wrapper_subclass, sym_expr

__all__ = [
    "access_path", "backend_error_cause", "calls_during_fx_trace", "clear_static_address", "compile_lock",
    "dict_version",
    "dynamic_int_sources", "dynamo_unique_graphs", "has_static_address", "is_graph_break",
    "is_internal_dynamo_error", "is_trace_error", "local_name_of", "mark_dynamic", "marks_taken_off", "held_at",
    "member_name",
    "is_recompile_limit", "is_whole_argument", "own_recompile_budget", "placeholder_source", "quiet_guard_errors",
    "rank_and_world", "SOURCE_META",
    "size_source", "source_name", "storage_key",
    "STORED_TENSOR", "StoredSize", "NOT_SET", "tensor_checks", "trace_side_effects", "unmark_dynamic",
]


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


class _GuardErrorFilter:
    """Drops the two records Dynamo logs when a guard cannot be made ("Error while creating
    guard", "Created at"): the error is raised too, and shapewise handles it (a dim marked dynamic
    that the model specialised: traced again with it fixed) or raises it with its message."""

    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith(("Error while creating guard", "Created at:"))


@contextlib.contextmanager
def quiet_guard_errors() -> Iterator[None]:
    import logging

    logger, flt = logging.getLogger("torch._guards"), _GuardErrorFilter()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


@contextlib.contextmanager
def dynamic_int_sources(names: Sequence[str]) -> Iterator[None]:
    """Trace the Python ints Dynamo reads at these sources (``L['kwargs']['cache'].layers[0].n``,
    Dynamo's spelling) as symbols instead of constants guarded by value
    (``torch.compiler.config.dynamic_sources``; other sources set there are kept)."""
    if not names:
        yield
        return
    import torch.compiler.config as compiler_config

    before = compiler_config.dynamic_sources
    with compiler_config.patch(dynamic_sources=",".join(x for x in (before, *names) if x)):
        yield


def member_name(source) -> str | None:
    """The attribute an attribute source reads (``...layers[0].cumulative_length`` →
    ``cumulative_length``), else None."""
    from torch._dynamo.source import AttrSource

    return source.member if isinstance(source, AttrSource) else None


def held_at(source) -> str | None:
    """The attribute a source's value is held at, through list and dict items
    (``...layers[0].conv_states[1]`` → ``conv_states``), else None."""
    from torch._dynamo.source import AttrSource, DictGetItemSource, GetItemSource

    while isinstance(source, (GetItemSource, DictGetItemSource)):
        source = source.base
    return source.member if isinstance(source, AttrSource) else None


#: Where a placeholder keeps its Dynamo ``Source`` once Dynamo has dropped its ``grapharg`` (torch's
#: ``aot_compile_fullgraph`` calls the backend after that; ``precompile.placeholder_sources_kept``).
SOURCE_META = "shapewise_source"


def placeholder_source(node: torch.fx.Node):
    """The Dynamo ``Source`` a placeholder was lifted from (None outside Dynamo graphs)."""
    grapharg = node.meta.get("grapharg")
    return getattr(grapharg, "source", None) if grapharg is not None else node.meta.get(SOURCE_META)


def is_whole_argument(source) -> bool:
    """Whether a Dynamo source is one argument of the call as a whole: a local variable of the
    traced frame (``L['x']``), or one item of a wrapper's ``*args`` / ``**kwargs``
    (``L['args'][1]``, ``L['kwargs']['input_ids']``), not an element or attribute of one."""
    from torch._dynamo.source import DictGetItemSource, GetItemSource, LocalSource

    if isinstance(source, (GetItemSource, DictGetItemSource)):
        base = source.base
        return isinstance(base, LocalSource) and base.local_name in ("args", "kwargs")
    return isinstance(source, LocalSource)


def access_path(source) -> tuple[Any, tuple[tuple[str, Any], ...]] | None:
    """``(the argument's source, steps)`` for a source that reads inside one argument through
    attributes and items (``L['kwargs']['cache'].layers[0].keys`` -> the ``cache`` argument,
    ``(("attr", "layers"), ("item", 0), ("attr", "keys"))``); steps are empty for the argument
    itself. None for any other source (a global, a type, a slice)."""
    from torch._dynamo.source import AttrSource, DictGetItemSource, GetItemSource

    steps = []
    while not is_whole_argument(source):
        if isinstance(source, AttrSource) and isinstance(source.member, str) and source.member.isidentifier():
            steps.append(("attr", source.member))
        elif (isinstance(source, (GetItemSource, DictGetItemSource)) and type(source.index) in (int, str)
              and not getattr(source, "index_is_slice", False)):
            steps.append(("item", source.index))
        else:
            return None
        source = source.base
    return source, tuple(reversed(steps))


def trace_side_effects() -> list[tuple[Any, str, Any, Any, Any]] | str | None:
    """What the trace Dynamo is compiling now changes in Python state that existed before the
    call, which its frame replays after the graph: ``[(object's source, attribute, new value,
    value before, the object), ...]`` for attributes it sets (new value: ``STORED_TENSOR`` for a tensor
    the graph computes, a KV cache's ``layer.keys = torch.cat(...)``, else the constant; value
    before: the attribute's value now, during the trace, or ``NOT_SET``), or why the changes are of
    another kind (a list appended to, an attribute set to an object, a global). A dict whose items
    end as they began (transformers swapping a linear's DTensor weights for local ones and back)
    and the frame's own ``**kwargs`` are no change. None where this torch does not say (called
    outside a trace, or its internals moved)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.base import AttributeMutationNew, ValueMutationNew

        tx = InstructionTranslator.current_tx()
        side_effects = tx.output.side_effects
        modified = side_effects._get_modified_vars()
        stores = side_effects.store_attr_mutations
    except Exception:  # noqa: BLE001 - private internals: no answer rather than a failed compile
        return None
    out = []
    own = _own_kwargs(tx)
    for var in modified:
        if isinstance(var.mutation_type, (AttributeMutationNew, ValueMutationNew)):
            continue  # an object the call creates: not state that outlives the call unless stored somewhere
        if own is not None and type(var.source).__name__ == "LocalSource" and var.source.local_name == own:
            continue  # the frame's own **kwargs: a dict Python builds afresh for each call
        where = source_name(var.source) if var.source is not None else type(var).__name__
        if var not in stores:
            if _dict_as_it_was(var, tx):
                continue
            return f"the forward changes {where} in place (a list, dict or cell: Dynamo replays it after the graph)"
        obj = getattr(var, "value", NOT_SET)
        if obj is NOT_SET or var.source is None:
            return f"the forward sets attributes of {where}, which a direct call cannot reach"
        for attr, value in stores[var].items():
            if type(value).__name__ == "TensorVariable":
                new = STORED_TENSOR
            elif value.is_python_constant():
                new = value.as_python_constant()
            elif type(value).__name__ == "SymNodeVariable" and isinstance(getattr(value, "sym_num", None),
                                                                           torch.SymInt):
                new = StoredSize(sym_expr(value.sym_num))  # a traced int (a token counter's n + 1)
            else:
                return f"the forward sets {where}.{attr} to a {type(value).__name__} (Dynamo replays it, a direct " \
                       "call would not)"
            out.append((var.source, attr, new, getattr(obj, attr, NOT_SET), obj))
    return out


#: ``trace_side_effects``: a value that is a tensor the graph computes; an attribute that was not there.
STORED_TENSOR, NOT_SET = object(), object()


class StoredSize(tuple):
    """``trace_side_effects``: an int attribute set to an expression of the trace's sizes
    (``StoredSize((expr,))``; ``.expr``), which the caller computes from the call's sizes."""

    def __new__(cls, expr: Any) -> StoredSize:
        return super().__new__(cls, (expr,))

    def __getnewargs__(self) -> tuple[Any]:  # pickles as it was made (a warm trace saves it)
        return (self[0],)

    @property
    def expr(self) -> Any:
        return self[0]


def _dict_as_it_was(var: Any, tx: Any) -> bool:
    """Whether a dict the trace changed ends as it began: the same keys, each holding the object
    the dict held at that key before the call (so replaying it is a no-op). Cannot tell: False."""
    items = getattr(var, "items", None)
    if not isinstance(items, dict) or var.source is None:
        return False
    root = tx.output.root_tx
    scope = ({**root.f_globals, "G": root.f_globals}, {"L": root.f_locals}, {})  # sources spell L[...], G[...]
    try:
        before = var.source.get_value(*scope)
        after = {key.vt.as_python_constant(): value for key, value in items.items()}
        return (isinstance(before, dict) and list(before) == list(after)
                and all(v.source is not None and v.source.get_value(*scope) is before[k] for k, v in after.items()))
    except Exception:  # noqa: BLE001 - a key or a value it cannot spell, an older torch
        return False


def _own_kwargs(tx: Any) -> str | None:
    """The name of the traced frame's ``**kwargs`` dict (transformers' forward decorators take
    one and pop from it), else None."""
    import inspect

    try:
        code = tx.output.root_tx.f_code
    except AttributeError:
        return None
    if not code.co_flags & inspect.CO_VARKEYWORDS:
        return None
    at = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
    return code.co_varnames[at]


def size_source(source, prop: str = "size"):
    """(the tensor's source, dim) when ``source`` reads a size of a tensor (``L['x'].size()[0]``;
    ``prop="stride"``: a stride, ``L['x'].stride()[1]``; ``"storage_offset"``: its offset, dim None), else None."""
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    if prop == "storage_offset":  # (the tensor's source, None): L['x'].storage_offset()
        ok = isinstance(source, TensorPropertySource) and source.prop == TensorProperty.STORAGE_OFFSET
        return (source.base, None) if ok else None
    want = TensorProperty.SIZE if prop == "size" else TensorProperty.STRIDE
    if isinstance(source, TensorPropertySource) and source.prop == want and source.idx is not None:
        return source.base, source.idx
    return None


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


# The attributes Dynamo's dim marks live in, on the tensor (guarded on: a tensor carrying a mark
# the trace's did not fails its guards), and the marks' state before ``marks_taken_off`` (per thread).
_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_dynamic_range",
          "_dynamo_hint_overrides", "_has_dynamo_dim_marking", "_specialize_on")
_JOURNAL = threading.local()
_ABSENT = object()


def _journal_marks(journal: dict[int, Any], t: torch.Tensor) -> None:
    """Keep ``t``'s marks as they are now, and those of its inner tensors where it is a tensor
    subclass (Dynamo's ``mark_dynamic`` marks the inner tensors of the same rank as well)."""
    if id(t) not in journal:
        journal[id(t)] = (t, {a: copy.copy(v) for a in _MARKS if (v := getattr(t, a, _ABSENT)) is not _ABSENT})
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name, None)
            if isinstance(inner, torch.Tensor):
                _journal_marks(journal, inner)


def mark_dynamic(t: torch.Tensor, dim: int, strict: bool = True) -> None:
    journal = getattr(_JOURNAL, "was", None)
    if journal is not None:
        _journal_marks(journal, t)
    if strict:
        torch._dynamo.mark_dynamic(t, dim)
    else:
        torch._dynamo.maybe_mark_dynamic(t, dim)


@contextlib.contextmanager
def marks_taken_off() -> Iterator[None]:
    """The dim marks ``mark_dynamic`` puts on tensors inside the block are taken off at its end
    (each tensor's marks as they were before): a trace marks the caller's tensors, and a mark left
    on one would fail the guards of a trace made without it when the tensor comes again (a prompt
    handed to a second model, or to a warm start's loaded trace in the same process)."""
    outer, _JOURNAL.was = getattr(_JOURNAL, "was", None), {}
    try:
        yield
    finally:
        journal, _JOURNAL.was = _JOURNAL.was, outer
        for t, was in journal.values():
            for a in _MARKS:
                if a in was:
                    setattr(t, a, was[a])
                elif hasattr(t, a):
                    delattr(t, a)


def has_static_address(t: torch.Tensor) -> bool:
    """Whether ``t`` was marked as living at one address across calls
    (``torch._dynamo.mark_static_address``: transformers' static KV cache)."""
    return getattr(t, "_dynamo_static_input_type", None) is not None


def clear_static_address(t: torch.Tensor) -> None:
    """Undo ``torch._dynamo.mark_static_address`` (its mark is an attribute on the tensor)."""
    if hasattr(t, "_dynamo_static_input_type"):
        del t._dynamo_static_input_type


def unmark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Undo ``mark_dynamic`` for one dim (Dynamo keeps the marks as sets on the tensor)."""
    for attr in ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices"):
        marks = getattr(t, attr, None)
        if isinstance(marks, set):
            marks.discard(dim)


def is_trace_error(e: BaseException) -> bool:
    """Whether ``e`` was raised while Dynamo traced (it refused the code, a dim marked dynamic
    was specialised, or the backend failed), not by running what it compiled."""
    from torch._dynamo.exc import TorchDynamoException
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    return isinstance(e, (TorchDynamoException, ConstraintViolationError))


def is_internal_dynamo_error(e: BaseException) -> bool:
    """Whether ``e`` is Dynamo failing in its own code, or refusing what it traced (a
    data-dependent size it cannot specialise: ``UserError``, or a guard on one while tracing:
    ``GuardOnDataDependentSymNode``, e.g. ``x.split(counts.tolist())``), not the model's own error."""
    from torch._dynamo.exc import InternalTorchDynamoError, UserError
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(e, (InternalTorchDynamoError, UserError, GuardOnDataDependentSymNode))


def is_graph_break(e: BaseException) -> bool:
    """Whether ``e`` is Dynamo refusing to trace some code in one graph (fullgraph=True)."""
    from torch._dynamo.exc import Unsupported

    return isinstance(e, Unsupported)


def source_name(source: Any) -> str:
    """How Dynamo spells a source (``L['args'][0]._modules['model']``): a property in newer
    torch, a method in older; a temporary of the trace, which has no name: its kind."""
    try:
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
    except NotImplementedError:
        return type(source).__name__
    return name if isinstance(name, str) else str(source)


def is_recompile_limit(e: BaseException) -> bool:
    """Whether ``e`` is Dynamo refusing a new trace because the code's recompile limit is reached
    (fullgraph=True makes that an error; ``own_recompile_budget`` lifts it for one trace)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    return isinstance(e, FailOnRecompileLimitHit)


def backend_error_cause(e: BaseException) -> BaseException | None:
    """The exception a Dynamo backend raised, if ``e`` is Dynamo's wrapper around one."""
    from torch._dynamo.exc import BackendCompilerFailed

    if isinstance(e, BackendCompilerFailed):
        return getattr(e, "inner_exception", None) or e.__cause__
    return None




def storage_key(t: torch.Tensor) -> Any:
    """A hashable identity of ``t``'s storage (shared by all its views; fake tensors included)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


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


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default torch.distributed process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def tensor_checks(examples: Sequence[torch.Tensor], sizes: Sequence[Sequence[int | None]],
                  strides: Sequence[Sequence[int | None]]) -> Any:
    """One C++ check of many tensors, as Dynamo guards a tensor (``TensorGuards``): each of the
    Python type, dispatch keys (so device type and autograd state), dtype, device index and
    ``requires_grad`` of its example, and the sizes and strides given (None: not checked).
    ``.check(*tensors)`` says whether all hold."""
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(*examples, dynamic_dims_sizes=[list(s) for s in sizes],
                        dynamic_dims_strides=[list(s) for s in strides])


def _dict_version() -> Any:
    """Dynamo's ``dict_version(d)``: a number that changes whenever ``d`` changes and that no
    other dict (alive now or later) has had (CPython's ``ma_version_tag`` before 3.12, a dict
    watcher's counter from 3.12). None where torch has none or it does not behave so here."""
    try:
        from torch._C._dynamo.guards import dict_version as version
    except ImportError:
        return None

    class Probe:
        pass

    try:
        probe = Probe()
        probe.x = 1
        held = vars(probe)
        was = version(held)
        probe.x = 2
        other = vars(Probe())
        if version(held) == was or version(other) in (was, version(held)):
            return None
    except Exception:  # noqa: BLE001 - not a dict version after all
        return None
    return version


#: ``dict_version`` where it behaves as documented there, else None (direct calls check every attribute).
dict_version = _dict_version()
