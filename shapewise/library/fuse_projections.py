"""``FuseProjections``: linear layers that read one activation become one matmul over their
weights packed in one buffer, then a split.

    sw.library.pack_projections(model)          # once: sibling projections share one buffer
    fast = sw.compile(model, sizes=[1, 8, 64], graph_passes=[sw.library.FuseProjections()])

**Packing** (``pack_projections(model)``, once per model, before compiling): in every module,
the ``nn.Linear`` children that could be one matmul (same ``in_features``, dtype, device, bias or
not, ``requires_grad``; each weight contiguous, held by that module alone and not sharing its
storage with a tensor outside the group) are copied into one
``[sum of out_features, in_features]`` buffer (and their biases into one vector), and each
parameter's ``.data`` becomes its rows of it. The parameters stay the same ``Parameter`` objects
(optimizers, hooks and ties keep working); weight memory does not grow (the old storage is freed).
Llama's attention packs q, k, v and o (o has the same ``in_features``); its MLP, gate and up.

**The pass.** In: a compute piece's graph. Out: each group of at least two linear layers
(``patterns.match_linear``) that read the same activation, in an inference graph (no output that
requires grad), with no in-place call between the first and the last of them (the fused matmul
runs where the first one ran), whose weights the trace saw packed and consecutive (one storage,
each starting where the previous one ends, in some order: q, k, v is a run of the q, k, v, o
buffer) becomes

    y = shapewise::linear_group(x, [w_q, w_k, w_v], [b_q, b_k, b_v])   # [..., N_q + N_k + N_v]
    q, k, v = y.split([N_q, N_k, N_v], -1), each .contiguous()          # free at one row

``PassResult.modified`` says whether any group was fused; groups left alone are logged (debug)
with the reason. ``max_tokens`` gates the pass by rows at static sizes (None: every size,
ranges included).

**The op** reads the weights in place: where they are one run of one storage (as packed), it is
one ``F.linear`` over a ``[N, K]`` view of that run, no copy. Where they are not, which happens
when a user assigns a new ``Parameter`` to a packed layer (``layer.weight = nn.Parameter(w)``), it
concatenates them first: the same answer, one weight copy per call, and a warning (once per shape)
saying to call ``pack_projections(model)`` again. Weights loaded in place (``load_state_dict``,
``weight.data.copy_``, ``torch.no_grad(): weight.copy_``) write into the buffer and stay packed. In
CUDA graphs the check runs at capture, and a weight that moved makes the graph fall back or capture
again (its address check), where the op checks again.
"""

from __future__ import annotations

import logging
import math
import operator
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx
import torch.nn.functional as F

from shapewise._compat import node_value
from shapewise.errors import ConfigError
from shapewise.library.patterns import match_linear
from shapewise.passes.base import register_pass
from shapewise.passes.graph_pass import GraphPass, PassResult, Sizes, VariantSizes

__all__ = ["FuseProjections", "Packed", "linear_group", "pack_projections", "packed_run"]

log = logging.getLogger("shapewise")

_warned: set[tuple] = set()


