"""Which ops split the graph: names (``"ns::op"``, ``"ns::op.overload"``), aliases, op objects,
Python callables, or predicates over FX nodes."""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from shapewise._compat import is_op_overload, is_op_packet, op_overloads, op_qualname
from shapewise.errors import ConfigError

__all__ = ["OpMatcher", "register_alias", "registered_aliases", "resolve_ops"]


@dataclass(frozen=True)
class OpMatcher:
    """Matches FX nodes that call one splitting op. ``label`` is how it prints."""

    label: str
    test: Callable[[torch.fx.Node], bool]

    def __call__(self, node: torch.fx.Node) -> bool:
        return node.op in ("call_function", "call_method") and self.test(node)

    def __str__(self) -> str:
        return self.label


def _match_name(qualified: str, overload: str | None) -> Callable[[torch.fx.Node], bool]:
    def test(node: torch.fx.Node) -> bool:
        q = op_qualname(node.target)
        if q is None or q[0] != qualified:
            return False
        if overload is None:
            return True
        # A call through the packet (Dynamo level) runs the default overload.
        return q[1] == overload or (q[1] == "" and overload == "default")

    return test


_SDPA_ATEN = (
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
)


def _is_sdpa(node: torch.fx.Node) -> bool:
    if node.target is torch.nn.functional.scaled_dot_product_attention:
        return True
    q = op_qualname(node.target)
    return q is not None and q[0] in _SDPA_ATEN


_ALIASES: dict[str, OpMatcher] = {"sdpa": OpMatcher("sdpa", _is_sdpa)}


def register_alias(name: str, test: Callable[[torch.fx.Node], bool]) -> None:
    """Register a named splitting-op matcher (e.g. several attention backends under one name)."""
    _ALIASES[name] = OpMatcher(name, test)


def registered_aliases() -> list[str]:
    return sorted(_ALIASES)


def _known_op_names(namespace: str) -> list[str]:
    try:
        ns = getattr(torch.ops, namespace)
    except (AttributeError, RuntimeError):
        return []
    names = [n for n in dir(ns) if not n.startswith("_") and n not in ("name", "is_custom_op")]
    return [f"{namespace}::{n}" for n in names]


def _resolve_one(op: Any) -> OpMatcher:
    if isinstance(op, OpMatcher):
        return op
    if isinstance(op, str):
        if op in _ALIASES:
            return _ALIASES[op]
        if "::" not in op:
            close = difflib.get_close_matches(op, registered_aliases(), n=3)
            raise ConfigError(
                f"unknown splitting op {op!r}: give 'namespace::op' or 'namespace::op.overload', "
                f"or one of the aliases {registered_aliases()}"
                + (f" (did you mean {close}?)" if close else "")
            )
        namespace, _, rest = op.partition("::")
        opname, _, overload = rest.partition(".")
        packet = None
        try:
            packet = getattr(getattr(torch.ops, namespace), opname)
        except (AttributeError, RuntimeError):
            pass
        if packet is None:
            candidates = _known_op_names(namespace) + registered_aliases()
            close = difflib.get_close_matches(op, candidates, n=3)
            raise ConfigError(
                f"unknown splitting op {op!r}: no operator {namespace}::{opname} is registered"
                + (f"; closest registered names: {close}" if close else "")
                + " (register it with torch.library before compiling)"
            )
        if overload and overload not in op_overloads(packet):
            raise ConfigError(
                f"unknown splitting op {op!r}: {namespace}::{opname} has overloads "
                f"{op_overloads(packet)}, not {overload!r}"
            )
        return OpMatcher(op, _match_name(f"{namespace}::{opname}", overload or None))
    if is_op_overload(op):
        name, overload = op_qualname(op)
        return OpMatcher(f"{name}.{overload}", _match_name(name, overload))
    if is_op_packet(op):
        name, _ = op_qualname(op)
        return OpMatcher(name, _match_name(name, None))
    if callable(op):
        label = getattr(op, "__qualname__", None) or repr(op)
        return OpMatcher(label, lambda node, fn=op: node.target is fn)
    raise ConfigError(
        f"cannot use {op!r} as a splitting op: give a name 'ns::op', an OpOverload(Packet), "
        f"a Python callable, or an OpMatcher"
    )


def resolve_ops(ops: Iterable[Any]) -> tuple[OpMatcher, ...]:
    """Turn user op specs into matchers, failing early with the closest names for typos."""
    return tuple(_resolve_one(op) for op in ops)


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


_ALLOC_TARGETS = {
    torch.empty, torch.empty_like, torch.empty_strided, torch.zeros, torch.zeros_like,
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
}


def is_allocation(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("new_empty", "new_zeros")
    return node.op == "call_function" and node.target in _ALLOC_TARGETS
