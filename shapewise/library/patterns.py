"""Patterns that the library's graph passes match in a piece's (Dynamo-level) FX graph.

In: one ``torch.fx.Node``. Out: its operands where it is the pattern (``match_linear``: a linear
layer in any of its spellings gives ``(x, weight, bias, transpose node)``), else None.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from shapewise._compat import LINEAR_FUNCTIONS, node_value

__all__ = ["match_linear"]

_MATMUL = {torch.matmul, operator.matmul, torch.mm}
_TRANSPOSE_FUNCS = {torch.t, torch.transpose, torch.Tensor.t}


def _transposed_weight(node: Any) -> torch.fx.Node | None:
    """``W`` when ``node`` is ``W.t()`` / ``W.T`` / ``W.transpose(0, 1)`` of a 2-D ``W``."""
    if not isinstance(node, torch.fx.Node):
        return None
    base = node.args[0] if node.args else None
    if node.op == "call_method" and node.target == "t":
        pass
    elif node.op == "call_function" and node.target in (torch.t, torch.Tensor.t):
        pass
    elif (node.op == "call_method" and node.target == "transpose") or (
            node.op == "call_function" and node.target is torch.transpose):
        dims = tuple(node.args[1:3])
        if sorted(d % 2 for d in dims) != [0, 1] or len(dims) != 2:
            return None
    elif node.op == "call_method" and node.target == "permute" and tuple(node.args[1:]) in ((1, 0), ((1, 0),)):
        pass
    elif node.op == "call_function" and node.target is getattr and len(node.args) == 2 and node.args[1] in ("T", "mT"):
        pass
    else:
        return None
    value = node_value(base) if isinstance(base, torch.fx.Node) else None
    return base if isinstance(value, torch.Tensor) and value.dim() == 2 else None


def match_linear(node: torch.fx.Node) -> tuple[Any, Any, Any, torch.fx.Node | None] | None:
    """(x, weight, bias, transpose node or None) when ``node`` is a linear layer: ``F.linear(x, W, b)``,
    ``x @ W.t()`` (or ``.T``, ``.transpose(0, 1)``, ``.permute(1, 0)``), ``torch.mm(x, W.t())``,
    ``torch.addmm(b, x, W.t())`` with a 2-D ``W`` of shape [N, K]."""
    if node.op != "call_function":
        return None
    if node.target in LINEAR_FUNCTIONS:
        names = ("input", "weight", "bias")
        args = list(node.args) + [node.kwargs[n] for n in names[len(node.args):] if n in node.kwargs]
        if len(args) < 2:
            return None
        return args[0], args[1], args[2] if len(args) > 2 else None, None
    if node.target in _MATMUL and len(node.args) == 2 and not node.kwargs:
        weight = _transposed_weight(node.args[1])
        return (node.args[0], weight, None, node.args[1]) if weight is not None else None
    if node.target is torch.addmm and len(node.args) == 3 and not node.kwargs:
        weight = _transposed_weight(node.args[2])
        bias = node_value(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
        wv = node_value(weight) if weight is not None else None
        if (weight is not None and isinstance(bias, torch.Tensor) and isinstance(wv, torch.Tensor)
                and tuple(bias.shape) == (wv.shape[0],)):  # a broadcast bias ([1], a scalar) stays addmm
            return node.args[1], weight, node.args[0], node.args[2]
    return None
