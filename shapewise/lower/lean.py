"""Lean calls: an Inductor inference artifact called as its runtime wrappers end up calling
it, without them, where they have nothing to do (issue 12's host path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shapewise import _compat
from shapewise.ir.effects import mutated_inputs, outputs_alias
from shapewise.ir.program import Piece, Variant

__all__ = ["lean_call"]


def lean_call(fn: Callable[..., Any], piece: Piece, variant: Variant) -> Callable[..., Any] | None:
    """``fn`` (an Inductor artifact) called as its runtime wrappers end up calling it, without
    them, where they have nothing to do; None where they do.

    AOTAutograd wraps each artifact in a chain (a dynamo-disable context, the runtime wrapper,
    the compiled graph's own ``__call__``) that on the toy Llama costs 7-35 µs per piece per call
    on a 2-core CPU (benchmarks/bench_host.py). The chain has work only for: training graphs
    (a backward), inputs the graph writes or that alias each other (mutations applied back,
    duplicate and synthetic-base arguments), outputs that alias an input or each other
    (regenerated as views), autocast (the compiled code runs with it off) and grad mode (an
    inference graph runs with grad off, so inputs that require grad give outputs that do not).
    A piece with none of the first four calls the compiled module's ``call(list)`` directly with
    the parameters AOTAutograd prepends, with grad off as the wrapper has it. The first call,
    and any call under autocast, goes through ``fn``.
    """
    args = [a for a in variant.example_args if isinstance(a, torch.Tensor)]
    if any(a.requires_grad for a in args) and torch.is_grad_enabled():
        return None
    if len({_compat.storage_key(a) for a in args}) != len(args):
        return None
    if mutated_inputs(piece.gm) or outputs_alias(piece.gm):
        return None
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

    def call(*args: Any) -> Any:
        nonlocal inner
        if inner is None or autocast():
            out = fn(*args)
            inner = graph.current_callable
            return out
        if grad_enabled():
            set_grad(False)
            try:
                return inner([*params, *args])
            finally:
                set_grad(True)
        return inner([*params, *args])

    call.__wrapped__ = fn  # type: ignore[attr-defined] - the artifact, for its generated code
    return call
