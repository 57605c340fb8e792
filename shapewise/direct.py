"""Direct calls (``sw.compile(..., direct_call=True)``): after the first trace, a call goes to
the compiled program straight from shapewise, past Dynamo's frame (its guards, and bytecode that
fetches every parameter again; what that costs is measured in ``benchmarks/results/host_h200/``).

In: one Dynamo trace (its GraphModule and example inputs; a loaded trace's are its first call's own
objects, ``shapewise.warm``), the ``Runnable`` compiled from it, and the model. Out: a ``DirectCall``
(``build_direct_call``), a function generated for that trace that reads the graph's inputs from a
call's arguments, checks what Dynamo's guards would, and calls the Runnable; or the reason the trace
gets none. ``DirectCalls`` keeps one per trace and tries them on each call; whatever they refuse goes
through Dynamo. The rules that keep answers right:

- The call it builds is generated once per trace: the graph's inputs are the call's tensors
  (each read as the trace read it: ``L['x']``, one of its sizes ``L['x'].size()[0]``, or a
  tensor inside an object argument, ``L['cache'].layers[0].keys``, fetched along the same
  attributes and items each call) and the model's parameters and buffers, held from the trace
  (a module attribute *replaced* by another tensor is not seen: the same rule as a captured
  CUDA graph's).
- Its own checks, per call, stand in for Dynamo's guards that can change between calls: the
  same number of arguments and keywords; each tensor argument of the same type, dtype, device,
  number of dims, ``requires_grad``, contiguous as traced or, for a view the trace saw (a
  sliding window's keys), its strides and offset as Dynamo guards them; the
  other arguments equal to the armed call's; grad mode, autocast and the module's ``training``
  flag as traced. Sizes as Dynamo guards them: every size the trace fixed equal to it (all of a
  tensor the graph does not read), and the dims that share a dynamic size equal to each other
  (a dim sized by an expression of dynamic sizes leaves direct calls off). Which dynamic sizes
  are served is the dispatch table's business: a size it has no variant for falls back too.
- Anything else falls back to the normal call through Dynamo (which re-traces where its guards
  say so): a check that fails, a size the table does not serve.
- Each trace has its own direct call (transformers' decoders trace decode, one token, apart
  from longer inputs); a call tries them most recently used first. A trace's table holds only
  sizes its guards allow, so whichever trace's direct call serves a call answers it as Dynamo's
  choice of trace would.
- It is armed by the first call that goes through Dynamo after the trace, which shows how the
  frame builds its result from the program's outputs (tensors matched by identity; None, bools,
  numbers, strings as constants). A result with anything else (a tensor the program did not
  return, such as an input returned as is; an object that pytree does not take apart) leaves
  direct calls off, with the reason in ``direct_info``.
- Objects on the way to a tensor inside an argument (a KV cache, its list of layers, a layer)
  are checked as Dynamo would guard them (``shapewise.direct_checks``): type, length, keys,
  every attribute they hold, aliasing.
- Python side effects, from Dynamo's own record of the trace (``_compat.trace_side_effects``):
  a tensor the forward sets on an object it was given (a dynamic KV cache's
  ``layer.keys = torch.cat(...)``) is set by the direct call too, from the program's outputs, and
  so is a constant set anywhere, and an int the trace computes from sizes (a sliding layer's
  ``cumulative_length + 1``, from the call's sizes; such ints inside arguments are read as
  sizes); the attributes set are checked as they were before the traced call. Any other change
  (an attribute set to a new object, a list appended to) leaves the trace's direct call off. A
  change that ends as it began (a dict whose items are put back, the frame's own ``**kwargs``)
  is none.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree

from shapewise import _compat
from shapewise import direct_checks as checks
from shapewise.dispatch.guards import python_expr
from shapewise.errors import DispatchMiss

__all__ = ["MISS", "DirectCall", "DirectCalls", "bound_module", "build_direct_call", "self_in_args"]

log = logging.getLogger("shapewise")

#: What a direct call returns when it does not apply (the caller goes through Dynamo).
MISS = object()

_CONSTANTS = (type(None), bool, int, float, str)


class DirectCall:
    """One trace's direct call: ``__call__(args, kwargs)`` -> the result, or ``MISS``.

    A *place* is where the call finds a graph input: ``(argument name, steps)``, the steps into
    the argument empty for the argument itself, else its attributes and items
    (``("cache", (("attr", "layers"), ("item", 0), ("attr", "keys")))``)."""

    def __init__(self, slots: list[tuple], runnable: Callable[..., Any], module: Any,
                 dims: dict[tuple, tuple[sympy.Expr, ...]] | None = None,
                 sizes: dict[tuple[tuple, int], sympy.Expr] | None = None,
                 stores: Sequence[tuple] = (), traced: dict[tuple, tuple] | None = None,
                 ints: dict[tuple, sympy.Expr] | None = None,
                 strides: dict[tuple, tuple[sympy.Expr, ...]] | None = None) -> None:
        # per graph input: ("param", tensor or mesh) | ("arg", place) | ("size" / "stride", place, dim)
        # | ("storage_offset", place, "")
        self.slots = slots
        self.dims = dims or {}  # per tensor place the graph reads: its traced sizes (ints or symbols)
        self.sizes = sizes or {}  # per (place, dim) the graph reads a size of: that size's symbol
        # What the forward sets: (the object's place, or None for one held by identity, attribute,
        # new value (_compat.STORED_TENSOR: one of the program's outputs), value before, the object).
        self.stores = list(stores)
        # Per tensor place inside an argument: what the trace saw of it (tensor_meta, contiguity).
        # The arming call's own tensor may have been replaced by then (a KV cache's keys).
        self.traced = traced or {}
        # Per int place inside an argument the graph takes as a size (a layer's token counter): its symbol.
        self.ints = ints or {}
        self.strides = strides or {}  # per tensor place the graph reads: its traced strides
        self.runnable = runnable
        self.module = module
        self.fn: Callable[[tuple, dict], Any] | None = None  # generated when armed

    def arm(self, args: tuple, kwargs: dict, positional: Sequence[str], result: Any,
            outputs: Sequence[Any]) -> str | None:
        """Build the call from an armed call (its arguments, its result through Dynamo, the
        program's outputs for it). None when armed, else why not."""
        named = dict(zip(positional, args))
        if len(args) > len(positional):
            return "positional arguments past the named ones (*args)"
        named.update(kwargs)
        places = [s[1] for s in self.slots if s[0] != "param"] + [st[0] for st in self.stores if st[0] is not None]
        for place in places:
            if place[0] not in named:
                return f"the graph reads argument {place[0]!r}, which this call did not pass (a default)"
        leaves, spec = pytree.tree_flatten(result)
        where = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                idx = next((i for i, o in enumerate(outputs) if o is leaf), None)
                if idx is None:
                    return "the result holds a tensor the compiled program did not return (an input returned as is?)"
                where.append(("out", idx))
            elif type(leaf) in _CONSTANTS:
                where.append(("const", leaf))
            elif any(leaf is named[p[0]] for p in places):
                where.append(("obj", next(p[0] for p in places if leaf is named[p[0]])))  # a KV cache returned
            else:
                return f"the result holds a {type(leaf).__name__}, which is not a tensor or a constant"
        env = {"MISS": MISS, "Tensor": torch.Tensor, "run": self.runnable, "module": self.module, "spec": spec,
               "unflatten": pytree.tree_unflatten, "_state": _global_state, "STATE": _global_state(self.module),
               "meta": checks.tensor_meta, "pattern": checks.pattern}
        head = [f"if len(args) != {len(args)} or len(kwargs) != {len(kwargs)}"
                + "".join(f" or {k!r} not in kwargs" for k in kwargs) + ": return MISS",
                "if _state(module) != STATE: return MISS"]
        names = {}
        for i, name in enumerate(positional[:len(args)]):
            names[name] = f"args[{i}]"
        for k in kwargs:
            names[k] = f"kwargs[{k!r}]"
        body: list[str] = []
        symbols: dict[sympy.Symbol, str] = {}  # a dynamic size: where the call's first reads it
        spelled: dict[tuple, str] = {}  # a place: the variable the call reads it into
        for n, (name, value) in enumerate(named.items()):
            var = spelled[(name, ())] = f"a{n}"
            body.append(f"{var} = {names[name]}")
            if isinstance(value, torch.Tensor):
                why = self._check_tensor(body, env, var, (name, ()), checks.seen(value), f"argument {name!r}", symbols)
                if why:
                    return why
            elif type(value) in _CONSTANTS:
                env[f"C{n}"], env[f"CT{n}"] = value, type(value)  # type(None) has no builtin name
                body.append(f"if type({var}) is not CT{n} or {var} != C{n}: return MISS")
            elif not any(p[0] == name for p in places):
                return f"argument {name!r} is a {type(value).__name__}: only tensors and constants are checked"
        # Inside arguments: read and checked in a try (what fails to read or compare is a miss).
        reads: list[str] = []
        batch: list[tuple] = []  # contiguous tensors inside arguments, checked by one C++ call
        objects: dict[tuple, Any] = {}  # a place that holds an object the call reads inside: the object
        for place in dict.fromkeys(places):
            name, steps = place
            value = named[name]
            if not isinstance(value, torch.Tensor):
                objects.setdefault((name, ()), value)
            for k, (kind, key) in enumerate(steps):
                inner = (name, steps[:k + 1])
                value = getattr(value, key) if kind == "attr" else value[key]
                if inner in spelled:
                    continue
                var = spelled[inner] = f"r{len(spelled)}"
                base = spelled[(name, steps[:k])]
                reads.append(f"{var} = {base}.{key}" if kind == "attr" else f"{var} = {base}[{key!r}]")
                if inner in self.ints and k + 1 == len(steps):
                    reads.append(f"if type({var}) is not int: return MISS")
                    symbol = self.ints[inner]
                    if symbol.is_Integer:  # the trace fixed it (a counter before the window fills)
                        reads.append(f"if {var} != {int(symbol)}: return MISS")
                    elif not isinstance(symbol, sympy.Symbol):
                        return (f"the graph takes {checks.spell_place(inner)} as the size {symbol}, "
                                "not a size of its own")
                    elif symbol in symbols:
                        reads.append(f"if {var} != {symbols[symbol]}: return MISS")
                    else:
                        symbols[symbol] = var
                elif not isinstance(value, torch.Tensor):
                    objects[inner] = value
                elif k + 1 < len(steps):
                    return f"the graph reads inside a tensor ({checks.spell_place(place)})"
                else:
                    why = self._check_tensor(reads, env, var, inner, self.traced.get(inner) or checks.seen(value),
                                             checks.spell_place(inner), symbols, batch, value)
                    if why:
                        return why
        stored = {(st[0], st[1]): st[3] for st in self.stores if st[0] is not None}
        # A tensor the forward replaces has already been replaced in the arming call.
        replaced = {(p[0], (*p[1], ("attr", a))) for p, a in stored}
        aliases = {id(checks.follow(named, p)): spelled[p] for p in spelled if p[1] and p not in replaced
                   and isinstance(checks.follow(named, p), torch.Tensor)}
        # The objects, and the tensors, as distinct as the arming call's (Dynamo guards aliasing).
        tensors = [p for p in spelled if p not in replaced and isinstance(checks.follow(named, p), torch.Tensor)]
        checks.check_objects(reads, env, objects, tensors, spelled, named, stored, aliases)
        held_vars: dict[int, str] = {}  # objects the module or a global holds, taken by identity (as a weight is)
        for k, (place, _attr, _new, _was, held) in enumerate(self.stores):
            if place is None and id(held) not in held_vars:
                held_vars[id(held)] = f"h{k}"
                env[f"H{k}"] = held
                reads.append(f"h{k} = H{k}")
                before = {a: w for p, a, _n, w, h in self.stores if p is None and h is held}
                checks.check_object(reads, env, f"h{k}", held, before, set(), {})
        if batch:
            env["TG"] = _compat.tensor_checks(*zip(*(b[1:] for b in batch)))
            reads.append(f"if not TG.check({', '.join(b[0] for b in batch)}): return MISS")
        reads = checks.merge_checks(reads, env)
        if reads:
            body += ["try:", *("    " + line for line in reads),
                     "except Exception:", "    return MISS"]
        for guard in checks.interior_guards(self.runnable):
            try:
                body.append(f"if not {checks.spell_bool(guard, symbols)}: return MISS")
            except (NotImplementedError, KeyError):
                return f"the trace guards its sizes with {guard}, which a direct call cannot check"
        call_args = []
        for k, slot in enumerate(self.slots):
            if slot[0] == "param":
                env[f"P{k}"] = slot[1]
                call_args.append(f"P{k}")
            elif slot[0] == "arg":
                call_args.append(spelled[slot[1]])
            else:
                call_args.append(f"{spelled[slot[1]]}.{slot[0]}({slot[2]})")
        body.append(f"out = run({', '.join(call_args)})")
        for k, (place, attr, new, _was, _held) in enumerate(self.stores):  # what Dynamo's frame does after the graph
            obj = spelled[place] if place is not None else held_vars[id(_held)]
            if new is _compat.STORED_TENSOR:
                got = getattr(checks.follow(named, place) if place is not None else _held, attr, None)
                idx = next((i for i, o in enumerate(outputs) if o is got), None)
                if idx is None:
                    return f"the forward sets {attr} to a tensor the compiled program did not return"
                body.append(f"{obj}.{attr} = out[{idx}]")
            elif isinstance(new, _compat.StoredSize):  # an int the forward computes from sizes (n + 1)
                try:
                    body.append(f"{obj}.{attr} = {python_expr(new.expr, symbols)}")
                except (NotImplementedError, KeyError):
                    return f"the forward sets {attr} to {new.expr}, which a direct call cannot compute"
            else:
                env[f"N{k}"] = new
                body.append(f"{obj}.{attr} = N{k}")
        if len(where) == 1 and where[0][0] == "out" and spec.is_leaf():
            body.append(f"return out[{where[0][1]}]")
        else:
            parts = []
            for kind, v in where:
                if kind == "out":
                    parts.append(f"out[{v}]")
                elif kind == "obj":
                    parts.append(spelled[(v, ())])
                else:
                    env[f"Q{len(parts)}"] = v
                    parts.append(f"Q{len(parts)}")
            fast = model_output_builder(spec, leaves)
            if fast is not None:
                env["build"] = fast
                body.append(f"return build([{', '.join(parts)}])")
            else:
                body.append(f"return unflatten([{', '.join(parts)}], spec)")
        src = "def direct(args, kwargs):\n" + "\n".join("    " + line for line in head + body) + "\n"
        exec(compile(src, "<shapewise direct call>", "exec"), env)  # noqa: S102 - generated from the trace
        self.fn = env["direct"]
        self.source = src
        return None

    def _check_tensor(self, body: list[str], env: dict, var: str, place: tuple, seen: tuple, label: str,
                      symbols: dict[sympy.Symbol, str], batch: list[tuple] | None = None,
                      example: torch.Tensor | None = None) -> str | None:
        """``direct_checks.check_tensor`` of the tensor at ``place``, with the sizes and strides the trace gave it."""
        shape = seen[0][3]
        traced = self.dims.get(place) or tuple(self.sizes.get((place, d), sympy.Integer(size))
                                               for d, size in enumerate(shape))
        strides = self.strides.get(place) if place in self.dims else None
        return checks.check_tensor(body, env, var, seen, label, symbols, traced, strides, batch, example)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        try:
            return self.fn(args, kwargs)
        except DispatchMiss:
            return MISS


class DirectCalls:
    """A compiled module's direct calls: one per trace that has one (``armed``, most recently used first;
    a new tuple on each change, so a concurrent call sees the old one or the new one), the traces' calls
    yet to be armed (``pending``), and per trace whether it is on or why not (``infos``)."""
    WAITING = "waiting for the trace's first call"  # a loaded trace's (shapewise.warm), built at that call

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.armed: tuple[DirectCall, ...] = ()
        self.pending: dict[int, DirectCall] = {}
        self.infos: list[str] = []
        self.calls = 0  # calls served past Dynamo's frame
        self.fallbacks = 0  # calls that went through Dynamo while some direct call was on
        self._lock = threading.Lock()
        self._local = threading.local()  # the program outputs of this thread's call, until armed

    def add_trace(self, index: int, built: DirectCall | str, runnable: Callable[..., Any]) -> Callable[..., Any]:
        """Trace ``index``'s direct call (or why there is none): what Dynamo should call for it,
        the runnable or a recorder of its outputs for the arming call."""
        self.infos.extend([self.WAITING] * (index - len(self.infos)))  # (a loaded trace called before an earlier one)
        self.infos[index:index + 1] = [f"off: {built}" if isinstance(built, str) else
                                       "waiting for a call through Dynamo to arm it"]
        if isinstance(built, str):
            return runnable
        self.pending[index] = built
        local, pending = self._local, self.pending

        def recorded(*args: Any) -> Any:
            out = runnable(*args)
            if index in pending:
                local.outputs = (index, out)
            return out

        return recorded

    def truncate(self, count: int) -> None:
        """Forget the traces from ``count`` on (Dynamo refused them after handing them over)."""
        del self.infos[count:]
        self.pending = {i: d for i, d in self.pending.items() if i < count}

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        armed = self.armed
        for i, direct in enumerate(armed):
            out = direct(args, kwargs)
            if out is not MISS:
                if i:  # most recently used first: a decode loop tries its own trace first
                    with self._lock:
                        self.armed = (direct, *(d for d in self.armed if d is not direct))
                self.calls += 1
                return out
        self.fallbacks += 1
        return MISS

    def forget(self) -> None:
        self._local.outputs = None

    def arm(self, args: tuple, kwargs: dict, positional: Sequence[str], result: Any,
            label: Callable[[int], str]) -> None:
        """Arm the direct call of the trace this call ran through Dynamo, if it waits for one."""
        seen, self._local.outputs = getattr(self._local, "outputs", None), None
        if seen is None:
            return  # the call ran a trace that is armed already
        index, outputs = seen
        with self._lock:
            pending = self.pending.pop(index, None)
            if pending is None:
                return
            why = pending.arm(args, kwargs, positional, result, outputs)
            if why is None:
                self.armed, self.infos[index] = (pending, *self.armed), "on"
            else:
                self.infos[index] = f"off: {why}"
                log.info("shapewise: direct calls of trace %s stay off: %s", label(index), why)

    def info(self, label: Callable[[int], str], traces: int = 0) -> str:
        infos = self.infos + [self.WAITING] * (traces - len(self.infos))  # (loaded traces not called yet)
        if not self.enabled:
            return "off (direct_call=False)"
        if not infos:
            return "not traced yet"
        if len(infos) == 1:
            return infos[0]
        return "; ".join(f"trace {label(i)}: {info}" for i, info in enumerate(infos))


def _global_state(module: Any) -> tuple:
    """What Dynamo guards globally and a call can change: grad mode, autocast (every device type's,
    with its dtype: ``_compat.autocast_state``), the module's training flag."""
    return torch.is_grad_enabled(), _compat.autocast_state(), getattr(module, "training", None)


def build_direct_call(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], runnable: Callable[..., Any],
                      module: Any, positional: Sequence[str], var_names: Sequence[str | None],
                      keywords: Any, side_effects: list[tuple] | str | None = None) -> DirectCall | str:
    """The trace's direct call (to be armed by a call), or why there is none. ``side_effects``:
    what the trace sets in Python state (``_compat.trace_side_effects``)."""
    if isinstance(side_effects, str):
        return side_effects
    slots: list[tuple] = []
    dims: dict[tuple, tuple[sympy.Expr, ...]] = {}
    sizes: dict[tuple[tuple, int], sympy.Expr] = {}
    traced: dict[tuple, tuple] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return "the graph's inputs and Dynamo's example inputs differ in number"

    def place_of(source: Any) -> tuple | None:
        path = _compat.access_path(source)
        name = path and _compat.local_name_of(path[0], positional, *var_names, keywords=keywords)
        return (name, path[1]) if name not in (None, "self") else None

    strides: dict[tuple, tuple[sympy.Expr, ...]] = {}
    for node, example in zip(placeholders, example_inputs):
        source = _compat.placeholder_source(node)
        size = _compat.size_source(source)
        stride = None if size is not None else (_compat.size_source(source, "stride")
                                                 or _compat.size_source(source, "storage_offset"))
        read = size[0] if size is not None else stride[0] if stride is not None else source
        place = place_of(read)
        if size is not None and place is not None:
            slots.append(("size", place, size[1]))
            sizes[(place, size[1])] = _compat.sym_expr(_compat.node_value(node))
        elif stride is not None and place is not None:  # a view's layout (a sliding window's keys)
            slots.append(("stride", place, stride[1]) if stride[1] is not None else ("storage_offset", place, ""))
        elif place is not None:
            slots.append(("arg", place))
            value = _compat.node_value(node)
            if isinstance(value, torch.Tensor):
                dims[place] = tuple(_compat.sym_expr(size) for size in value.shape)
                strides[place] = (*(_compat.sym_expr(st) for st in value.stride()),
                                  _compat.sym_expr(value.storage_offset()))
                if place[1] and isinstance(example, torch.Tensor):
                    traced[place] = checks.seen(example)
        elif (size is None and _compat.local_name_of(source, positional, *var_names, keywords=keywords) == "self"
              and (isinstance(example, torch.Tensor) or _compat.distributed_fields(example) is not None)):
            slots.append(("param", example))  # a weight, or a DeviceMesh a DTensor hook holds: by identity
        else:
            return (f"input {node.name} comes from {_compat.source_name(read)}: neither an argument, a tensor "
                    "inside one, their sizes, nor the module's tensor")
    ints = {place: _compat.sym_expr(_compat.node_value(node)) for node in placeholders
            if isinstance(_compat.node_value(node), torch.SymInt)
            and (place := place_of(_compat.placeholder_source(node))) is not None and place[1]}
    stores = []
    for source, attr, new, was, obj in side_effects or ():
        place = place_of(source)
        if place is None and new is _compat.STORED_TENSOR:
            return f"the forward sets {_compat.source_name(source)}.{attr} to a tensor, outside its arguments"
        stores.append((place, attr, new, checks.before_value(was), obj if place is None else None))
    return DirectCall(slots, runnable, module, dims, sizes, stores, traced, ints, strides)


