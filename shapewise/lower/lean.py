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
    (regenerated as views), and autocast (the compiled code runs with it off). A piece with
    none of these calls the compiled module's ``call(list)`` directly with the parameters
    AOTAutograd prepends. The first call, and any call under autocast, goes through ``fn``.
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
    autocast = _compat.autocast_enabled
    inner: Callable[..., Any] | None = None

    def call(*args: Any) -> Any:
        nonlocal inner
        if inner is None or autocast():
            out = fn(*args)
            inner = graph.current_callable
            return out
        return inner([*params, *args])

    call.__wrapped__ = fn  # type: ignore[attr-defined] - the artifact, for its generated code
    return call
