"""``GroupedDecodeAttention``: at one query token, grouped-query attention without its copied keys.

    fast = sw.compile_generate(model, ..., graph_passes=[sw.library.GroupedDecodeAttention()])

A model with fewer key/value heads than query heads (grouped-query attention: Llama's 8 KV heads
for 32 query heads) repeats its keys and values to the query heads before SDPA, as transformers'
``repeat_kv`` does whenever it passes a mask (``k[:, :, None].expand(B, Hkv, n, S, D)
.reshape(B, Hkv * n, S, D)``). Compiled, that is a copy of the whole KV cache, n times over, at
every decode step: it grows with the context and is read again by the attention.

In: a compute piece's graph at a variant's sizes. Out: where SDPA's query has one token and its
sizes are fixed (``[B, H, 1, D]`` at these sizes; the keys' length ``S`` may be a range, as a dynamic
cache's is), its keys and values are such repeats of ``[B, Hkv, S, D]`` tensors,
its mask (if any) is the same for every head and query row (``[B, 1, 1, S]``), no dropout, not
causal: the query ``[B, Hkv * n, 1, D]`` is viewed as ``[B, Hkv, n, D]`` (the n query heads that
share a key/value head as n query rows of it), SDPA runs on the unrepeated keys and values, and
its ``[B, Hkv, n, D]`` output is viewed back as ``[B, Hkv * n, 1, D]``. The same numbers: each
query row attends on its own, over the same keys and mask row. At more query tokens the rows of
one head would need their own (causal) mask rows, so those variants are left as they are.
``PassResult.modified`` says whether any attention was rewritten.

``attention="kernel"`` (the default) runs the grouped attention in shapewise's own decode
kernel (``shapewise::decode_attention``, ``kernels/decode_attention.py``: a split-KV Triton
kernel on CUDA in bf16/fp16, SDPA itself anywhere else); ``attention="sdpa"`` calls SDPA on the
grouped rows. On the H200 at Llama-3.2-1B shapes SDPA's cuDNN kernel for the grouped shape is
slower than for the repeated one (9.0 against 6.35 µs a layer, benchmarks/results/decode_h200/
decode_options), so the rewrite pays only with a kernel written for it. ``pdl=True`` launches the
kernel with programmatic dependent launch where the GPU has it (``kernels/pdl.py``).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx
import torch.nn.functional as F

from shapewise._compat import node_value
from shapewise.errors import ConfigError
from shapewise.library.kernels import decode_attention as _registers_the_op  # noqa: F401 - shapewise::decode_attention
from shapewise.passes.base import register_pass
from shapewise.passes.graph_pass import GraphPass, PassResult, Sizes, VariantSizes

__all__ = ["GroupedDecodeAttention"]

log = logging.getLogger("shapewise")

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_NEW_AXIS = (slice(None), slice(None), None, slice(None), slice(None))


def _repeated(node: Any, sizes: VariantSizes) -> tuple[torch.fx.Node, int] | None:
    """(the ``[B, Hkv, S, D]`` tensor, n) when ``node`` is ``repeat_kv`` of it: an unsqueeze at dim
    2 (``t[:, :, None]`` or ``unsqueeze(2)``), an expand of that dim to n, a reshape to
    ``[B, Hkv * n, S, D]``; else None."""
    if not (isinstance(node, torch.fx.Node) and node.op in ("call_method", "call_function")
            and node.target in ("reshape", "view", torch.reshape)):
        return None
    expand = node.args[0]
    if not (isinstance(expand, torch.fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    axis = expand.args[0]
    if not isinstance(axis, torch.fx.Node) or len(axis.users) != 1 or len(expand.users) != 1:
        return None
    if axis.op == "call_function" and axis.target is operator.getitem and axis.args[1] == _NEW_AXIS:
        source = axis.args[0]
    elif axis.op == "call_method" and axis.target == "unsqueeze" and tuple(axis.args[1:]) in ((2,), (-3,)):
        source = axis.args[0]
    else:
        return None
    if not isinstance(source, torch.fx.Node):
        return None
    shapes = [sizes.shape(n) for n in (source, expand, node)]  # at these sizes (the traced ones are symbolic)
    if any(sh is None for sh in shapes) or len(shapes[0]) != 4 or len(shapes[1]) != 5:
        return None
    (b, h, s, d), grown, out = shapes
    n = grown[2]
    if None in (b, h, n, d):  # only the keys' length may be a range (a dynamic cache's)
        return None
    if tuple(grown) != (b, h, n, s, d) or tuple(out) != (b, h * n, s, d):
        return None
    return source, n


@register_pass
@dataclass(frozen=True)
class GroupedDecodeAttention(GraphPass):
    """SDPA of one query token over repeated keys/values -> attention of the grouped query rows over the unrepeated
    ones (shapewise's decode kernel, or SDPA: ``attention``)."""

    name: ClassVar[str] = "grouped_decode_attention"
    version: ClassVar[int] = 3  # 3: pdl
    attention: str = "kernel"  # "kernel": shapewise::decode_attention; "sdpa": SDPA on the grouped rows
    pdl: bool = False  # the kernel launched with programmatic dependent launch (kernels/pdl.py)

    def __post_init__(self) -> None:
        if self.attention not in ("kernel", "sdpa"):
            raise ConfigError(f"GroupedDecodeAttention(attention={self.attention!r}): say 'kernel' (shapewise's "
                              "decode kernel) or 'sdpa' (SDPA on the grouped query rows)")
        if not isinstance(self.pdl, bool):
            raise ConfigError(f"GroupedDecodeAttention(pdl={self.pdl!r}): say True (the decode kernel launched with "
                              "programmatic dependent launch where the GPU has it) or False")

    def rewrite(self, gm: torch.fx.GraphModule, sizes: Sizes) -> PassResult:
        if not isinstance(sizes, VariantSizes):
            sizes = VariantSizes(sizes)
        done = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in _SDPA:
                continue
            found = self._match(node, sizes)
            if found is None:
                continue
            *args, repeats = found
            self._rewrite(gm, node, *args)
            for rep in repeats:  # the repeats, now unread: reshape, expand, the new axis
                for n in (rep, rep.args[0], rep.args[0].args[0]):
                    if n.users:
                        break
                    gm.graph.erase_node(n)
            done += 1
        if done:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, bool(done))

    def _match(self, node: torch.fx.Node, sizes: VariantSizes) -> tuple | None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
        if set(bound) - set(names) or bound.get("dropout_p", 0.0) != 0.0 or bound.get("is_causal", False) is not False \
                or bound.get("enable_gqa", False) is not False:
            return None
        q = bound.get("query")
        k, v = _repeated(bound.get("key"), sizes), _repeated(bound.get("value"), sizes)
        if k is None or v is None or k[1] != v[1] or k[1] < 2 or not isinstance(q, torch.fx.Node):
            return None
        shape = sizes.shape(q)
        if not isinstance(node_value(q), torch.Tensor) or shape is None or len(shape) != 4 or None in shape:
            return None
        b, heads, tokens, dim = shape
        groups = sizes.shape(k[0])[1]
        if tokens != 1 or heads != groups * k[1]:
            return None
        mask = bound.get("attn_mask")
        if mask is not None:
            ms = sizes.shape(mask) if isinstance(mask, torch.fx.Node) else None
            if ms is None or len(ms) != 4 or ms[1] != 1 or ms[2] != 1:
                return None  # a mask per head or per query row: the grouped rows would need their own
        value_dim = sizes.shape(v[0])[3]  # the output's head dim is the values' (MLA's differs from the query's)
        return (q, k[0], v[0], mask, bound.get("scale"), (b, groups, k[1], dim), (b, heads, 1, value_dim),
                (bound["key"], bound["value"]))

    def _rewrite(self, gm: torch.fx.GraphModule, node: torch.fx.Node, q: torch.fx.Node, k: torch.fx.Node,
                 v: torch.fx.Node, mask: Any, scale: Any, grouped: tuple[int, ...], back: tuple[int, ...]) -> None:
        g = gm.graph
        with g.inserting_before(node):
            rows = g.call_method("reshape", (q, *grouped))
            if self.attention == "kernel":
                attended = g.call_function(torch.ops.shapewise.decode_attention.default,
                                           (rows, k, v, mask, scale, *((True,) if self.pdl else ())))
            else:
                kwargs: dict[str, Any] = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False}
                if scale is not None:
                    kwargs["scale"] = scale
                attended = g.call_function(node.target, (rows, k, v), kwargs)
            out = g.call_method("reshape", (attended, *back))
        for new in (rows, attended):
            new.meta.update({key: val for key, val in node.meta.items() if key not in ("example_value", "val")})
        attended.meta["shapewise_rewrite"] = self.name  # what made it (counted by sweep_architectures)
        qv = node_value(q)
        mode = getattr(qv, "fake_mode", None)
        if mode is not None:
            with mode:  # the traced values' own (symbolic) sizes: the same shapes at these sizes
                b, heads, tokens, dim = qv.shape
                rv = qv.reshape(b, grouped[1], grouped[2] * tokens, dim)
                # SDPA's output has the query's shape with the values' head dim (not computed: a mask
                # traced with a symbolic query length does not broadcast over n * that length)
                av = rv.new_empty((*rv.shape[:-1], node_value(v).shape[-1]))
            rows.meta["example_value"], attended.meta["example_value"] = rv, av
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        g.erase_node(node)
        log.debug("shapewise: GroupedDecodeAttention: %s reads %s heads' keys for %d query heads",
                  node.name, grouped[1], back[1])
