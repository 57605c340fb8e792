"""``DecodeGemv``: at static sizes with few rows, linear layers become ``shapewise::gemv``.

    fast = sw.compile(model, sizes=[1, 2, 4, 8, 64], graph_passes=[sw.library.DecodeGemv(max_tokens=8)])

In: a compute piece's graph at a static variant's sizes. Out: the graph with every
``F.linear(x, W, b)``, ``x @ W.t()``, ``torch.mm(x, W.t())`` and ``torch.addmm(b, x, W.t())``
(``patterns.match_linear``) whose second operand is a 2-D ``[N, K]`` tensor (a weight, or any
other 2-D tensor: ``q @ k.t()`` is the same product and is rewritten too), whose rows (all of
``x``'s dims but the last, at the variant's sizes) number at most ``max_tokens``, and whose input
is on one of ``devices`` with one of ``dtypes`` (by default CUDA, bf16 and fp16: where the kernel
runs; on the CPU the op would only be ``F.linear`` behind a custom-op boundary that Inductor
cannot fuse through) replaced by a call of the ``shapewise::gemv`` custom op
(``shapewise.library.kernels.gemv``: a Triton kernel tuned per size on the GPU, ``F.linear``
elsewhere); ``PassResult.modified`` says whether any was. Range variants and larger sizes keep
cuBLAS. Importing this module registers the op.

A ``shapewise::linear_group`` (``FuseProjections``: q, k, v in one matmul over their packed
weights) that fits the same way becomes ``shapewise::gemv_group``: the kernel over the packed
``[sum N_i, K]`` view (or, where a weight was replaced and the run is broken, over their
concatenation, as ``linear_group`` does). Run DecodeGemv after FuseProjections
(``compile_generate`` puts FuseProjections first).

With ``glu=True``, a linear of ``silu(gate) * up`` (a gated MLP's down projection: Llama's, Qwen's,
Mistral's) becomes ``shapewise::gemv_glu(gate, up, W, b)``: the kernel computes the activation as it
loads its input, so the activation's kernel and its output's round trip through memory are gone;
where ``gate`` and ``up`` are FuseProjections' split halves of one matmul, the kernel reads them in
place. Where the pass can time (a GPU with Triton), it does so only where the kernel with the activation,
tuned with it (configs of its own, ``gemv_configs(glu=True)``), takes less time than the activation's
kernel and the plain product (``kernels.gemv.glu_pays``); elsewhere (the CPU, fake tensors) always. Off
by default: on an H100 (benchmarks/results/split_glu_h100_20261207) the GLU kernel lost its own tuning to
cuBLAS at 8 and 64 rows of a 7B-sized down projection, and at one row it took 37.2 µs against the plain
kernel's 33.7 (then taken by a timing that counted the activation's launch twice: the forward 609 ->
621 µs, since fixed); at one row of the 1B's, 16.0 against 13.4 + 2.1. Before the timing (2026-12-05,
the plain product's config reused) a 7B-sized stack took 1320 µs at 1 and 8 tokens against 672 and 685.

``pdl=True``: the kernels are launched with programmatic dependent launch where the GPU has it
(``kernels/pdl.py``: each starts while the kernel ahead finishes, prefetching its weight into L2);
the choice between the kernel and cuBLAS is still made by timing each alone.

As it rewrites, the pass tunes the kernel for each (rows, N, K, dtype, bias) it put in (on a CUDA
device with Triton, outside fake-tensor tracing and CUDA graph capture; ``kernels.gemv.tune``,
results in memory and under ``<shapewise cache>/gemv-tuning/``, shared by tensor-parallel ranks).
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx
import torch.nn.functional as F

from shapewise._compat import fake_mode_active, is_traceable_wrapper_subclass, node_value
from shapewise.errors import ConfigError

# importing these registers shapewise::gemv and shapewise::linear_group
from shapewise.library.fuse_projections import _backward as _group_backward
from shapewise.library.fuse_projections import _joined
from shapewise.library.fuse_projections import _setup_context as _group_setup
from shapewise.library.kernels.gemv import (
    MAX_ROWS,
    gemv,
    glu_pays,
    kernel_always,
    run_kernel,
    triton_gemv_available,
    tune,
)
from shapewise.library.patterns import match_linear
from shapewise.passes.base import register_pass
from shapewise.passes.graph_pass import GraphPass, PassResult, Sizes, VariantSizes

__all__ = ["DecodeGemv"]

log = logging.getLogger("shapewise")

def _device_name(d: Any) -> str:
    name = d.type if isinstance(d, torch.device) else str(d).split(":")[0]
    if name not in ("cuda", "cpu", "xpu", "mps", "meta"):
        raise ValueError(name)
    return name


def _dtype_name(d: Any) -> str:
    name = str(d).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(name)
    return name


def _names(values: Any, what: str, name_of: Callable[[Any], str]) -> tuple[str, ...]:
    """``devices``/``dtypes`` as names: one or several, as strings or torch objects."""
    items = (values,) if isinstance(values, (str, torch.device, torch.dtype)) else tuple(values)
    try:
        return tuple(name_of(v) for v in items)
    except ValueError as e:
        raise ConfigError(f"DecodeGemv({what}={values!r}): {e.args[0]!r} is not a {what[:-1]}; give names like "
                          f"{'cuda or cpu' if what == 'devices' else 'bfloat16 or float16'} (or torch objects)") from e


@torch.library.custom_op("shapewise::gemv_group", mutates_args=())
def gemv_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
               pdl: bool = False) -> torch.Tensor:
    """``shapewise::linear_group(x, weights, biases)`` through ``shapewise::gemv``: one kernel over
    the packed weights (``pdl`` as ``gemv``'s)."""
    w = _joined(weights, "weights")
    b = _joined(biases, "biases") if biases else None
    return gemv(x, w, b, pdl)


@gemv_group.register_fake
def _(x, weights, biases, pdl=False):
    return torch.ops.shapewise.linear_group.default(x, weights, biases)


def _gemv_group_setup(ctx, inputs, output) -> None:
    _group_setup(ctx, inputs[:3], output)


def _gemv_group_backward(ctx, grad):
    return (*_group_backward(ctx, grad), None)


gemv_group.register_autograd(_gemv_group_backward, setup_context=_gemv_group_setup)


@torch.library.custom_op("shapewise::gemv_glu", mutates_args=())
def gemv_glu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             pdl: bool = False) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, weight, bias)`` (a gated MLP's down projection): the kernel
    computes the activation as it loads it, where it runs (``gate`` and ``up`` of one shape and
    strides) and the tuning chose it for the weight; else the three ops."""
    y = run_kernel(gate, weight, bias, pdl, up=up)
    return F.linear(F.silu(gate) * up, weight, bias) if y is None else y


@gemv_glu.register_fake
def _(gate, up, weight, bias=None, pdl=False):
    torch._check(gate.shape == up.shape, lambda: f"shapewise::gemv_glu: gate {tuple(gate.shape)} and up "
                                                 f"{tuple(up.shape)} differ")
    torch._check(weight.dim() == 2 and gate.shape[-1] == weight.shape[1],
                 lambda: f"shapewise::gemv_glu: weight {tuple(weight.shape)} does not take gate {tuple(gate.shape)}")
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


def _glu_setup(ctx, inputs, output) -> None:
    gate, up, weight, bias, _ = inputs
    ctx.save_for_backward(gate, up, weight)
    ctx.has_bias = bias is not None


def _glu_backward(ctx, grad):
    gate, up, weight = ctx.saved_tensors
    with torch.enable_grad():
        g, u, w = (t.detach().requires_grad_(True) for t in (gate, up, weight))
        y = F.linear(F.silu(g) * u, w)
    grads = torch.autograd.grad(y, (g, u, w), grad)
    gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
    return (*grads, gb, None)


gemv_glu.register_autograd(_glu_backward, setup_context=_glu_setup)


@register_pass
@dataclass(frozen=True)
class DecodeGemv(GraphPass):
    """Linear layers with at most ``max_tokens`` rows at a static size -> ``shapewise::gemv``."""

    name: ClassVar[str] = "decode_gemv"
    version: ClassVar[int] = 7  # 2: linear_group -> gemv_group; 3: pdl; 4: glu; 5: glu where its timing pays; 6: norm;
    # 7: norm_rows
    max_tokens: int = 16
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[str, ...] = ("bfloat16", "float16")
    pdl: bool = False  # the kernels launched with programmatic dependent launch (kernels/pdl.py)
    glu: bool = False  # a linear of silu(gate) * up -> shapewise::gemv_glu (the activation in the kernel)
    norm: bool = False  # the RMSNorm before and the residual add after, in the kernel (norm_gemv.py)
    # ... only for products of at most this many rows. An H100 (benchmarks/results/norm_h100_20261207): at 1 row
    # the 1B's decode step 1130.8 against 1148.9 µs of GPU time, 118 against 150 kernels; at 16 and 64 rows
    # bench_llama's 7B-sized stack 689 against 659 and 889 against 705 µs (slower).
    norm_rows: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or not (
                1 <= self.max_tokens <= MAX_ROWS):
            raise ConfigError(f"DecodeGemv(max_tokens={self.max_tokens!r}): the kernel takes 1 to {MAX_ROWS} rows; "
                              f"give max_tokens between 1 and {MAX_ROWS}")
        if isinstance(self.norm_rows, bool) or not isinstance(self.norm_rows, int) or not (
                1 <= self.norm_rows <= MAX_ROWS):
            raise ConfigError(f"DecodeGemv(norm_rows={self.norm_rows!r}): the most rows a product with the norm in "
                              f"its kernel may have; give an int between 1 and {MAX_ROWS}")
        object.__setattr__(self, "devices", _names(self.devices, "devices", _device_name))
        object.__setattr__(self, "dtypes", _names(self.dtypes, "dtypes", _dtype_name))
        for flag, what in (("pdl", "programmatic dependent launch where the GPU has it"),
                           ("glu", "silu(gate) * up computed in the down projection's kernel"),
                           ("norm", "the RMSNorm before and the residual add after a product in its kernel")):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"DecodeGemv({flag}={getattr(self, flag)!r}): say True ({what}) or False")

    def applies(self, sizes: Sizes) -> bool:
        return all(isinstance(v, int) for v in sizes.values())

    def rewrite(self, gm: torch.fx.GraphModule, sizes: Sizes) -> PassResult:
        if not isinstance(sizes, VariantSizes):
            sizes = VariantSizes(sizes)
        op = torch.ops.shapewise.gemv.default
        group, grouped = torch.ops.shapewise.linear_group.default, torch.ops.shapewise.gemv_group.default
        shapes, placed = [], {}
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is group:
                shape = self._fits_group(node, sizes)
                if shape is not None:
                    shapes.append(shape)
                    placed[node] = shape
                    node.target = grouped
                    if self.pdl:
                        node.args = (*node.args, True)
                continue
            found = match_linear(node)
            if found is None:
                continue
            x, weight, bias, transpose = found
            shape = self._fits(node, x, node_value(weight) if isinstance(weight, torch.fx.Node) else None,
                               bias is not None, sizes)
            if shape is None:
                continue
            shapes.append(shape)
            pdl = (True,) if self.pdl else ()
            gated = _gated(x) if self.glu else None
            if gated is not None and not _glu_wanted(shape, self.pdl):
                gated = None
            with gm.graph.inserting_before(node):
                if gated is None:
                    new = gm.graph.call_function(op, (x, weight, bias, *pdl))
                else:
                    new = gm.graph.call_function(torch.ops.shapewise.gemv_glu.default, (*gated, weight, bias, *pdl))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            placed[new] = shape
            if transpose is not None and not transpose.users:
                gm.graph.erase_node(transpose)
            if gated is not None:
                _erase_unused(gm.graph, x)
        gm.recompile()
        _tune_ahead(shapes, pdl=self.pdl)
        if self.norm and shapes:
            from shapewise.library.norm_gemv import fuse_norms  # registers shapewise::gemv_norm

            fuse_norms(gm, lambda node: node in placed and placed[node][0] <= self.norm_rows
                       and _kernel_chosen(placed[node]))
        return PassResult(gm, bool(shapes))

    def _fits(self, node: torch.fx.Node, x: Any, wv: Any, bias: bool, sizes: VariantSizes) -> tuple | None:
        """(rows, N, K, dtype, bias?, device) when the node (input ``x``, weight value ``wv``) is
        rewritten at these sizes, else None."""
        xv = node_value(x) if isinstance(x, torch.fx.Node) else None
        if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)) or wv.dim() != 2 or xv.dim() < 1:
            return None
        if is_traceable_wrapper_subclass(xv) or is_traceable_wrapper_subclass(wv):
            return None  # a DTensor (a tensor-parallel rank's weight): the op has no sharding rule
        if xv.device.type not in self.devices or str(xv.dtype).removeprefix("torch.") not in self.dtypes:
            return None
        out = node_value(node)
        if wv.dtype != xv.dtype or not isinstance(out, torch.Tensor) or out.dtype != xv.dtype:
            return None  # e.g. under autocast, where the matmul's output dtype is autocast's, not x's
        shape = sizes.shape(x)
        if shape is None or any(d is None for d in shape) or shape[-1] != sizes.evaluate(wv.shape[1]):
            return None
        rows = math.prod(shape[:-1])
        if not 1 <= rows <= self.max_tokens:
            return None
        return rows, sizes.evaluate(wv.shape[0]), shape[-1], xv.dtype, bias, xv.device


    def _fits_group(self, node: torch.fx.Node, sizes: VariantSizes) -> tuple | None:
        """``_fits`` for a ``linear_group(x, weights, biases)``: the packed ``[sum N_i, K]`` weight."""
        x, weights, biases = node.args
        values = [node_value(w) if isinstance(w, torch.fx.Node) else None for w in weights]
        if not values or not all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in values):
            return None
        if any(is_traceable_wrapper_subclass(v) for v in values):
            return None
        first = values[0]
        if any(v.dtype != first.dtype or v.shape[1] != first.shape[1] for v in values):
            return None
        rows = sum(sizes.evaluate(v.shape[0]) for v in values)
        packed = torch.empty((rows, sizes.evaluate(first.shape[1])), dtype=first.dtype, device="meta")
        return self._fits(node, x, packed, bool(biases), sizes)


_SILU = (F.silu, torch._C._nn.silu)
_MUL = (operator.mul, torch.mul)


def _gated(x: Any) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(gate, up) when ``x`` is ``silu(gate) * up`` (in either order, read by nothing else), with a
    ``.contiguous()`` on either left out (FuseProjections' split halves: the kernel reads them in
    place); else None."""
    if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target in _MUL and len(x.args) == 2
            and not x.kwargs and len(x.users) == 1):
        return None
    for s, up in (x.args, x.args[::-1]):
        if (isinstance(s, torch.fx.Node) and s.op == "call_function" and s.target in _SILU and len(s.users) == 1
                and len(s.args) == 1 and not s.kwargs.get("inplace", False) and isinstance(up, torch.fx.Node)):
            gate, up = _in_place(s.args[0]), _in_place(up)
            gv, uv = node_value(gate), node_value(up)
            if isinstance(gv, torch.Tensor) and isinstance(uv, torch.Tensor) and gv.shape == uv.shape \
                    and gv.dtype == uv.dtype:
                return gate, up
    return None


