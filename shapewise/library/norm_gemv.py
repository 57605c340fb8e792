"""``DecodeGemv(norm=True)``: a decode GEMV's RMSNorm before it and residual add after it, in its kernel.

A Llama-style layer at decode runs, between its GEMVs, two kernels of Inductor's: the residual add with
the RMSNorm after it (``h = h + o_proj(a)``, then ``rms_norm(h) * g`` for gate-up; the same after the
down projection for the next layer's qkv). Each is a few µs of a few KiB, a launch and a gap in the step.
Here the norm goes into the next GEMV's loads (the kernel takes each row's sum of squares as it streams
``x``, multiplies ``x`` by ``g`` as it loads it and scales the product by the rows' ``1 / rms``) and the
add into the previous GEMV's store (``shapewise::gemv_norm(x, weights, biases, g, eps, residual)``);
nothing is left between the two.

In: the graph ``DecodeGemv`` rewrote. A ``shapewise::gemv`` or ``gemv_group`` whose input is the
RMSNorm of a tensor ``h`` (``rms_norm_of``: ``h`` in float32, times ``rsqrt(mean(h²) + eps)``, back in
``h``'s dtype, times a ``[K]`` weight; each step read by nothing else) reads ``h`` and the norm's weight;
one whose output only a residual add reads (``residual + y``, same shape and dtype; through an inference
dropout, Phi-3's) adds the residual itself. Out: ``shapewise::gemv_norm`` calls. Where the op's kernel does
not run (the CPU, other dtypes, more rows), it computes the same as the graph it replaced, op by op
(``reference``).

Numerics: the kernel rounds ``x * g`` to x's dtype for the product, applies ``1 / rms`` to the float32
product, and adds the residual to it before the one rounding (eager rounds the normed ``x`` twice and the
product once before the add): within the dtype's rounding of eager. In bfloat16 only: in float16, ``x * g``
before the scale can pass the dtype's range where eager's ``x / rms`` does not (the op then runs the ops it
replaced). Nothing moves past an in-place write: where a node between the norm (or the product) and the add
may write a tensor in place, that part is left unfused.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from shapewise._compat import node_value

# importing these registers shapewise::gemv, shapewise::gemv_group and shapewise::linear_group
from shapewise.library.fuse_projections import _joined, _mutates
from shapewise.library.kernels.gemv import _fast_path, gemv_config

__all__ = ["fuse_norms", "gemv_norm", "reference", "rms_norm_of"]


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
              eps: float, residual: torch.Tensor | None) -> torch.Tensor:
    """What ``gemv_norm`` computes, as eager computes it (the ops it replaced)."""
    if norm_weight is not None:
        xf = x.float()
        x = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


@torch.library.custom_op("shapewise::gemv_norm", mutates_args=())
def gemv_norm(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
              norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None) -> torch.Tensor:
    """``residual + F.linear(rms_norm(x) * norm_weight, cat(weights), cat(biases))`` (either part left out
    where None), through the GEMV kernel with the norm in its loads and the add in its store where it runs."""
    w = _joined(weights, "weights") if len(weights) > 1 else weights[0]
    b = (_joined(biases, "biases") if len(biases) > 1 else biases[0]) if biases else None
    n, k = w.shape
    rows = x.numel() // max(1, x.shape[-1])
    # (float16 and the norm: the kernel loads x * g before the 1 / rms scale, which a residual stream's
    # large values times g can take past float16's range; eager scales first)
    fits = _fast_path(x, w, b) and (norm_weight is None or (
        norm_weight.shape == (k,) and norm_weight.dtype == x.dtype == torch.bfloat16
        and norm_weight.is_contiguous())) and (
        residual is None or (residual.shape == (*x.shape[:-1], n) and residual.dtype == x.dtype
                             and residual.is_contiguous()))
    if not fits:
        return reference(x, w, b, norm_weight, eps, residual)
    from shapewise.library.kernels.gemv_launch import _launch

    x2 = x.reshape(rows, k)
    with torch.cuda.device(x.device):
        cfg = gemv_config(x2, w, b, linear=False)
        if cfg is None:  # no config of the kernel ran for this weight (stored so): the ops it replaced
            return reference(x, w, b, norm_weight, eps, residual)
        y = _launch(x2, w, b, cfg, norm=None if norm_weight is None else (norm_weight, eps),
                    residual=None if residual is None else residual.reshape(rows, n))
    return y.reshape(*x.shape[:-1], n)


@gemv_norm.register_fake
def _(x, weights, biases, norm_weight, eps, residual):
    n = sum(w.shape[0] for w in weights)
    torch._check(all(w.shape[1] == x.shape[-1] for w in weights),
                 lambda: f"shapewise::gemv_norm: x's last dim {x.shape[-1]} != the weights' K")
    return x.new_empty((*x.shape[:-1], n))


def _setup(ctx, inputs, output) -> None:
    x, weights, biases, norm_weight, eps, residual = inputs
    ctx.save_for_backward(x, norm_weight, residual, *weights, *biases)
    ctx.split, ctx.eps = (len(weights), norm_weight is not None, residual is not None), eps


def _backward(ctx, grad):
    """The gradients of ``reference`` (recomputed from the saved inputs: the op is for decode, where nothing
    needs a gradient; training through it is right, not fast)."""
    x, g, res, *rest = ctx.saved_tensors
    count, has_norm, has_res = ctx.split
    weights, biases = rest[:count], rest[count:]
    needs = ctx.needs_input_grad

    def each(flag: Any, n: int) -> list[bool]:  # a list input's flags: one, or one per tensor
        return [bool(f) for f in flag] if isinstance(flag, (list, tuple)) else [bool(flag)] * n

    leaves = [t.detach().requires_grad_(need) for t, need in zip((x, g, res, *weights, *biases), (
        bool(needs[0]), has_norm and bool(needs[3]), has_res and bool(needs[5]),
        *each(needs[1], len(weights)), *each(needs[2], len(biases)))) if t is not None]
    xs, gs = leaves[0], leaves[1] if has_norm else None
    rs = leaves[1 + has_norm] if has_res else None
    ws, bs = leaves[1 + has_norm + has_res:][:count], leaves[1 + has_norm + has_res + count:]
    with torch.enable_grad():
        out = reference(xs, torch.cat(ws) if count > 1 else ws[0], (torch.cat(bs) if len(bs) > 1 else bs[0])
                        if bs else None, gs, ctx.eps, rs)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
    grads = {id(t): next(got) for t in wanted}
    pick = [grads.get(id(t)) for t in leaves]
    gx, gg = pick[0], pick[1] if has_norm else None
    gr = pick[1 + has_norm] if has_res else None
    gw, gb = pick[1 + has_norm + has_res:][:count], pick[1 + has_norm + has_res + count:]
    return gx, list(gw), list(gb), gg, None, gr


gemv_norm.register_autograd(_backward, setup_context=_setup)


_GEMVS = ("gemv", "gemv_group")
_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)


def _is(node: Any, fns: tuple = (), method: str | None = None) -> bool:
    return isinstance(node, torch.fx.Node) and (
        (node.op == "call_function" and node.target in fns) or (node.op == "call_method" and node.target == method))


def _only_user(node: Any, user: torch.fx.Node) -> bool:
    return isinstance(node, torch.fx.Node) and list(node.users) == [user]


def _float32_of(node: Any) -> Any:
    """``h`` where ``node`` is ``h.float()`` or ``h.to(torch.float32)``, else None."""
    if _is(node, method="float") and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if _is(node, method="to") and len(node.args) == 2 and node.args[1] is torch.float32 and not node.kwargs:
        return node.args[0]
    return None


def _cast_of(node: Any) -> Any:
    """``t`` where ``node`` is ``t.to(dtype)`` (one dtype argument), else None."""
    if _is(node, method="to") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs:
        return node.args[0]
    return None


def _pair(node: torch.fx.Node) -> list[tuple[Any, Any]]:
    return [tuple(node.args), tuple(node.args[::-1])] if len(node.args) == 2 and not node.kwargs else []


def _writes_between(first: torch.fx.Node, last: torch.fx.Node) -> bool:
    """Whether a node after ``first`` and before ``last`` (graph order) may write in place (``_mutates``,
    FuseProjections' test, whose group refuses for the same reason)."""
    node = first.next
    while node is not last and node.op != "root":
        if _mutates(node):
            return True
        node = node.next
    return False


def rms_norm_of(x: Any) -> tuple[torch.fx.Node, torch.fx.Node, float, list[torch.fx.Node]] | None:
    """(h, g, eps, the norm's nodes) where ``x`` is ``g * (hf * rsqrt(mean(hf ** 2, -1, keepdim=True) +
    eps)).to(h.dtype)`` with ``hf = h`` in float32 (either order of each product; LlamaRMSNorm and
    the like), every node but ``h`` read only inside it; else None."""
    if not _is(x, _MUL):
        return None
    for g, cast in _pair(x):
        inner = _cast_of(cast)
        if not (_only_user(cast, x) and _is(inner, _MUL) and _only_user(inner, cast)):
            continue
        for hf, r in _pair(inner):
            h = _float32_of(hf)
            if h is None or not _is(r, (torch.rsqrt,), "rsqrt") or not _only_user(r, inner):
                continue
            plus = r.args[0] if len(r.args) == 1 else None
            if not (_is(plus, _ADD, "add") and _only_user(plus, r)):
                continue
            for mean, eps in _pair(plus):
                if not (isinstance(eps, float) and _is(mean, (torch.mean,), "mean") and _only_user(mean, plus)):
                    continue
                if not (mean.args[1:] in ((-1,), ([-1],)) and mean.kwargs == {"keepdim": True}):
                    continue
                sq = mean.args[0]
                if not (_is(sq, (torch.pow, operator.pow), "pow") and sq.args[1:] == (2,) and not sq.kwargs
                        and sq.args[0] is hf and _only_user(sq, mean)):
                    continue
                if set(hf.users) != {sq, inner}:
                    continue
                hv, gv, xv = node_value(h), node_value(g), node_value(x)
                if not (isinstance(hv, torch.Tensor) and isinstance(gv, torch.Tensor) and isinstance(xv, torch.Tensor)
                        and gv.dim() == 1 and gv.shape[0] == hv.shape[-1] and cast.args[1] == hv.dtype
                        and gv.dtype == hv.dtype == xv.dtype):
                    continue
                return h, g, eps, [x, cast, inner, r, plus, mean, sq, hf]
    return None


def _identity_dropout(node: Any) -> bool:
    """Whether ``node`` is ``F.dropout(t, p, training=False)`` (or p = 0), not in place: ``t`` itself (Phi-3's
    residual dropouts at inference)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is F.dropout):
        return False
    names = ("input", "p", "training", "inplace")
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    p, training, inplace = bound.get("p", 0.5), bound.get("training", True), bound.get("inplace", False)
    return inplace is False and (training is False or p == 0.0) and set(bound) <= set(names)


def _residual_add(y: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]] | None:
    """(the add, the residual, nodes between) where ``y``'s one reader is ``residual + y`` (or ``y + residual``)
    of ``y``'s shape and dtype, through an inference dropout (``_identity_dropout``) or none; else None."""
    users = list(y.users)
    between = []
    if len(users) == 1 and _identity_dropout(users[0]) and users[0].args[0] is y:
        between, y = [users[0]], users[0]
        users = list(y.users)
    if len(users) != 1 or not _is(users[0], _ADD, "add"):
        return None
    add = users[0]
    for a, res in _pair(add):
        if a is y and isinstance(res, torch.fx.Node) and res is not y:
            yv, rv, av = node_value(y), node_value(res), node_value(add)
            if isinstance(yv, torch.Tensor) and isinstance(rv, torch.Tensor) and isinstance(av, torch.Tensor) \
                    and rv.shape == yv.shape == av.shape and rv.dtype == yv.dtype == av.dtype:
                return add, res, between
    return None


def fuse_norms(gm: torch.fx.GraphModule, wanted: Any = None) -> int:
    """Rewrite ``gm``'s ``shapewise::gemv`` / ``gemv_group`` calls (not PDL's) with their RMSNorm and
    residual add into ``shapewise::gemv_norm``; ``wanted(node)`` (default: every one) says which may be.
    Returns how many were."""
    graph, done = gm.graph, 0
    gemvs = {getattr(torch.ops.shapewise, name).default: name for name in _GEMVS}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in gemvs or (len(node.args) > 3 and node.args[3]):
            continue
        if wanted is not None and not wanted(node):
            continue
        x, weights, biases = node.args[:3]
        if gemvs[node.target] == "gemv":
            weights, biases = [weights], [] if biases is None else [biases]
        norm = rms_norm_of(x)
        add = _residual_add(node)
        # The fused op reads h (the norm's input) and x where the add (or the product) was: not past a write.
        if norm is not None and _writes_between(norm[3][-1], add[0] if add is not None else node):
            norm = None
        if norm is not None and getattr(node_value(norm[0]), "dtype", None) == torch.float16:
            norm = None  # (the kernel's x * g could overflow: the op would run the ops it replaced, unfused)
        if add is not None and _writes_between(node, add[0]):
            add = None
        if norm is None and add is None:
            continue
        h, g, eps = norm[:3] if norm is not None else (x, None, 0.0)
        where = add[0] if add is not None else node
        with graph.inserting_before(where):
            new = graph.call_function(torch.ops.shapewise.gemv_norm.default,
                                      (h, list(weights), list(biases), g, eps, add[1] if add else None))
        new.meta.update(where.meta)
        where.replace_all_uses_with(new)
        if add is not None:
            graph.erase_node(add[0])
            for dead in add[2]:
                graph.erase_node(dead)
        graph.erase_node(node)
        for dead in norm[3] if norm is not None else ():
            if not dead.users:
                graph.erase_node(dead)
        done += 1
    if done:
        gm.recompile()
    return done
