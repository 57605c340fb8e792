"""``shapewise.compile``: the model wrapper that marks the dims, runs Dynamo with the
"shapewise" backend, and traces again only where the model's own Python branches on a size
(see the README's trace rule). ``ShapewiseModule`` is what it returns."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from shapewise import _compat
from shapewise.backend import _PIPELINE_KEYS, DEFAULT_DIM_NAME, _op_list, build_pipeline, shapewise_backend
from shapewise.concretize import check_sizes, make_bindings, refusal
from shapewise.direct import MISS, DirectCalls, bound_module, build_direct_call, self_in_args
from shapewise.dispatch.runnable import CompileReport, Runnable
from shapewise.errors import BindingError, ConfigError, DispatchMiss, ShapewiseError
from shapewise.ir.program import Program, ShapeInfo
from shapewise.lower import parallel, workers
from shapewise.marks import UnmarkedChanges, held_tensors, int_sources, parse_dynamic_dims, tensors_of
from shapewise.trace_errors import trace_error
from shapewise.trace_limit import TraceLimit
from shapewise.warm import WarmTraces, direct_installer

__all__ = ["NoDynamicSizes", "ShapewiseModule", "compile"]

log = logging.getLogger("shapewise")


class NoDynamicSizes(BindingError):
    """The model fixed every marked dim in this trace (perhaps only at this call's sizes)."""


class _UnmarkedRetrace(Exception):  # raised by the backend for a Dynamo trace that did not come through _first_call
    """(Where torch has compile-start callbacks, ``_compat.no_new_trace`` refuses it before it runs.)"""


class ShapewiseModule:
    """What ``shapewise.compile`` returns: call it like the model. The first call traces once with Dynamo
    and compiles every size (with compile workers: its own, the rest loaded on first use or by
    ``wait()``); later calls dispatch. ``report()``, ``runnable``, ``program``, ``traces`` after it."""

    def __init__(self, model: Callable[..., Any], *, sizes: Any = (), ranges: Any = (),
                 splitting_ops: Sequence[Any] = (), dynamic_dims: Mapping[str, Any] | None = None,
                 backend: Any = "inductor", on_miss: str = "error", direct_call: bool = False,
                 warm_start: bool = False, max_traces: Any = "auto", **pipeline_options: Any) -> None:
        unknown = set(pipeline_options) - _PIPELINE_KEYS
        if unknown:
            raise ConfigError(f"unknown option(s) {sorted(unknown)} for shapewise.compile; known: "
                              f"sizes, ranges, splitting_ops, dynamic_dims, backend, on_miss, direct_call, max_traces, "
                              f"{', '.join(sorted(_PIPELINE_KEYS - {'sizes', 'ranges', 'splitting_ops', 'backend'}))}")
        if on_miss not in ("error", "dynamic", "eager"):
            raise ConfigError(f"on_miss must be 'error', 'dynamic' or 'eager', got {on_miss!r}")
        if not isinstance(warm_start, bool):
            raise ConfigError(f"warm_start must be True or False, got {warm_start!r}")
        self.model = model
        fn = model.forward if isinstance(model, torch.nn.Module) else model
        self._signature = inspect.signature(fn)
        params = self._signature.parameters
        self._positional = [n for n, p in params.items()
                            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        self._var_names = tuple(next((n for n, p in params.items() if p.kind == kind), None)
                                for kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD))
        # L['args'][i] in Dynamo's frame: a forward under a (*args, **kwargs) decorator (transformers')
        # gets the module itself as args[0], so a positional input_ids is args[1].
        self._source_positional = (["self", *self._positional] if self_in_args(model) else self._positional)
        # Per argument its marked dims; per object argument its ints traced as sizes, its tensors' dims.
        self._dims, self._int_attrs, self._tensor_attrs = parse_dynamic_dims(dynamic_dims, fn, params)
        check_sizes(sizes, ranges, names=self._declared_names())  # before any trace: a typo costs no trace
        self._options = dict(sizes=sizes, ranges=ranges, splitting_ops=_op_list(splitting_ops), backend=backend,
                             **pipeline_options)
        build_pipeline(**self._options)  # validates op names, backend, options before any trace
        if backend == "inductor":
            workers.warm_up(self._options)  # Inductor's compile threads; shapewise's compile workers where asked
        self._on_miss, self._traces = on_miss, TraceLimit(max_traces, sizes, ranges)  # (shapewise/trace_limit.py)
        self._symbol_names: dict[sympy.Symbol, str] = {}
        self._arg_dims: dict[str, dict[int, str]] = {}
        self._object_args: set[str] = set()  # marked through the tensors they hold (a KV cache)
        self._int_sources: list[str] = []  # this call's marked ints, as Dynamo names their sources
        self.runnables: list[Runnable] = []
        # Per trace: the dims it fixed ({"seq": 1}), None for a dim it does not have ({"kv": None}).
        self.trace_fixed: list[dict[str, int | None]] = []
        self._watch: Any = None  # compile="lazy" / "background": whether compiles may still run
        self._lock, self._local = threading.Lock(), threading.local()
        self._frames: set[int] = set()  # Dynamo's id of the code it traces (no_new_trace refuses its unmarked traces)
        self._unmarked = UnmarkedChanges()  # warns when a dim no mark covers makes Dynamo trace again
        self._compiled = torch.compile(model, backend=self._backend, dynamic=False, fullgraph=True)
        self._warm = WarmTraces(model, self._options, dynamic_dims) if warm_start else None
        self._warm_off: str | None = None  # why warm starts went off after a trace torch could not save
        self._direct_call = bool(direct_call)
        self._directs = DirectCalls(self._direct_call)
        if self._warm is not None and self._direct_call:
            self._warm.first_call = direct_installer(self)
        # Hooks (compile_generate): after every call, (args, kwargs, output); a DispatchMiss's note, (args, kwargs).
        self.after_call: Callable[[tuple, dict, Any], None] | None = None
        self.miss_note: Callable[[tuple, dict], str | None] | None = None

    def __reduce__(self) -> Any:  # a stand-in in a saved trace's guard state (model.forward = fast), else refused
        return _compat.guard_stand_in(self)

    def _declared_names(self) -> set[str]:
        """Every dim name ``dynamic_dims`` declares (the default's ``n`` without one)."""
        specs = [*(self._dims or {"": {0: DEFAULT_DIM_NAME}}).values(), *self._int_attrs.values(),
                 *(d for attrs in self._tensor_attrs.values() for d in attrs.values())]
        return {n for spec in specs for n in spec.values()}

    def _dims_at(self, arg: str, attr: str | None) -> dict[int, str]:
        """The marked dims of a tensor of ``arg`` held at attribute ``attr`` (None: the argument itself)."""
        return self._tensor_attrs.get(arg, {}).get(attr, self._arg_dims.get(arg, {}))

    def _mark(self, args: tuple, kwargs: dict, fixed: Mapping[str, int] | None = None) -> dict[str, set[int]]:
        """Mark this call's dynamic dims dynamic but the ``fixed`` names (earlier marks off); each name's sizes."""
        bound = self._signature.bind(*args, **kwargs)
        dims = self._dims
        if dims is None:
            dims = {k: {0: DEFAULT_DIM_NAME} for k, v in bound.arguments.items()
                    if any(t.dim() > 0 for t in tensors_of(v))}
        dims = {a: spec for a, spec in dims.items() if bound.arguments.get(a) is not None}  # optional, left out
        arg_dims: dict[str, dict[int, str]] = {}
        objects: set[str] = set()
        seen: dict[str, set[int]] = {}
        for arg, spec in dims.items():
            value = bound.arguments[arg]
            deep = not isinstance(value, (torch.Tensor, tuple, list, int, float, complex, str))  # a KV cache
            held = held_tensors(value) if deep else [(t, None) for t in tensors_of(value)]
            tensors = [t for t, _ in held]
            if not tensors and not deep:
                raise ConfigError(f"dynamic_dims names {arg!r}, but it is a {type(value).__name__} "
                                  "with no tensor in it (a tensor, a tuple/list of tensors or an object holding "
                                  "tensors, such as a KV cache, can vary)")
            for t, attr in held:  # a tuple/list/object argument: the dim of each of its tensors
                for d, name in self._tensor_attrs.get(arg, {}).get(attr, spec).items():
                    if not -t.dim() <= d < t.dim():
                        if self._dims is None or deep:  # an object's other tensors (an empty cache's)
                            continue
                        raise ConfigError(f"dynamic_dims names dim {d} of {arg!r}, which has {t.dim()} dims")
                    seen.setdefault(name, set()).add(int(t.shape[d]))
                    if fixed and name in fixed:
                        _compat.unmark_dynamic(t, d % t.dim())
                        continue
                    # Dims the user named must stay dynamic (Dynamo errors if the model fixes
                    # them); the default (dim 0 of every tensor) only where the model lets it vary.
                    _compat.mark_dynamic(t, d % t.dim(), strict=self._dims is not None and not deep)
            if deep:
                objects.add(arg)
                arg_dims[arg] = dict(spec)  # read per tensor (an object's tensors differ in rank)
            elif tensors:
                ndim = tensors[0].dim()
                arg_dims[arg] = {d % ndim if ndim else d: n for d, n in spec.items()}
        self._arg_dims, self._object_args = arg_dims, objects
        self._int_sources = int_sources(bound, self._int_attrs, fixed, self._source_positional)
        return seen

    def _to_fix(self, seen: Mapping[str, set[int]]) -> dict[str, int]:
        """The dims of a re-trace to specialise, as Dynamo alone would: a size 0 or 1 that every earlier trace
        refuses (seq=1 where the model branches on ``seq > 1``), or that an earlier trace fixed (this call
        failed its guards for another reason: a KV cache laid out otherwise after the first decode step)."""
        fix = {}
        for name, values in seen.items():
            if len(values) != 1 or next(iter(values)) not in (0, 1):
                continue
            v = next(iter(values))
            earlier = list(zip(self.runnables, self.trace_fixed))
            if any(fixed.get(name) == v for _, fixed in earlier) or all(
                    name in fixed or refusal(r.program.shapes, name, v) is not None for r, fixed in earlier):
                fix[name] = v
        return fix

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Runnable:
        if not getattr(self._local, "tracing", False):
            # Dynamo re-traces on a guard failure (grad mode, requires_grad, dtype, a size) with this call's
            # tensors, unmarked: the graph would be static. Refused; __call__ marks them and traces again.
            raise _UnmarkedRetrace
        names: dict[sympy.Symbol, str] = {}
        specialised: dict[str, int] = {}
        sizes: dict[str, tuple[str | None, list[int | None]]] = {}  # source -> (argument, its static sizes)
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            source = _compat.placeholder_source(node)
            arg = _compat.local_name_of(source, self._source_positional, *self._var_names,
                                        keywords=self._signature.parameters)
            value = _compat.node_value(node)
            if arg is not None and isinstance(value, torch.Tensor):
                sizes[_compat.source_name(source)] = (arg, [d if isinstance(d, int) else None for d in value.shape])
            attr = _compat.member_name(source) if arg in self._int_attrs else None
            if attr in self._int_attrs.get(arg, {}) and isinstance(value, torch.SymInt):
                e = _compat.sym_expr(value)
                if isinstance(e, sympy.Symbol):
                    names.setdefault(e, self._int_attrs[arg][attr])
            if arg in self._arg_dims and isinstance(value, torch.Tensor):
                held_at = _compat.held_at(source) if arg in self._tensor_attrs else None
                for d, name in self._dims_at(arg, held_at).items():
                    if not -value.dim() <= d < value.dim():
                        continue
                    e = _compat.sym_expr(value.shape[d])
                    if isinstance(e, sympy.Symbol):
                        names.setdefault(e, name)
                    elif arg not in self._object_args and isinstance(e, (int, sympy.Integer)):
                        specialised.setdefault(name, int(e))  # a tensor argument's dim Dynamo fixed
        self._symbol_names = names
        fixed = dict(getattr(self._local, "fixed", None) or {})
        asked = self._options.get("sizes") or self._options.get("ranges")
        if not self.runnables and all(v is None for v in fixed.values()) and asked and not any(
                _compat.sym_expr(e).free_symbols for n in gm.graph.nodes if n.op == "placeholder"
                for v in [_compat.node_value(n)] for e in (v.shape if isinstance(v, torch.Tensor) else
                                                           [v] if isinstance(v, torch.SymInt) else [])):
            marked = ", ".join(f"dim {list(d)} of {a!r}" for a, d in self._arg_dims.items()) or "none"
            raise NoDynamicSizes(
                f"the trace has no dynamic size, so there is nothing to bind the sizes and ranges to: the model "
                f"fixes every dim that was marked dynamic (marked: {marked}); name the dims that vary with "
                "dynamic_dims={argument: dim}")
        # The first trace leaves out single sizes its guards refuse (a call at one traces again,
        # at that size; e.g. a trace at batch 1 specialised to it) and refuses such ranges up
        # front. A later trace exists because a call failed the first one's guards: it serves the
        # sizes its own guards allow (a size only the first trace can serve is skipped, not an
        # error for a call that did not ask for it).
        # A named dim with no symbol of its own in this trace (absent from the call, or Dynamo
        # proved it equal to another, as a mask's length to the tokens' at prefill) follows the
        # others: every size of it agrees with this trace.
        declared = self._declared_names() if self._dims is not None else set()
        # A name the trace has a tensor argument's dim of, as a constant (the model specialised it,
        # e.g. by a Python loop over the length): this trace serves that size alone.
        fixed.update({n: specialised.get(n) for n in sorted(declared - set(names.values()) - set(fixed))})
        runnable = shapewise_backend(gm, example_inputs, {**self._options, "symbol_names": names,
                                                          "on_miss": self._on_miss, "fixed": fixed,
                                                          "refused": "skip" if self.runnables else "skip-sizes"})
        try:
            self._unmarked.check(sizes, self._arg_dims, len(self.runnables) + 1)
        except Exception as e:  # noqa: BLE001 - a diagnostic never fails a trace
            log.debug("shapewise: the unmarked-dim check failed: %s", e)
        self.runnables.append(runnable)
        self.trace_fixed.append(fixed)
        self._frames.update({_compat.current_frame_id()} - {None})
        self._watch = runnable.runtime.watch or self._watch
        return self._direct_for(gm, example_inputs, runnable)

    def _direct_for(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], runnable: Runnable) -> Any:
        """What Dynamo calls for this trace: the runnable, or with ``direct_call``, a recorder of its
        outputs until a call arms this trace's direct call (``shapewise.direct``)."""
        if not self._directs.enabled or self._warm is not None:  # (a warm trace's: at its first call)
            return runnable
        built = self._direct_off() or build_direct_call(gm, example_inputs, runnable, bound_module(self.model),
                                         self._source_positional, self._var_names, self._signature.parameters,
                                         _compat.trace_side_effects())
        return self._directs.add_trace(len(self.runnables) - 1, built, runnable)

    def _direct_off(self) -> str | None:
        """Why no direct call can serve this module's calls (None: one can)."""
        if self._on_miss != "error":
            return f"on_miss={self._on_miss!r} serves sizes past the trace's guards (direct calls need on_miss='error')"
        return f"compile={self._options.get('compile')!r} (direct calls need 'eager_all')" if self._watch else None

    @property
    def direct_info(self) -> str:
        """Whether calls go past Dynamo's frame (``direct_call=True``), per trace, and why not."""
        return self._directs.info(self._trace_label, len(self.runnables))

    @property
    def direct_calls(self) -> int:  # calls served past Dynamo's frame
        return self._directs.calls

    @property
    def direct_fallbacks(self) -> int:  # calls that went through Dynamo while some trace's direct call was on
        return self._directs.fallbacks

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        directs = self._directs
        out = directs(args, kwargs) if directs.armed else MISS
        if out is MISS:
            try:
                out = self._call(args, kwargs)
            except BaseException:
                directs.forget()  # a failed call arms nothing
                raise
            if directs.pending:
                directs.arm(args, kwargs, self._positional, out, self._trace_label)
        if self.after_call is not None:
            self.after_call(args, kwargs, out)
        return out

    def _call(self, args: tuple, kwargs: dict) -> Any:
        try:
            if self._warm is not None:
                self._load_warm()
                out = self._warm.serve(args, kwargs, MISS)
                return out if out is not MISS else self._first_call(args, kwargs, retrace=bool(self.runnables))
            if self.runnables:
                # A trace Dynamo starts here is unmarked: refused before it runs (no_new_trace), else by the backend;
                # or Dynamo's recompile limit was reached. Traced again, marked, on a budget of its own.
                with _compat.no_new_trace(self._frames) as refusal:
                    try:
                        if (self._watch is not None and self._watch.active) or parallel.PendingVariant.unresolved:
                            with _compat.calls_during_fx_trace():  # a lazy / background / pending compile may trace
                                return self._compiled(*args, **kwargs)
                        return self._compiled(*args, **kwargs)
                    except Exception as e:
                        if not (refusal.refused or isinstance(_compat.backend_error_cause(e), _UnmarkedRetrace)
                                or _compat.is_recompile_limit(e)):
                            raise
                return self._first_call(args, kwargs, retrace=True)
            return self._first_call(args, kwargs)
        except Exception as e:
            if isinstance(e, DispatchMiss):
                hook = self.miss_note(args, kwargs) if self.miss_note is not None else None
                for note in filter(None, (len(self.runnables) > 1 and self._traces_note(), hook)):
                    e.add_note(note)
            clear = trace_error(e, self.model)
            if clear is None:
                raise
            raise clear.with_traceback(None) from clear.__cause__

    def _traces_note(self) -> str:
        """Which sizes each trace serves (a call goes to the first trace whose guards it passes)."""
        parts = [f"trace {self._trace_label(i)}: " + (", ".join(row["key"] for row in r.table.rows())
                                                    or "none (its guards refuse every size asked for)")
                 for i, r in enumerate(self.runnables)]
        return ("shapewise: this model has several traces (a call that fails every trace's guards makes a new one, "
                "for the sizes its own guards allow): " + "; ".join(parts))

    def _first_call(self, args: tuple, kwargs: dict, retrace: bool = False) -> Any:
        """Trace (the first call, or a re-trace after a guard failed) with the dynamic dims of this call's tensors
        marked and sizes 0/1 not specialised, except where no trace symbolic in them can serve this call: a size
        0/1 every earlier trace refuses, or a trace Dynamo cannot make symbolic at this call (the model's Python
        branches on a size 0/1, or specialises this size outright): then its sizes 0/1, then all its sizes, are
        fixed, as Dynamo would fix them alone; that trace serves those sizes. The marks come off after."""
        with self._lock, _compat.marks_taken_off():
            if self.runnables and not retrace:
                out = self._compiled(*args, **kwargs) if self._warm is None else self._warm.serve(args, kwargs, MISS)
                if out is not MISS:
                    return out
            if not self._traces.allows(len(self.runnables)):  # fits no trace, and no more are made: uncompiled
                if not self._traces.reached:
                    self._compiled = self._traces.past(getattr(self.model, "__qualname__", type(self.model).__name__),
                                                       self._compiled)
                return self.model(*args, **kwargs)
            seen = self._mark(args, kwargs)
            fixed = self._to_fix(seen) if self.runnables else {}
            # Then, if Dynamo cannot trace this call symbolic in them: its sizes 0/1 fixed, then every size it
            # has (the model specialises it: a view valid only where T - 1 == 1), as Dynamo would alone.
            single = {name: next(iter(v)) for name, v in seen.items() if len(v) == 1}
            small = {name: v for name, v in single.items() if v in (0, 1)}
            attempts = [fixed]
            for more in ({**small, **fixed}, {**single, **fixed}):
                if more not in attempts:
                    attempts.append(more)
            for i, attempt in enumerate(attempts):
                if attempt:  # each attempt fixes a superset of the last; none: the marks made above
                    self._mark(args, kwargs, attempt)
                count = len(self.runnables)
                try:
                    return self._trace(args, kwargs, attempt)
                except Exception as e:
                    cause = _compat.backend_error_cause(e)
                    serves = isinstance(cause, NoDynamicSizes) and self._serves(single)
                    if isinstance(cause, NoDynamicSizes) and single and not serves:
                        note = self.miss_note(args, kwargs) if self.miss_note is not None else None
                        raise NoDynamicSizes(
                            f"{cause}. At this call the model fixes {single}, and no size or range asked for holds "
                            "that: add it to sizes (each size the model fixes is a trace of its own)"
                            + (f". {note}" if note else "")) from None
                    if i == len(attempts) - 1 or not _compat.is_trace_error(e) or (
                            isinstance(cause, ShapewiseError) and not serves):
                        raise
                    # Dynamo refused the trace after handing it over (a dim marked dynamic was
                    # specialised): it installed nothing, so neither does shapewise.
                    del self.runnables[count:], self.trace_fixed[count:]
                    self._directs.truncate(count)
                    if self._warm is not None:
                        self._warm.forget(count)
                    pinned = {n: v for n, v in attempts[i + 1].items() if v not in (0, 1) and n not in attempt}
                    log.log(logging.WARNING if pinned and self.runnables else logging.INFO,
                            "shapewise: the trace with %s fixed failed (%s: %s); tracing again with %s fixed%s",
                            attempt or "no size", type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                            attempts[i + 1], f" (the model fixes {pinned}: each other size of them is a trace of its "
                            "own; TORCH_LOGS=dynamic names the line that fixes them)" if pinned else "")

    def _serves(self, sizes: Mapping[str, int]) -> bool:
        """Whether a trace fixed at ``sizes`` would serve any of the requested sizes or ranges
        (a model that specialises the size of its first call, e.g. T=2, is traced at it)."""
        empty = ShapeInfo(symbols=(), sources={}, inputs=(), input_names=())
        fixed = {**dict.fromkeys(self._declared_names() if self._dims is not None else (), None), **sizes}
        try:  # (the names not in sizes follow, as _backend has them)
            return bool(make_bindings(empty, self._options.get("sizes"), self._options.get("ranges"), fixed))
        except ShapewiseError:
            return False

    def _trace(self, args: tuple, kwargs: dict, fixed: Mapping[str, int]) -> Any:
        count = len(self.runnables)
        self._local.tracing, self._local.fixed = True, fixed
        try:
            with _compat.no_zero_one_specialisation(), _compat.own_recompile_budget(), \
                    _compat.dynamic_int_sources(self._int_sources), _compat.quiet_guard_errors():
                if self._warm is not None:
                    try:
                        out = self._warm.trace(args, kwargs, self._backend)
                    except _compat.TraceNotSaved as e:  # warm starts off: the calls trace as without it
                        del self.runnables[:], self.trace_fixed[:]  # (Dynamo has none of the earlier traces)
                        count, self._directs = 0, DirectCalls(self._direct_call)
                        self._warm_off = f"warm start off: torch cannot save this model's trace ({e})"
                        log.warning("shapewise: %s; traced as without warm_start", self._warm_off)
                        self._warm = None
                if self._warm is None:
                    out = self._compiled(*args, **kwargs)
        finally:
            self._local.tracing, self._local.fixed = False, None
        if len(self.runnables) == count:
            raise ShapewiseError(
                "Dynamo ran the model without handing a graph to shapewise (its recompile limit for "
                "this function may be reached: torch._dynamo.config.cache_size_limit); nothing was compiled")
        if self._warm is not None:
            self._warm.save(self.trace_fixed)
        return out

    def _load_warm(self) -> None:
        """The saved traces (``warm_start``), once, under the lock (a concurrent first call waits for them)."""
        if not self._warm.tried:  # (every later call: no lock taken)
            with self._lock:
                for runnable, fixed in self._warm.load():
                    self.runnables.append(runnable)
                    self.trace_fixed.append(fixed)
                    self._watch = runnable.runtime.watch or self._watch

    @property
    def warm_info(self) -> str:
        """With ``warm_start=True``: whether this start loaded its traces, or why not, and where they were saved."""
        return self._warm.info if self._warm is not None else self._warm_off or "warm start off (warm_start=False)"

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's own signature: ``inspect.signature(fast)`` is ``inspect.signature(model.forward)``.
        Callers that decide from it what to pass (transformers' ``generate()``: ``position_ids``,
        ``attention_mask``, ``logits_to_keep``) pass what they pass the model itself."""
        return self._signature

    @property
    def runnable(self) -> Runnable:
        if not self.runnables:
            raise ShapewiseError("nothing compiled yet: call the compiled model once (that call traces and compiles)")
        return self.runnables[-1]

    @property
    def program(self) -> Program:
        return self.runnable.program

    @property
    def traces(self) -> int:
        """How many Dynamo traces reached the backend (1 unless a guard failed, e.g. a new dtype)."""
        return len(self.runnables)

    def wait(self, timeout: float | None = None) -> bool:
        """Every trace's variants ready (``Runnable.wait``: background compiles, and the variants left
        to compile workers loaded); False if ``timeout`` s passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        return all(r.wait(None if end is None else max(0.0, end - time.monotonic())) for r in list(self.runnables))

    def report(self) -> CompileReport:
        """One row per (piece, variant) of every trace; with several traces, a ``trace`` column
        says which one serves the row's sizes (``2 (seq=1)``: the second, which fixed seq to 1)."""
        if len(self.runnables) <= 1:
            return CompileReport(row for r in self.runnables for row in r.report())
        rows = []
        for i, r in enumerate(self.runnables):
            fixed = ", ".join(f"{k}={v}" for k, v in self.trace_fixed[i].items() if v is not None)
            for row in r.report():
                key = row.get("key", "")  # the fixed dims belong to the sizes this row serves
                if fixed and isinstance(key, str) and key.startswith("{"):
                    key = "{" + ", ".join(x for x in (key[1:-1], fixed) if x) + "}"
                rows.append({"trace": self._trace_label(i), **row, "key": key})
        return CompileReport(rows, columns=("trace", *CompileReport().columns))

    def _trace_label(self, i: int) -> str:
        fixed = ", ".join(f"{k}={v}" for k, v in self.trace_fixed[i].items() if v is not None)
        return f"{i + 1}" + (f" ({fixed})" if fixed else "")


