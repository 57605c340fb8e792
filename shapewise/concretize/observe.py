"""The layouts a variant's inputs really have: the split program run on fake tensors at a
binding's sizes (``observed_inputs``) or bounded by its range (``observed_range_inputs``),
not the size-oblivious trace's."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from shapewise import _compat
from shapewise._compat import FakeTensorMode, storage_length
from shapewise.concretize.examples import _materialise, _range_env, fake_at
from shapewise.errors import GuardViolation
from shapewise.graph_split.registry import is_getitem
from shapewise.ir.program import Binding, Piece, Program, TensorMeta
from shapewise.ir.runner import make_runner
from shapewise.ir.symbolic import evaluate

__all__ = ['observed_inputs', 'observed_range_inputs']

log = logging.getLogger("shapewise")

def observed_range_inputs(program: Program, binding: Binding) -> dict[str, tuple[Any, ...]]:
    """Each piece's input layouts, as (strides, offset) over the trace's symbols, as the split
    program makes them on fake tensors bounded by the ``binding``'s ranges.

    A range variant is compiled knowing its bounds, and so decides what the trace left
    undecided: over (3, 7), ``x.t().contiguous().t()[::3] * 2`` is column-major (``3 <= n``
    holds), where the trace (n >= 2) kept row-major; the next piece must be compiled for the
    layout the range variant before it makes. Failures keep the traced layouts."""
    shapes = program.shapes
    if shapes is None or program.graph is None or any(s not in dict(binding.items) for s in shapes.symbols):
        return {}
    try:
        mode, new, exprs, values = _range_env(binding, shapes.hints, (), shapes.guards)
        args = _materialise(Piece("program", program.graph, shapes=shapes), mode, exprs, values, symbolic=True)
        with _compat.no_zero_one_specialisation():
            recorded = _run_split(program, args, mode)
        bad = _compat.range_guard_violations(mode)
        if bad:  # the run specialised a ranged size (an op's fake kernel read it as an int)
            raise GuardViolation("; ".join(bad))
    except Exception as e:  # noqa: BLE001 - the traced layouts are the fallback
        log.debug("shapewise: layouts over %s not observed (%s: %s)", binding, type(e).__name__, e)
        return {}
    back = {v: k for k, v in new.items()}

    def over_trace(e: Any) -> sympy.Expr:
        return sympy.sympify(_compat.sym_expr(e)).xreplace(back)

    return {name: tuple((tuple(over_trace(d) for d in t.stride()), over_trace(t.storage_offset()))
                        if isinstance(t, torch.Tensor) else None for t in a)
            for name, a in recorded.items()}


def _run_split(program: Program, args: Sequence[Any], mode: FakeTensorMode,
               run_piece: Callable[[Piece, tuple[Any, ...]], Any] | None = None,
               seen: dict[str, tuple[Any, ...]] | None = None) -> dict[str, tuple[Any, ...]]:
    """Run the split program on fake ``args`` under ``mode`` in the current grad mode (an op
    may lay its output out otherwise when an input needs grad: CPU SDPA with a learned mask,
    T5's position bias, in training), each piece as its own graph (or through
    ``run_piece(piece, args)``); returns each piece's inputs, in ``seen`` if given (so a
    caller keeps what was recorded before a failure)."""
    seen = {} if seen is None else seen
    unread = _unread_pieces(program.graph)

    def recorder(piece: Piece) -> Callable[..., Any]:
        def call(*a: Any) -> Any:
            seen[piece.name] = a
            if piece.name in unread:  # only its inputs are wanted: not run
                return _UNREAD
            return run_piece(piece, a) if run_piece is not None else piece.gm.forward(*a)
        return call

    run = make_runner(program.graph, {p.name: recorder(p) for p in program.pieces})
    with mode:
        run(*args)
    return seen


class _Unread:
    """What a piece whose outputs nobody reads returns in an observation (any item of it is itself)."""

    def __getitem__(self, index: Any) -> _Unread:
        return self


_UNREAD = _Unread()


def _unread_pieces(stitch: torch.fx.GraphModule) -> set[str]:
    """The pieces whose outputs reach only the program's output (directly or through getitem): an
    observation records each piece's inputs, so these need not run (a full graph is one such piece,
    and the last piece of a split program usually is)."""
    out = set()
    for node in stitch.graph.nodes:
        if node.op != "call_module":
            continue
        users, read = list(node.users), False
        while users and not read:
            user = users.pop()
            if is_getitem(user):
                users.extend(user.users)
            else:
                read = user.op != "output"
        if not read:
            out.add(str(node.target))
    return out


def _layout_of(value: Any) -> Any:
    """A hashable description of a value's layout (a tensor's) or of the value itself."""
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype,
                value.device, value.requires_grad)
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("v", value)
    raise TypeError(type(value).__name__)


def _from_layout(desc: Any) -> Any:
    if desc[0] == "v":
        return desc[1]
    _, shape, stride, offset, dtype, device, requires_grad = desc
    if offset == 0:
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    else:
        t = torch.empty(max(storage_length(shape, stride, offset), 1), dtype=dtype, device=device).as_strided(
            shape, stride, offset)
    return t.requires_grad_(True) if requires_grad else t


def observed_inputs(program: Program, binding: Binding, memo: dict[Any, Any] | None = None,
                    digests: Mapping[str, str | None] | None = None,
                    shared: tuple[FakeTensorMode, dict[Any, Any]] | None = None) -> dict[str, tuple[Any, ...]]:
    """Each piece's inputs as eager makes them at the static ``binding``: the split program run
    on fake tensors of that size, every piece as its own graph.

    The trace's layouts are symbolic and size-oblivious; at one size eager can lay a tensor out
    otherwise, and a piece compiled for the traced layout would read it wrong: at n=1
    ``x[:, None].expand(-1, 2, -1).reshape(-1, k)`` is a stride-0 view, not the copy the trace
    shows; at n=8 ``x.t().contiguous().t()[::3] * 2`` is column-major (the order depends on
    n vs 3, which the trace leaves undecided, with no guard). A piece whose propagation fails
    keeps the traced layouts (logged at debug level).

    ``memo`` (shared across bindings) with ``digests`` (each piece's content key): a piece whose
    content and input layouts were seen already is not run again; its outputs are rebuilt from
    the layouts it gave then (the layers of a model are one piece, many times). ``shared``: a
    fake mode and a cache of program inputs by layout, for several bindings (the parameters)."""
    shapes = program.shapes
    if shapes is None or program.graph is None:
        return {}
    values = binding.static_values()
    if any(s not in values for s in shapes.symbols):
        return {}
    mode, made = shared if shared is not None else (FakeTensorMode(allow_non_fake_inputs=True), {})
    seen: dict[str, tuple[Any, ...]] = {}

    def run_piece(piece: Piece, args: tuple[Any, ...]) -> Any:
        digest = (digests or {}).get(piece.name)
        if memo is None or digest is None:
            return piece.gm.forward(*args)
        try:
            key = (digest, tuple(_layout_of(a) for a in args))
        except TypeError:
            return piece.gm.forward(*args)
        if key in memo:
            outs = memo[key]
            return tuple(_from_layout(d) for d in outs) if isinstance(outs, tuple) else _from_layout(outs)
        out = piece.gm.forward(*args)
        try:
            memo[key] = tuple(_layout_of(o) for o in out) if isinstance(out, (tuple, list)) else _layout_of(out)
        except TypeError:
            pass
        return out

    try:
        args = []
        with mode:
            for meta in shapes.inputs:
                if isinstance(meta, TensorMeta) and meta.subclass is not None:
                    args.append(fake_at(meta, mode, values))  # a DTensor weight: its local shard inside
                elif isinstance(meta, TensorMeta):
                    desc = ("t", *meta.at(values), meta.dtype, meta.device, meta.requires_grad)
                    if desc not in made:
                        made[desc] = _from_layout(desc)
                    args.append(made[desc])
                else:
                    args.append(evaluate(meta, values) if isinstance(meta, sympy.Basic) else meta)
        _run_split(program, args, mode, run_piece, seen)
    except Exception as e:  # noqa: BLE001 - the traced layouts are the fallback
        log.debug("shapewise: eager layouts at %s not observed (%s: %s); pieces after %s keep the traced ones",
                  binding, type(e).__name__, e, list(seen)[-1:] or "the start")
    return seen
