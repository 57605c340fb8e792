"""Built-in toy models for the demo, tests and notebooks.

``ToyTransformer``: a small decoder (RMSNorm, attention through the registered custom op
``shapewise_toy::attention``, gated MLP) over flattened tokens ``[T]`` → logits ``[T, vocab]``.
The attention op is the splitting op, as attention is in vLLM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ATTENTION_OP", "ATTENTION_OUT_OP", "MLP", "TPLlama", "ToyTransformer", "attention", "attention_out"]

ATTENTION_OP = "shapewise_toy::attention"
ATTENTION_OUT_OP = "shapewise_toy::attention_out"


@torch.library.custom_op(ATTENTION_OP, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over ``[T, H, D]`` tokens of one sequence (a stand-in for a real kernel)."""
    # 4-D [1, H, T, D]: SDPA's fused kernels (flash, memory-efficient) take only 4-D inputs; 3-D
    # would run the math kernel, which builds the whole [H, T, T] score matrix.
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True)[0]
    return torch.empty_like(q).copy_(out.transpose(0, 1))  # the layout the fake kernel promises


@attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _attention_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _attention_backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_.transpose(0, 1)[None], k_.transpose(0, 1)[None],
                                             v_.transpose(0, 1)[None], is_causal=True)[0].transpose(0, 1)
        return torch.autograd.grad(out, (q_, k_, v_), grad)


attention.register_autograd(_attention_backward, setup_context=_attention_setup)


@torch.library.custom_op(ATTENTION_OUT_OP, mutates_args=("out",))
def attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """Like ``attention`` but writes into ``out`` (the vLLM style of attention op)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True)[0]
    out.copy_(o.transpose(0, 1))


@attention_out.register_fake
def _(q, k, v, out):
    return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    """A two-layer MLP: the simplest model to compile per size."""

    def __init__(self, dim: int = 32, hidden: int = 64, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, out_variant: bool) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.norm2 = RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.out_variant = out_variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, d // self.heads).unbind(1)
        if self.out_variant:
            a = torch.empty_like(q)
            torch.ops.shapewise_toy.attention_out(q, k, v, a)
        else:
            a = torch.ops.shapewise_toy.attention(q, k, v)
        x = x + self.o(a.reshape(t, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ToyTransformer(nn.Module):
    """Token ids ``[T]`` → logits ``[T, vocab]``; attention is ``shapewise_toy::attention``."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, hidden: int = 64, layers: int = 2,
                 out_variant: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, out_variant) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TPLlama(nn.Module):
    """A Llama-style decoder over flattened tokens ``[T]`` -> logits ``[T, vocab]``, tensor
    parallel over ``world`` ranks as Megatron splits it: column-parallel ``qkv`` and ``gate_up``
    (each rank holds its heads and its slice of the hidden units), row-parallel ``o`` and
    ``down`` followed by an all-reduce, and a vocab-parallel head (each rank computes its slice
    of the logits, then an all-gather) (``torch.distributed``'s functional collectives, which
    Dynamo traces); embedding and norms are replicated. ``world=1`` is the single-process model;
    ``TPLlama.shard(full, rank, world)`` is one rank's part of it.
    """

    def __init__(self, layers: int = 2, dim: int = 64, heads: int = 4, hidden: int = 128, vocab: int = 128,
                 world: int = 1) -> None:
        super().__init__()
        if heads % world or hidden % world or vocab % world:
            raise ValueError(f"heads ({heads}), hidden ({hidden}) and vocab ({vocab}) must divide by the world size "
                             f"({world})")
        self.dim, self.heads, self.hidden, self.world = dim, heads, hidden, world
        local_dim, local_hidden = dim // world, hidden // world
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.norm1, layer.norm2 = RMSNorm(dim), RMSNorm(dim)
            layer.qkv = nn.Linear(dim, 3 * local_dim, bias=False)
            layer.o = nn.Linear(local_dim, dim, bias=False)
            layer.gate_up = nn.Linear(dim, 2 * local_hidden, bias=False)
            layer.down = nn.Linear(local_hidden, dim, bias=False)
            self.layers.append(layer)
        self.norm = RMSNorm(dim)
        self.vocab = vocab
        self.head = nn.Linear(dim, vocab // world, bias=False)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the last dim, side by side (the vocab-parallel head's logits)."""
        if self.world == 1:
            return x
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        # Gathered along dim 0 ([world * T, V / world]) and put side by side here: torch 2.11's
        # gather along another dim calls a helper Dynamo refuses to trace (_maybe_view_chunk_cat).
        rows = funcol.all_gather_tensor(x, gather_dim=0, group=dist.group.WORLD)
        return torch.cat(torch.chunk(rows, self.world, dim=0), dim=-1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        t, local_heads = ids.shape[0], self.heads // self.world
        for layer in self.layers:
            q, k, v = layer.qkv(layer.norm1(x)).view(t, 3, local_heads, self.dim // self.heads).unbind(1)
            a = attention(q, k, v).reshape(t, -1)
            x = x + self._reduce(layer.o(a))
            gate, up = layer.gate_up(layer.norm2(x)).chunk(2, dim=-1)
            x = x + self._reduce(layer.down(F.silu(gate) * up))
        return self._gather(self.head(self.norm(x)))

    @classmethod
    def shard(cls, full: TPLlama, rank: int, world: int) -> TPLlama:
        """Rank ``rank``'s part of the single-process model ``full`` (weights copied)."""
        if full.world != 1 or not 0 <= rank < world:
            raise ValueError(f"TPLlama.shard takes the single-process model (world=1, got {full.world}) and a rank "
                             f"in [0, {world}) (got {rank})")
        part = cls(len(full.layers), full.dim, full.heads, full.hidden, full.vocab, world)
        ld, lh, lv = full.dim // world, full.hidden // world, full.vocab // world
        cols, hid = slice(rank * ld, (rank + 1) * ld), slice(rank * lh, (rank + 1) * lh)
        with torch.no_grad():
            for name in ("embed.weight", "norm.weight"):
                part.get_parameter(name).copy_(full.get_parameter(name))
            part.head.weight.copy_(full.head.weight[rank * lv:(rank + 1) * lv])
            for mine, theirs in zip(part.layers, full.layers):
                mine.norm1.weight.copy_(theirs.norm1.weight)
                mine.norm2.weight.copy_(theirs.norm2.weight)
                mine.qkv.weight.copy_(theirs.qkv.weight.view(3, full.dim, full.dim)[:, cols].reshape(3 * ld, full.dim))
                mine.o.weight.copy_(theirs.o.weight[:, cols])
                mine.gate_up.weight.copy_(
                    theirs.gate_up.weight.view(2, full.hidden, full.dim)[:, hid].reshape(2 * lh, full.dim))
                mine.down.weight.copy_(theirs.down.weight[:, hid])
        return part