def _in_place(node: torch.fx.Node) -> torch.fx.Node:
    """``t`` for ``t.contiguous()``, else the node."""
    if node.op == "call_method" and node.target == "contiguous" and len(node.args) == 1 and not node.kwargs \
            and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return node


def _erase_unused(graph: torch.fx.Graph, product: torch.fx.Node) -> None:
    """The product ``silu(gate) * up`` (now unread), its silu, and a ``.contiguous()`` left out."""
    silu = next(a for a in product.args if a.op == "call_function" and a.target in _SILU)
    around = [a for a in (*product.args, *silu.args) if isinstance(a, torch.fx.Node) and a is not silu
              and a.op == "call_method" and a.target == "contiguous"]
    graph.erase_node(product)
    graph.erase_node(silu)
    for node in around:
        if not node.users:
            graph.erase_node(node)


def _can_tune(device: torch.device, n: Any) -> bool:
    """Whether a shape on ``device`` can be timed here and now (the kernel's device, real tensors, no capture)."""
    return (device.type == "cuda" and n is not None and triton_gemv_available() and not fake_mode_active()
            and not torch.cuda.is_current_stream_capturing())


def _glu_wanted(shape: tuple, pdl: bool = False) -> bool:
    """Whether a gated product of this (rows, N, K, dtype, bias, device) becomes ``gemv_glu``: where it can be
    timed, only if the kernel with the activation beats the plain product and the activation's kernel
    (``kernels.gemv.glu_pays``); elsewhere (the CPU, fake tensors) it does, as asked (the op then decides
    at its first call between its kernel and the three ops)."""
    if not _can_tune(shape[-1], shape[1]):
        return True
    try:
        return glu_pays(*shape, linear=not kernel_always(pdl, shape[-1]))
    except Exception as e:  # noqa: BLE001 - a timing that fails keeps the plain product, never a failed compile
        log.warning("shapewise: DecodeGemv could not time silu(x) * up in the kernel for rows=%d weight=[%d, %d] "
                    "(%s: %s); the activation stays a kernel of its own", shape[0], shape[1], shape[2],
                    type(e).__name__, e)
        return False


