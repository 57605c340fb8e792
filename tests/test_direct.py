"""``direct_call=True``: calls past Dynamo's frame once a call has armed it (``shapewise.direct``).
Each test checks the answers against eager and whether the direct call or Dynamo served them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shapewise as sw
from shapewise.errors import DispatchMiss
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer
from tests.helpers import assert_same


def _served_directly(fast, call) -> bool:
    before = fast._direct.calls if fast._direct is not None else 0
    call()
    return fast._direct is not None and fast._direct.calls == before + 1


def test_direct_calls_answer_as_eager_at_every_size_and_range():
    torch.manual_seed(0)
    model = MLP().eval()
    fast = sw.compile(model, sizes=[1, 4, 8], ranges=[(9, 64)], direct_call=True, backend="aot_eager",
                      progress=False)
    assert fast.direct_info == "not traced yet"
    with torch.no_grad():
        fast(torch.randn(4, 32))  # traces, compiles, arms
        assert fast.direct_info == "on"
        for n in (1, 4, 8, 9, 33, 64):
            x = torch.randn(n, 32)
            assert _served_directly(fast, lambda x=x: assert_same(fast(x), model(x), f"n={n}"))


def test_what_the_checks_refuse_goes_through_dynamo_and_stays_right():
    torch.manual_seed(0)
    model = MLP().eval()
    fast = sw.compile(model, sizes=[4, 8], direct_call=True, backend="aot_eager", progress=False)
    x = torch.randn(8, 32)
    with torch.no_grad():
        fast(torch.randn(4, 32))
        assert not _served_directly(fast, lambda: assert_same(fast(x=x), model(x), "by keyword"))
        assert _served_directly(fast, lambda: assert_same(fast(x), model(x), "as armed"))
        with pytest.raises(DispatchMiss):  # a size the table does not serve: Dynamo's path, its error
            fast(torch.randn(5, 32))
        model.train()
        assert not _served_directly(fast, lambda: assert_same(fast(x), model(x), "train mode"))
        model.eval()
        assert _served_directly(fast, lambda: assert_same(fast(x), model(x), "eval again"))
        t = torch.randn(32, 8).t()  # not contiguous: Dynamo's path, which traces again for it
        assert not _served_directly(fast, lambda: assert_same(fast(t), model(t), "transposed"))
    assert fast.traces == 2 and fast.direct_info == "off: a second trace"
    # Grad mode differs from the trace's: Dynamo's path.
    assert not _served_directly(fast, lambda: assert_same(fast(x), model(x), "grad on"))


class ReturnsMore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, scale: float = 2.0):
        y = self.lin(x) * scale
        return {"y": y, "sum": y.sum(-1), "none": None, "n": 3}


def test_structured_results_and_constant_arguments():
    torch.manual_seed(0)
    model = ReturnsMore().eval()
    fast = sw.compile(model, sizes=[2, 4], direct_call=True, backend="aot_eager", progress=False)
    with torch.no_grad():
        fast(torch.randn(2, 16), 2.0)
        assert fast.direct_info == "on"
        for n in (2, 4):
            x = torch.randn(n, 16)
            out = {}
            assert _served_directly(fast, lambda x=x: out.update(fast(x, 2.0)))
            ref = model(x, 2.0)
            assert out["none"] is None and out["n"] == 3
            assert_same(out["y"], ref["y"], f"n={n}")
            assert_same(out["sum"], ref["sum"], f"n={n}")
        x = torch.randn(2, 16)
        assert not _served_directly(fast, lambda: assert_same(fast(x, 3.0)["y"], model(x, 3.0)["y"], "scale 3"))


class Identity(nn.Module):
    def forward(self, x):
        return x, x * 2


def test_a_result_it_cannot_rebuild_leaves_direct_calls_off_with_the_reason():
    fast = sw.compile(Identity(), sizes=[2, 4], direct_call=True, backend="aot_eager", progress=False)
    x = torch.randn(2, 3)
    out = fast(x)
    assert out[0] is x and fast._direct is None
    assert fast.direct_info.startswith("off: the result holds a tensor the compiled program did not return")


def test_splitting_ops_and_inductor():
    torch.manual_seed(0)
    model = ToyTransformer().eval()
    fast = sw.compile(model, sizes=[2, 4], splitting_ops=[ATTENTION_OP], direct_call=True, progress=False)
    with torch.no_grad():
        ids = torch.randint(0, 64, (2,))
        assert_same(fast(ids), model(ids), "arming call")
        for n in (2, 4):
            ids = torch.randint(0, 64, (n,))
            assert _served_directly(fast, lambda ids=ids: assert_same(fast(ids), model(ids), f"n={n}"))


def test_off_by_default():
    fast = sw.compile(MLP().eval(), sizes=[4], backend="aot_eager", progress=False)
    with torch.no_grad():
        fast(torch.randn(4, 32))
    assert fast._direct is None and fast.direct_info.startswith("off")
