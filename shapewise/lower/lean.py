"""The host path of compiled pieces (issue 12): lean calls (an Inductor inference artifact
called as its runtime wrappers end up calling it, without them, where they have nothing to do)
and static pieces compiled without Inductor's per-input ``assert_size_stride`` calls, whose
inputs the runner checks instead where their layout is not already known."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from shapewise import _compat
from shapewise.ir.effects import aliased_outputs, mutated_inputs
from shapewise.ir.program import Piece, Variant

__all__ = ["drop_size_asserts", "expected_layouts", "lean_call", "lean_splitting_call"]

#: Operator namespaces whose fake (meta) kernels set the layout of their outputs as the real
#: kernels do (the compiler's own contract); any other op (a custom op's register_fake) keeps
#: Inductor's asserts, which catch a fake that disagrees with the real op.
_TRUSTED_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional", "shapewise"})


def lean_call(fn: Callable[..., Any], piece: Piece, variant: Variant) -> Callable[..., Any] | None:
    """``fn`` (an Inductor artifact) called as its runtime wrappers end up calling it, without
    them, where they have nothing to do; None where they do.

    AOTAutograd wraps each artifact in a chain (a dynamo-disable context, the runtime wrapper,
    the compiled graph's own ``__call__``) that on the toy Llama costs 7-35 µs per piece per call
    on a 2-core CPU (benchmarks/bench_host.py). The chain has work only for: training graphs
    (a backward), inputs the graph writes or that alias each other (mutations applied back,
    duplicate and synthetic-base arguments), outputs that alias an input or each other
    (regenerated as views), tensor-subclass outputs (built again), autocast (the compiled code
    runs with it off) and grad mode (an inference graph runs with grad off, so inputs that
    require grad give outputs that do not).
    A piece with none of the first four calls the compiled module's ``call(list)`` directly with
    the parameters AOTAutograd prepends, with grad off as the wrapper has it. Aliasing outputs
    that only feed later pieces (``piece.returned`` says which reach the caller) need no
    regeneration either: the compiled code returns them as aliases of the same memory
    (``reinterpret_tensor``), which is all a later piece reads; only a view the caller gets
    must be the one eager makes. The first call, and any call under autocast, goes through ``fn``.
    Tensor-subclass inputs (DTensor weights) are flattened as the wrappers flatten them, by the
    attribute reads that the first call shows give the same objects (``_flattening``). With that
    and direct calls, DTensor weights cost 0-2% over plain ones without CUDA graphs on the H200
    machine, against 30-80% through the wrappers and guards (benchmarks/bench_dtensor.py).
    """
    args = [a for a in variant.example_args if isinstance(a, torch.Tensor)]
    if any(a.requires_grad for a in args) and torch.is_grad_enabled():
        return None
    subclass = any(_compat.is_traceable_wrapper_subclass(a) for a in args)
    if subclass and _returns_subclass(piece):
        return None  # the wrappers build a subclass output again from the compiled code's tensors
    if len({_compat.storage_key(a) for a in args}) != len(args):
        return None
    if mutated_inputs(piece.gm):
        return None
    aliased = aliased_outputs(piece.gm)
    if aliased and (piece.returned is None or aliased & piece.returned):
        return None  # the caller gets a regenerated view (its ``_base``, its view metadata) as eager gives it
    hops = [n for n in piece.gm.graph.nodes if (_compat.op_key(n.target) or "").startswith("hop:")]
    if hops:  # higher-order ops (effects, autocast regions, wrappers): keep the runtime's handling
        return None
    entry = _compat.inference_entry(fn)
    if entry is None:
        return None
    graph, params = entry
    if params is None:  # an artifact loaded from the cache keeps no parameters of its own:
        if any(True for _ in piece.gm.parameters()) or any(True for _ in piece.gm.buffers()):
            return None  # a Dynamo piece's weights are its inputs; one that holds its own is left wrapped
        params = []
    autocast, grad_enabled, set_grad = _compat.autocast_enabled, torch.is_grad_enabled, _compat.set_grad_enabled
    inner: Callable[..., Any] | None = None
    flat: Callable[[tuple], list] | None = None  # args -> what the compiled code takes (subclass inputs)

    def call(*args: Any) -> Any:
        nonlocal inner, flat
        if inner is None:
            if subclass:  # None where some entry's origin is unclear: then every call goes through fn
                out, flat = _flattening(fn, graph, params, args)
                call.flattened = flat is not None  # type: ignore[attr-defined] - what the first call decided
            else:
                out = fn(*args)
            inner = graph.current_callable
            return out
        if autocast() or (subclass and flat is None):
            return fn(*args)
        flat_args = flat(args) if subclass else [*params, *args]
        if grad_enabled():
            set_grad(False)
            try:
                return inner(flat_args)
            finally:
                set_grad(True)
        return inner(flat_args)

    call.__wrapped__ = fn  # type: ignore[attr-defined] - the artifact, for its generated code
    return call


def _returns_subclass(piece: Piece) -> bool:
    out = next(n for n in piece.gm.graph.nodes if n.op == "output")
    found: list[bool] = []
    torch.fx.node.map_arg(out.args, lambda n: found.append(
        _compat.is_traceable_wrapper_subclass(_compat.node_value(n))))
    return any(found)


def _flattening(fn: Callable[..., Any], graph: Any, params: list[Any],
                args: tuple) -> tuple[Any, Callable[[tuple], list] | None]:
    """``fn(*args)``, and how to build, without the wrappers, the list they hand the compiled
    code, checked against what they handed it on this call: the parameters, then per argument
    either its inner attributes in ``__tensor_flatten__`` order (a subclass: a DTensor's
    ``_local_tensor``, its mesh) or itself, each the same object (or an equal constant). None
    where the list is laid out otherwise (sizes the wrappers append for a subclass of symbolic
    size, say): the wrappers then stay."""
    seen: list[list[Any]] = []
    compiled = graph.current_callable

    def record(flat_args: list) -> Any:
        seen.append(list(flat_args))  # the compiled code empties its list
        return compiled(flat_args)

    graph.current_callable = record
    try:
        out = fn(*args)
    finally:
        graph.current_callable = compiled
    expected: list[tuple[Any, Callable[[tuple], Any]]] = [(p, lambda _, p=p: p) for p in params]
    for j, a in enumerate(args):
        if _compat.is_traceable_wrapper_subclass(a):
            expected.extend((value, lambda args, j=j, get=operator.attrgetter(attr): get(args[j]))
                            for attr, value in _compat.subclass_inner(a))
        else:
            expected.append((a, operator.itemgetter(j)))
    if len(seen) != 1 or len(seen[0]) != len(expected) or not all(
            x is want or (not isinstance(want, torch.Tensor) and type(x) is type(want) and x == want)
            for x, (want, _) in zip(seen[0], expected)):
        return out, None
    getters = [get for _, get in expected]
    return out, lambda a: [g(a) for g in getters]


def drop_size_asserts(piece: Piece, variant: Variant, options: dict[str, Any]) -> bool:
    """Whether a static Inductor compile of ``piece`` may leave out ``size_asserts``.

    Inductor asserts every input's size and strides on every call (~0.75 µs each: 38 µs per call
    over the 51 inputs of the toy Llama's five pieces, on a 2-core CPU). In a split program most
    of them re-check what is already known: the program's inputs are checked by Dynamo's guards
    or the dispatch's, and a compiled piece's outputs have their fake values' layouts. Only
    a splitting op's (or an eagerly run fallback's) outputs may differ from their fake values,
    and the runner checks those (``expected_layouts``). Not for range variants (their asserts
    check symbolic strides), a user's explicit ``size_asserts``, or a piece that calls an op
    outside ATen (a custom op's fake kernel may disagree with the real one inside the piece,
    where only the asserts see it).
    """
    if not variant.binding.is_static or "size_asserts" in options:
        return False
    for n in piece.gm.graph.nodes:
        key = _compat.op_key(n.target) if n.op == "call_function" else None
        if key is None:
            continue
        if key.startswith("hop:") or key[3:].split(".", 1)[0] not in _TRUSTED_NAMESPACES:
            return False
    return True


def expected_layouts(variant: Variant) -> tuple[tuple[tuple[int, ...], tuple[int, ...]] | None, ...]:
    """Per argument of ``variant``: the (shape, stride) it was compiled for (None: not a tensor)."""
    return tuple((tuple(a.shape), tuple(a.stride())) if isinstance(a, torch.Tensor) else None
                 for a in variant.example_args)


def lean_splitting_call(piece: Piece) -> Callable[..., Any] | None:
    """A splitting piece that is one ``torch.library.custom_op`` call, called as the op's
    dispatch ends up calling it (its Python implementation), where the dispatch has nothing to
    do: no input requires grad (or grad is off), no tensor subclass, no torch function or
    dispatch mode, no profiler. The op's first call, and any call where one of those holds,
    goes through the dispatcher as before (with its checks of the returned value). Written
    arguments get their version bumped, as the dispatcher's ADInplaceOrView kernel does.

    The dispatch of such an op (autograd's Python wrapper, a redispatch, the backend wrapper and
    its aliasing check) costs more than a small attention kernel itself on the host: 40-55 µs
    per call on the H200 machine's CPU, where piecewise CUDA graphs call it once per layer
    (bench_host.py). None where the piece is anything else (it then runs its graph's forward).
    """
    nodes = list(piece.gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_function" and n.target is not operator.getitem]
    if len(calls) != 1 or any(n.op not in ("placeholder", "call_function", "output") for n in nodes):
        return None
    node = calls[0]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    devices = {v.device.type for n in placeholders if isinstance(v := _compat.node_value(n), torch.Tensor)}
    impl = _compat.custom_op_impl(node.target, devices.pop()) if len(devices) == 1 else None
    schema = _compat.op_schema(node.target)
    if impl is None or schema is None or not all(
            isinstance(a, torch.fx.Node) and a.op == "placeholder" or not isinstance(a, torch.fx.Node)
            for a in (*node.args, *node.kwargs.values())):
        return None
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if any(a.alias_info is not None and not a.alias_info.is_write for a in schema.arguments):
        return None  # a view op: its outputs' view metadata comes from the dispatcher
    consts: dict[str, Any] = {}

    def spell(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return a.name
        consts[f"_c{len(consts)}"] = a
        return f"_c{len(consts) - 1}"

    bound = {a.name: v for a, v in zip(schema.arguments, node.args)} | dict(node.kwargs)
    tensors = [n.name for n in placeholders if isinstance(_compat.node_value(n), torch.Tensor)]
    params = ", ".join(n.name for n in placeholders)
    fx_args = ", ".join([spell(a) for a in node.args] + [f"{k}={spell(v)}" for k, v in node.kwargs.items()])
    outs = _output_expr(nodes, node)
    plain = " and ".join(f"type({t}) is _Tensor" for t in tensors) or "True"
    bumps = "".join(f"\n        _bump({bound[w].name})" for w in written if isinstance(bound.get(w), torch.fx.Node)
                    and isinstance(_compat.node_value(bound[w]), torch.Tensor))
    if len(bumps.split("_bump")) - 1 != len([w for w in written if w in bound]):
        return None  # a written argument that is not one tensor (a list, a constant)
    src = (f"def call({params}):\n"
           f"    if _warm and {plain} and not (_grad() and _any_rg({', '.join(tensors)})) and not _tf_modes()"
           f" and not _modes() and not _profiling():\n"
           f"        r = _impl({fx_args}){bumps}\n"
           f"    else:\n"
           f"        r = _op({fx_args})\n"
           f"        _warmed()\n"
           f"    return {outs}\n")
    env: dict[str, Any] = {"_impl": impl, "_op": node.target, "_Tensor": torch.Tensor, "_grad": torch.is_grad_enabled,
                           "_any_rg": _compat.any_requires_grad, "_tf_modes": _compat.torch_function_mode_enabled,
                           "_modes": _compat.dispatch_modes, "_profiling": _compat.profiler_enabled,
                           "_bump": _compat.increment_version, "_warm": False, **consts}

    def warmed() -> None:
        env["_warm"] = True

    env["_warmed"] = warmed
    exec(compile(src, f"<shapewise-{piece.name}>", "exec"), env)  # noqa: S102 - generated from the graph
    call = env["call"]
    call.__source__ = src
    call.__wrapped__ = piece.gm.forward
    return call


def _output_expr(nodes: list[torch.fx.Node], call: torch.fx.Node) -> str:
    """The piece's output as an expression over ``r`` (the op's result)."""
    items = {n.name: f"r[{n.args[1]!r}]" for n in nodes if n.op == "call_function" and n.target is operator.getitem}
    out = nodes[-1].args[0]

    def spell(v: Any) -> str:
        if isinstance(v, torch.fx.Node):
            return "r" if v is call else items[v.name]
        if isinstance(v, (tuple, list)):
            return "(" + "".join(spell(x) + ", " for x in v) + ")"
        return repr(v)

    return spell(out)
