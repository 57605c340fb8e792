"""Built-in toy models for the demo, tests and notebooks.

``ToyTransformer``: a small decoder (RMSNorm, attention through the registered custom op
``shapewise_toy::attention``, gated MLP) over flattened tokens ``[T]`` → logits ``[T, vocab]``.
The attention op is the splitting op, as attention is in vLLM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ATTENTION_OP", "ATTENTION_OUT_OP", "MLP", "ToyTransformer", "attention", "attention_out"]

ATTENTION_OP = "shapewise_toy::attention"
ATTENTION_OUT_OP = "shapewise_toy::attention_out"


@torch.library.custom_op(ATTENTION_OP, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over ``[T, H, D]`` tokens of one sequence (a stand-in for a real kernel)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
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
        out = F.scaled_dot_product_attention(q_.transpose(0, 1), k_.transpose(0, 1), v_.transpose(0, 1),
                                             is_causal=True).transpose(0, 1)
        return torch.autograd.grad(out, (q_, k_, v_), grad)


attention.register_autograd(_attention_backward, setup_context=_attention_setup)


@torch.library.custom_op(ATTENTION_OUT_OP, mutates_args=("out",))
def attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """Like ``attention`` but writes into ``out`` (the vLLM style of attention op)."""
    out.copy_(attention(q, k, v))


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
