"""Splitting pieces that are one ``torch.library.custom_op`` call run the op's implementation
directly where its dispatch has nothing to do (issue 12's host path), and through the
dispatcher wherever it has: the first call, grad, a dispatch or torch function mode, a
profiler, tensor subclasses. Same answers either way; a written argument's version moves."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shapewise as sw
from shapewise.models import ATTENTION_OP, ToyTransformer
from tests.helpers import assert_same

pytestmark = pytest.mark.inductor


class Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_op_runs_direct_after_its_first_call_and_gives_the_same_answers():
    model = ToyTransformer(layers=2, dim=32, hidden=64).eval()
    fast = sw.compile(model, sizes=[1, 4], splitting_ops=[ATTENTION_OP], backend="aot_eager", cache=False)
    with torch.no_grad():
        for n in (1, 4, 1, 4):
            ids = torch.randint(0, 64, (n,))
            assert_same(fast(ids), model(ids), f"n={n}")
    splitting = [p for p in fast.program.pieces if p.is_splitting]
    assert splitting and all(p.call is not None for p in splitting)
    assert "_impl(" in splitting[0].call.__source__
    split = splitting[0]
    args = [torch.randn(4, 4, 8) for p in split.gm.graph.nodes if p.op == "placeholder"]  # q, k, v at 4 tokens
    with torch.no_grad(), Counting() as mode:  # a dispatch mode sees the op: the dispatcher's path
        split.call(*args)
    assert [op for op in mode.ops if ATTENTION_OP.replace("::", ".") in op], mode.ops
    with torch.no_grad(), torch.profiler.profile() as prof:  # so does the profiler
        fast(torch.randint(0, 64, (4,)))
    assert any(ATTENTION_OP in e.name for e in prof.events())
    off = sw.compile(model, sizes=[1, 4], splitting_ops=[ATTENTION_OP], backend="aot_eager", cache=False, lean=False)
    with torch.no_grad():
        off(torch.randint(0, 64, (1,)))
    assert all(p.call is None for p in off.program.pieces)


def test_with_grad_the_op_goes_through_autograd():
    model = ToyTransformer(layers=1, dim=32, hidden=64)
    fast = sw.compile(model, sizes=[3], splitting_ops=[ATTENTION_OP], backend="aot_eager", cache=False)
    weight = model.blocks[0].qkv.weight  # before attention: its grad flows back through the op
    for _ in range(2):  # the second call is past the op's first
        ids = torch.randint(0, 64, (3,))
        weight.grad = None
        fast(ids).square().sum().backward()
        got = weight.grad.clone()
        weight.grad = None
        model(ids).square().sum().backward()
        assert_same(got, weight.grad, "qkv grad through the custom op's backward")


@torch.library.custom_op("shapewise_test_lean::double_into", mutates_args=("out",))
def _double_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.data.copy_(x * 2)  # through .data: the write itself moves no version counter (as a Triton kernel's)


@_double_into.register_fake
def _(x, out):
    return None


def test_a_written_argument_gets_its_version_bumped():
    class OutModel(torch.nn.Module):
        def forward(self, x, buf):
            torch.ops.shapewise_test_lean.double_into(x + 1, buf)
            return buf * 3

    fast = sw.compile(OutModel(), sizes=[2], splitting_ops=["shapewise_test_lean::double_into"],
                      backend="aot_eager", cache=False, dynamic_dims={"x": 0, "buf": 0})
    buf, ref_buf = torch.zeros(2, 4), torch.zeros(2, 4)
    with torch.no_grad():
        for i in range(3):  # the first call goes through the dispatcher, the others direct
            x = torch.randn(2, 4)
            before = buf._version
            assert_same(fast(x, buf), OutModel()(x, ref_buf), f"call {i}")
            assert_same(buf, ref_buf, f"call {i}: the caller's buffer")
            assert buf._version > before, f"call {i}: a written argument's version moves, as the dispatcher does"
    (split,) = [p for p in fast.program.pieces if p.is_splitting]
    assert split.call is not None and "_bump(" in split.call.__source__


def test_pieces_that_are_not_one_custom_op_keep_their_forward():
    def f(x):
        return torch.relu(x).sum(0)

    fast = sw.compile(f, sizes=[2], splitting_ops=["aten::relu"], backend="aot_eager", cache=False)
    with torch.no_grad():
        fast(torch.randn(2, 3))
    assert all(p.call is None for p in fast.program.pieces)