def packed_run(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` (all 2-D ``[N_i, K]`` or all 1-D) as one ``[sum N_i, K]`` (or ``[sum N_i]``)
    view when they are one consecutive run of one storage, in this order; else None."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device
               and t.shape[1:] == first.shape[1:] for t in tensors):
        return None
    storage = first.untyped_storage().data_ptr()
    size = first.element_size()
    for a, b in zip(tensors, tensors[1:]):
        if b.untyped_storage().data_ptr() != storage or b.data_ptr() != a.data_ptr() + a.numel() * size:
            return None
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows, *first.shape[1:])
    return first.as_strided(shape, first.stride() if first.dim() == 1 else (first.shape[1], 1))


def _joined(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    run = packed_run(tensors)
    if run is not None:
        return run
    key = (what, tuple(tuple(t.shape) for t in tensors), tensors[0].dtype)
    # A model's parameters (tensors that are not, such as Verify's random inputs, are copied quietly)
    if key not in _warned and any(isinstance(t, torch.nn.Parameter) for t in tensors):
        _warned.add(key)
        log.warning("shapewise: FuseProjections: the %s %s are not one packed buffer (a layer was given a new "
                    "Parameter?); each call copies them into one. Call sw.library.pack_projections(model) again "
                    "to read them in place", what, [list(t.shape) for t in tensors])
    return torch.cat(tensors)


@torch.library.custom_op("shapewise::linear_group", mutates_args=())
def linear_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat([F.linear(x, w, b) for ...], -1)`` as one ``F.linear`` over the packed weights
    (module docstring); ``biases`` empty for layers without bias."""
    w = _joined(weights, "weights")
    b = _joined(biases, "biases") if biases else None
    return F.linear(x, w, b)


@linear_group.register_fake
def _(x, weights, biases):
    torch._check(len(weights) >= 1, lambda: "shapewise::linear_group: no weights")
    torch._check(not biases or len(biases) == len(weights),
                 lambda: f"shapewise::linear_group: {len(biases)} biases for {len(weights)} weights")
    for w in weights:
        torch._check(w.dim() == 2 and w.shape[1] == x.shape[-1],
                     lambda: f"shapewise::linear_group: weight {tuple(w.shape)} does not take x {tuple(x.shape)}")
    n = sum(w.shape[0] for w in weights)
    return x.new_empty((*x.shape[:-1], n))


def _setup_context(ctx, inputs, output):
    x, weights, biases = inputs
    ctx.save_for_backward(x, *weights)
    ctx.rows = [w.shape[0] for w in weights]
    ctx.biased = bool(biases)


def _backward(ctx, grad):
    # The pass fuses inference graphs only; this keeps a graph that AOT autograd traces with
    # parameters requiring grad (a Pipeline run outside no_grad) lowering, and right. AOT traces
    # it on fake tensors, which have no addresses to check: the weights are concatenated.
    x, *weights = ctx.saved_tensors
    grad_x = grad @ torch.cat(weights)
    flat_g, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_w = list((flat_g.t() @ flat_x).split(ctx.rows))
    grad_b = list(flat_g.sum(0).split(ctx.rows)) if ctx.biased else []
    return grad_x, grad_w, grad_b


linear_group.register_autograd(_backward, setup_context=_setup_context)


# --- packing ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Packed:
    """One buffer ``pack_projections`` made: the module, its layers in buffer order, the rows."""

    module: str
    layers: tuple[str, ...]
    rows: tuple[int, ...]
    in_features: int

    def __str__(self) -> str:
        where = f"{self.module}." if self.module else ""
        return f"{where}{{{', '.join(self.layers)}}} -> [{sum(self.rows)}, {self.in_features}]"


def _plain(t: Any) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta"


def pack_projections(model: torch.nn.Module) -> list[Packed]:
    """Pack sibling linear layers' weights (and biases) into one buffer each, in place (module
    docstring). Groups already packed are left as they are, so calling it again is cheap and
    re-packs only what a new ``Parameter`` unpacked. Returns the groups it packed."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"pack_projections(model): give the torch.nn.Module to pack, not {type(model).__name__}")
    holders: dict[int, int] = defaultdict(int)  # parameter id -> how many places hold it (ties)
    in_storage: dict[int, set[int]] = defaultdict(set)  # storage address -> the tensors in it
    for _, p in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        holders[id(p)] += 1
        if _plain(p) and p.numel():
            in_storage[p.untyped_storage().data_ptr()].add(id(p))

    def alone(members: list[torch.nn.Linear], attr: str) -> bool:
        # a storage shared only within the group: packed before, not tied to a tensor elsewhere
        ours = {id(getattr(m, attr)) for m in members}
        return all(in_storage[getattr(m, attr).untyped_storage().data_ptr()] <= ours for m in members)

    done = []
    for name, module in model.named_modules():
        groups: dict[tuple, list[tuple[str, torch.nn.Linear]]] = defaultdict(list)
        for child_name, child in module.named_children():
            if type(child) is not torch.nn.Linear:  # subclasses may read their weight differently
                continue
            w, b = child.weight, child.bias
            if not (_plain(w) and w.dim() == 2 and w.numel() and w.is_contiguous() and holders[id(w)] == 1):
                continue
            if b is not None and not (_plain(b) and b.numel() and b.is_contiguous() and holders[id(b)] == 1):
                continue
            groups[(w.shape[1], w.dtype, w.device, b is None, w.requires_grad)].append((child_name, child))
        for members in groups.values():
            if len(members) < 2:
                continue
            layers = [m for _, m in members]
            if not alone(layers, "weight") or (layers[0].bias is not None and not alone(layers, "bias")):
                log.info("shapewise: pack_projections leaves %s.{%s} alone: a weight shares its storage with a "
                         "tensor outside them (tied by storage)", name, ", ".join(n for n, _ in members))
                continue
            if packed_run([m.weight for m in layers]) is not None and (
                    layers[0].bias is None or packed_run([m.bias for m in layers]) is not None):
                continue
            with torch.no_grad():
                _pack([m.weight for m in layers])
                if layers[0].bias is not None:
                    _pack([m.bias for m in layers])
            done.append(Packed(name, tuple(n for n, _ in members), tuple(m.weight.shape[0] for m in layers),
                               layers[0].weight.shape[1]))
    for p in done:
        log.info("shapewise: pack_projections: %s", p)
    return done


def _pack(params: list[torch.nn.Parameter]) -> None:
    buffer = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = buffer[start:start + p.shape[0]]
        start += p.shape[0]


# --- the pass ----------------------------------------------------------------------------------

def _runs(values: list[torch.Tensor]) -> list[list[int]]:
    """The runs of at least two of the trace's (fake) tensors that are consecutive in one storage
    (each starting where the previous one ends), as index lists in storage order."""
    by_storage: dict[int, list[int]] = defaultdict(list)
    for i, v in enumerate(values):
        try:
            by_storage[v.untyped_storage()._cdata].append(i)
        except (RuntimeError, NotImplementedError):  # no storage to compare (a functional tensor)
            continue
    runs = []
    for members in by_storage.values():
        members.sort(key=lambda i: values[i].storage_offset())
        run = [members[0]]
        for i in members[1:]:
            prev = values[run[-1]]
            if values[i].storage_offset() == prev.storage_offset() + prev.numel():
                run.append(i)
                continue
            runs.append(run)
            run = [i]
        runs.append(run)
    return [r for r in runs if len(r) >= 2]


_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
             operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
             operator.imatmul, operator.setitem}


def _mutates(node: torch.fx.Node) -> bool:
    """Whether ``node`` may change a tensor in place (``x.add_``, ``x += y``, ``x[i] = y``, an op
    with a mutable argument); a module call, not looked into, counts."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_module":
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if target in _IN_PLACE:
        return True
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


@register_pass
@dataclass(frozen=True)
class FuseProjections(GraphPass):
    """Linear layers reading one activation, weights packed by ``pack_projections`` -> one matmul."""

    name: ClassVar[str] = "fuse_projections"
    version: ClassVar[int] = 1
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ConfigError(f"FuseProjections(max_tokens={self.max_tokens!r}): give a number of rows >= 1, or "
                              "None to fuse at every size")

    def applies(self, sizes: Sizes) -> bool:
        return self.max_tokens is None or all(isinstance(v, int) for v in sizes.values())

    def rewrite_key(self, sizes: Sizes) -> Hashable | None:
        # Without max_tokens the rewrite never reads the sizes: one rewrite serves every variant of a piece.
        return "every size" if self.max_tokens is None else None

    def rewrite(self, gm: torch.fx.GraphModule, sizes: Sizes) -> PassResult:
        if not isinstance(sizes, VariantSizes):
            sizes = VariantSizes(sizes)
        by_input: dict[torch.fx.Node, list[tuple]] = defaultdict(list)
        for node in gm.graph.nodes:
            found = match_linear(node)
            if found is not None and isinstance(found[0], torch.fx.Node) and isinstance(found[1], torch.fx.Node):
                by_input[found[0]].append((node, *found))
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        fused = 0
        for x, members in by_input.items():
            if len(members) < 2:
                continue
            why = self._refuse(x, members, sizes, position)
            if why is not None:
                log.debug("shapewise: FuseProjections leaves %s alone: %s", [m[0].name for m in members], why)
                continue
            runs = _runs([node_value(m[2]) for m in members])
            left = [m[0].name for i, m in enumerate(members) if not any(i in r for r in runs)]
            if left:
                log.debug("shapewise: FuseProjections leaves %s alone: their weights are not one packed run with "
                          "others reading the same input (sw.library.pack_projections(model) packs siblings)", left)
            for run in runs:
                group = [members[i] for i in run]
                self._fuse(gm, x, group, min(group, key=lambda m: position[m[0]])[0])
                fused += 1
        if fused:  # no eliminate_dead_code: it drops in-place calls (a static cache's index_copy_)
            gm.recompile()
        return PassResult(gm, bool(fused))

    def _refuse(self, x: torch.fx.Node, members: list[tuple], sizes: VariantSizes,
                position: dict[torch.fx.Node, int]) -> str | None:
        """Why this group is not fused, or None."""
        first = min(position[m[0]] for m in members)
        last = max(position[m[0]] for m in members)
        if any(position[a] > first for m in members for a in (m[2], m[3]) if isinstance(a, torch.fx.Node)):
            return "a weight or bias is computed after the first of the layers"
        # The fused matmul runs where the first layer ran: something changed in place between the
        # first and the last (the input, a weight, or a tensor either is a view of) would be read
        # before its change. Any in-place call in between refuses the group.
        between = [n for n, i in position.items() if first < i < last and _mutates(n)]
        if between:
            return f"{between[0].format_node()} changes a tensor in place between the layers"
        xv = node_value(x)
        if not isinstance(xv, torch.Tensor):
            return "its input has no traced value"
        has_bias = {m[3] is not None for m in members}
        if len(has_bias) != 1:
            return "some have a bias and some do not"
        for node, _, weight, bias, _ in members:
            out, wv = node_value(node), node_value(weight)
            if not isinstance(out, torch.Tensor) or out.requires_grad:
                return "the graph computes gradients (the fused op is for inference)"
            if type(wv) is not type(xv) or wv.dim() != 2 or wv.dtype != xv.dtype or out.dtype != xv.dtype:
                return "a weight is not a plain 2-D tensor of the input's dtype (a subclass, or autocast)"
            if bias is not None and not (isinstance(bias, torch.fx.Node) and isinstance(node_value(bias), torch.Tensor)
                                         and node_value(bias).dim() == 1):
                return "a bias is not a 1-D tensor input"
        if self.max_tokens is not None:
            shape = sizes.shape(x)
            if shape is None or any(d is None for d in shape) or math.prod(shape[:-1]) > self.max_tokens:
                return f"more than max_tokens={self.max_tokens} rows at these sizes"
        return None

    def _fuse(self, gm: torch.fx.GraphModule, x: torch.fx.Node, members: list[tuple], first: torch.fx.Node) -> None:
        g = gm.graph
        widths = [node_value(m[2]).shape[0] for m in members]
        biases = [m[3] for m in members] if members[0][3] is not None else []
        op = torch.ops.shapewise.linear_group.default
        with g.inserting_before(first):
            y = g.call_function(op, (x, [m[2] for m in members], biases))
            parts = g.call_method("split", (y, widths, -1))
            items = [g.call_function(operator.getitem, (parts, i)) for i in range(len(members))]
            outs = [g.call_method("contiguous", (item,)) for item in items]
        # Traced values for the new nodes, as Dynamo gives every node (AOT autograd's cache
        # takes a method call only on a node that has one).
        for node in (y, parts, *items):
            node.meta.update({k: v for k, v in first.meta.items() if k not in ("example_value", "val")})
        xv = node_value(x)
        mode = getattr(xv, "fake_mode", None)
        if mode is not None:
            with mode:
                yv = op(xv, [node_value(m[2]) for m in members], [node_value(b) for b in biases])
                pv = yv.split(widths, -1)
            y.meta["example_value"], parts.meta["example_value"] = yv, pv
            for item, v in zip(items, pv):
                item.meta["example_value"] = v
        for (node, *_), out in zip(members, outs):
            out.meta.update(node.meta)
            node.replace_all_uses_with(out)
            g.erase_node(node)
        for *_, transpose in members:
            if transpose is not None and not transpose.users:
                g.erase_node(transpose)
