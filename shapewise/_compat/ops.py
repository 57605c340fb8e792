"""Operators: telling torch's op objects (``torch.ops.ns.op``, its overloads, higher-order
operators) apart and naming them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.passes.infra.pass_base import PassResult  # what a graph pass returns; torch marks it not BC

__all__ = ["LINEAR_FUNCTIONS", "PassResult", "any_requires_grad", "custom_op_impl", "dispatch_modes",
           "increment_version", "hop_by_name", "hop_name", "is_op_overload", "is_op_packet", "op_by_name", "op_key",
           "op_overloads", "op_qualname", "op_schema", "profiler_enabled", "torch_function_mode_enabled"]

#: What ``F.linear`` appears as in a Dynamo graph (its C binding), and the Python function itself.
LINEAR_FUNCTIONS = frozenset({torch._C._nn.linear, torch.nn.functional.linear})


def is_op_overload(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def is_op_packet(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverloadPacket)


def op_qualname(target: Any) -> tuple[str, str] | None:
    """(``ns::op``, overload) for an OpOverload ("default" for the unnamed one), (``ns::op``,
    "") for an OpOverloadPacket, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name, target._overloadname or "default"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name, ""
    return None


def op_by_name(qualname: str, overload: str) -> Any:
    """The op ``op_qualname`` names: the OpOverload (or, for overload "", the OpOverloadPacket). How a
    pickled graph gets its ops back: torch's op objects do not pickle themselves."""
    ns, name = qualname.split("::", 1)
    packet = getattr(getattr(torch.ops, ns), name)
    return getattr(packet, overload) if overload else packet


def hop_name(target: Any) -> str | None:
    """The name of a higher-order operator (``torch.ops.higher_order.<name>``), else None."""
    return target.name() if isinstance(target, torch._ops.HigherOrderOperator) else None


def hop_by_name(name: str) -> Any:
    """The higher-order operator ``hop_name`` names: how a pickled graph gets it back as torch's
    own object (pickled as it is, it would come back a copy, which no ``is`` test in Inductor knows)."""
    return getattr(torch.ops.higher_order, name)


def op_overloads(packet: Any) -> list[str]:
    """The overload names of an OpOverloadPacket."""
    return list(packet.overloads())


def op_key(target: Any) -> str | None:
    """A stable name of a torch operator for content keys (``op:aten.mm.default``,
    ``hop:wrap_with_autocast``), or None when ``target`` is not one."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{target}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop:{target.name()}"
    return None


def op_schema(target: Any):
    """The schema of an OpOverload (or of an OpOverloadPacket's default overload), else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    if isinstance(target, torch._ops.OpOverloadPacket):
        overload = getattr(target, "default", None)
        return overload._schema if overload is not None else None
    return None


def custom_op_impl(target: Any, device_type: str) -> Callable[..., Any] | None:
    """The Python function a ``torch.library.custom_op`` runs for tensors on ``device_type``
    once the dispatcher has passed autograd (what its backend kernel calls), or None: not such
    an op, or a kernel of it is disabled (``torch.library`` decides then, per call)."""
    from torch._library.custom_ops import OPDEFS

    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", None)
    if not isinstance(target, torch._ops.OpOverload):
        return None
    opdef = OPDEFS.get(target._schema.name)
    fns = getattr(opdef, "_backend_fns", None)
    if opdef is None or not isinstance(fns, dict) or getattr(opdef, "_disabled_kernel", True):
        return None
    if device_type in fns:
        return fns[device_type]
    return getattr(opdef, "_init_fn", None) if None in fns else None


#: Per-call facts a direct call of an op's implementation must check (C functions: the hot path).
any_requires_grad = torch._C._any_requires_grad
torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
dispatch_modes = torch._C._len_torch_dispatch_stack
profiler_enabled = torch._C._autograd._profiler_enabled
increment_version = torch.autograd.graph.increment_version