def compile(model: Callable[..., Any], *, sizes: Any = (), ranges: Any = (), splitting_ops: Sequence[Any] = (),
            dynamic_dims: Mapping[str, Any] | None = None, backend: Any = "inductor", on_miss: str = "error",
            **options: Any) -> ShapewiseModule:
    """Compile ``model`` once per size, dispatching by shape at run time.

    >>> fast = shapewise.compile(model, sizes=[1, 2, 4, 8], ranges=[(9, 4096)], splitting_ops=["sdpa"])
    >>> fast = shapewise.compile(model, dynamic_dims={"x": {0: "batch", 1: "seq"}},
    ...                          sizes={"batch": [1, 2], "seq": [128, 256]})

    ``dynamic_dims`` maps argument names to a dim, a list of dims, or {dim: name}; by default
    dim 0 of every tensor argument. Options: ``options`` / ``static_options`` /
    ``range_options`` (Inductor config), ``on_compile_error``, ``instruments``;
    ``direct_call=True``: calls past Dynamo's frame after the first trace (``shapewise.direct``:
    its rules, and what it cannot see; ``fast.direct_info`` says whether it is on and why not).
    ``max_traces`` (default ``"auto"``: 8 + one per size and range; None: no bound): past it, a call
    that fits no trace runs uncompiled, not traced again (``shapewise.trace_limit``).
    """
    return ShapewiseModule(model, sizes=sizes, ranges=ranges, splitting_ops=splitting_ops, dynamic_dims=dynamic_dims,
                           backend=backend, on_miss=on_miss, **options)