def _kernel_chosen(shape: tuple) -> bool:
    """Whether the op runs the kernel for this (rows, N, K, dtype, bias, device), not ``F.linear``: where it
    can be timed, as tuned (``norm=True`` fuses only those: the fused op always runs the kernel); elsewhere yes."""
    rows, n, k, dtype, bias, device = shape
    if not _can_tune(device, n):
        return True
    try:
        return tune(rows, n, k, dtype, bias, device, wait=False) is not None
    except Exception:  # noqa: BLE001 - _tune_ahead logged it; the plain op stays
        return False


def _tune_ahead(shapes: list[tuple], pdl: bool = False) -> None:
    """Tune each rewritten shape now, where the kernel runs and tensors are real (the pass also
    runs on CPU graphs and may run under fake tensors); a shape another process is tuning is
    left to it (``wait=False``). With ``pdl`` (where the GPU has it): the weights' configs alone, as the
    op runs them (``shapewise::gemv``)."""
    for rows, n, k, dtype, bias, device in dict.fromkeys(shapes):
        if not _can_tune(device, n):
            continue
        try:
            tune(rows, n, k, dtype, bias, device, wait=False, linear=not kernel_always(pdl, device))
        except Exception as e:  # noqa: BLE001 - ahead of time is an optimisation: the op tunes on its first call
            log.warning("shapewise: DecodeGemv could not tune rows=%d weight=[%d, %d] %s at compile time (%s: %s); "
                        "the op tunes it on its first call", rows, n, k, dtype, type(e).__name__, e)