def bound_module(model: Any) -> Any:
    """The module whose state a call depends on: the model, or the module of a bound forward."""
    return model.__self__ if inspect.ismethod(model) and isinstance(model.__self__, torch.nn.Module) else model


def model_output_builder(spec: Any, example: list[Any]) -> Callable[[list[Any]], Any] | None:
    """A rebuild of a result that is one dataclass dict of leaves (transformers' ``ModelOutput``) that
    sets its fields directly (~1 µs, against ~16 through its ``__init__`` on a 2-core CPU); None
    unless it rebuilds ``example`` as ``pytree.tree_unflatten`` does (type, items, attributes)."""
    cls = spec.type
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and issubclass(cls, OrderedDict)) or \
            spec.num_children != len(example) or not all(spec.child(i).is_leaf() for i in range(spec.num_children)):
        return None
    keys, names, set_item = list(spec.context), [f.name for f in dataclasses.fields(cls)], OrderedDict.__setitem__

    def build(values: list[Any]) -> Any:
        obj = cls.__new__(cls)
        attrs = obj.__dict__
        for name in names:
            attrs[name] = None
        for k, v in zip(keys, values):
            attrs[k] = v
            if v is not None:
                set_item(obj, k, v)
        return obj

    ref, got = pytree.tree_unflatten(example, spec), build(example)
    same = type(ref) is type(got) and [(k, id(v)) for k, v in ref.items()] == [(k, id(v)) for k, v in got.items()] \
        and {k: id(v) for k, v in vars(ref).items()} == {k: id(v) for k, v in vars(got).items()}
    return build if same else None


def self_in_args(model: Any) -> bool:
    """Whether the forward Dynamo traces is a wrapper ``(*args, **kwargs)`` (a decorator's) that
    receives the module as ``args[0]``."""
    if bound_module(model) is not model:
        fn = model.__func__  # a module's bound forward (compile_generate installs one)
    else:
        fn = getattr(type(model), "forward", None) if isinstance(model, torch.nn.Module) else None
    code = getattr(fn, "__code__", None)
    return (code is not None and getattr(fn, "__wrapped__", None) is not None and code.co_argcount == 0
            and bool(code.co_flags & inspect.CO_VARARGS))
