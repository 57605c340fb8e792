"""Lean calls: an Inductor inference variant is called past AOTAutograd's runtime wrappers only
where they have nothing to do, and gives the wrapped call's answers at every size; variants
whose wrappers have work (an output the caller gets that aliases an input, an input written,
training, a call under autocast) keep them."""

from __future__ import annotations

import pytest
import torch

import shapewise as sw
from shapewise.models import ATTENTION_OP
from tests.helpers import assert_same, dynamo_graph, graph_args

pytestmark = pytest.mark.inductor


class Mixed(torch.nn.Module):
    """piece_0 returns a view of its input to the splitting op (an alias no caller sees: lean);
    piece_2 computes (lean)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(16, 16)

    def forward(self, x):
        q = x.view(x.shape[0], 2, 8)  # a view of the input crosses into the splitting op
        a = torch.ops.shapewise_toy.attention(q, q, q)
        return self.w(a.reshape(x.shape[0], 16)).relu()


def _lean_by_piece(fast) -> dict[str, set[bool]]:
    out: dict[str, set[bool]] = {}
    for row in fast.report():
        out.setdefault(row["piece"], set()).add(row["lean"])
    return out


def test_lean_where_the_wrappers_have_nothing_to_do_and_the_same_answers():
    model = Mixed().eval()
    fast = sw.compile(model, sizes=[1, 4], ranges=[(5, 32)], splitting_ops=[ATTENTION_OP], backend="inductor",
                      cache=False)
    wrapped = sw.compile(model, sizes=[1, 4], ranges=[(5, 32)], splitting_ops=[ATTENTION_OP], backend="inductor",
                         cache=False, lean=False)
    with torch.no_grad():
        for n in (1, 4, 5, 17, 32, 4, 1):  # repeated sizes: the second call of a variant is the lean one
            x = torch.randn(n, 16)
            assert_same(fast(x), model(x), f"n={n}")
            assert_same(fast(x), wrapped(x), f"n={n} (wrapped)")
    lean = _lean_by_piece(fast)
    assert lean["piece_0"] == {True}, "piece_0's view of its input only feeds the splitting op"
    assert lean["piece_2"] == {True}
    assert all(v == {False} for v in _lean_by_piece(wrapped).values())


class Views(torch.nn.Module):
    """piece_0 returns two views of one intermediate and a view of a buffer's slice to the
    splitting op (lean); piece_2 reads the buffer again and returns a view of its input to the
    caller (wrapped)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(64, 16))

    def forward(self, x):
        n = x.shape[0]
        h = x * 2
        a = torch.ops.shapewise_toy.attention(h.view(n, 2, 8), h.view(n, 2, 8), self.table[:n].view(n, 2, 8))
        return a.reshape(n, 16) + self.table[:n], x.view(n, 2, 8)


def test_views_the_caller_never_sees_are_lean_and_right():
    model = Views().eval()
    fast = sw.compile(model, sizes=[1, 4], splitting_ops=[ATTENTION_OP], backend="inductor", cache=False)
    with torch.no_grad():
        for n in (1, 4, 4, 1):
            x = torch.randn(n, 16)
            out, view = fast(x)
            ref, ref_view = model(x)
            assert_same(out, ref, f"n={n}")
            assert_same(view, ref_view, f"n={n}: the view returned")
            assert view._base is x, "the caller's view is eager's: a view of x"
    lean = _lean_by_piece(fast)
    assert lean["piece_0"] == {True}, "piece_0's views only feed the splitting op"
    assert lean["piece_2"] == {False}, "piece_2 returns a view of x to the caller: AOTAutograd regenerates it"


def test_not_lean_when_a_piece_writes_its_input_or_trains():
    class Writes(torch.nn.Module):
        def forward(self, x, buf):
            buf.add_(x.sum(0))
            return x * 2 + buf

    fast = sw.compile(Writes(), sizes=[2, 3], backend="inductor", cache=False, dynamic_dims={"x": 0})
    buf, ref_buf = torch.zeros(4), torch.zeros(4)
    with torch.no_grad():
        for n in (2, 3, 2, 3):
            x = torch.randn(n, 4)
            assert_same(fast(x, buf), Writes()(x, ref_buf), f"n={n}")
            assert_same(buf, ref_buf, f"n={n}: the write reaches the caller's tensor")
    assert {r["lean"] for r in fast.report()} == {False}

    model = torch.nn.Linear(8, 8)
    train = sw.compile(model, sizes=[2, 3], backend="inductor", cache=False)
    x = torch.randn(3, 8)
    train(x).sum().backward()
    assert {r["lean"] for r in train.report()} == {False}


def test_a_call_under_autocast_answers_as_the_wrapped_call():
    # Through sw.compile Dynamo traces again under autocast; a Pipeline runnable has no Dynamo in
    # front, so its lean variants see the autocast call themselves and take the wrapped path.
    def f(x, w):
        q = x.view(x.shape[0], 2, 8)
        return (torch.ops.shapewise_toy.attention(q, q, q).reshape(x.shape[0], 16) @ w).relu()

    x, w = torch.randn(4, 16), torch.randn(16, 16)
    gm = dynamo_graph(f, x, w)

    def runnable(lean):
        return sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(sizes=[4]),
                            sw.Lower(backend="inductor", cache=False, lean=lean)]).run(gm)

    lean, wrapped = runnable(True), runnable(False)
    args = graph_args(gm, x, w)
    with torch.no_grad():
        lean(*args), lean(*args)  # compiled, then lean
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, expected = lean(*args), wrapped(*args)
    assert_same(got, expected, "under autocast")
    assert any(r["lean"] for r in lean.report())


def _mlp_runnable(gm, **lower):
    return sw.Pipeline([sw.Concretize(sizes=[4, 8]), sw.Lower(backend="inductor", **lower)]).run(gm)


def test_a_lean_call_with_grad_on_answers_as_the_wrapped_one():
    # Built under no_grad (an inference graph), then called with grad on and a weight that
    # requires grad: AOTAutograd's wrapper runs inference graphs with grad off, so must the lean call.
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    x = torch.randn(4, 16)
    with torch.no_grad():
        gm = dynamo_graph(model, x)
        lean, wrapped = _mlp_runnable(gm, cache=False), _mlp_runnable(gm, cache=False, lean=False)
    weight, bias = model[0].weight, model[0].bias  # parameters: they require grad
    call = []
    for n in (n for n in gm.graph.nodes if n.op == "placeholder"):
        name = str(n.target)
        call.append(weight if "weight" in name else bias if "bias" in name
                    else x.shape[0] if isinstance(n.meta.get("example_value"), torch.SymInt) else x)
    with torch.no_grad():
        lean(*call)  # the first call goes through the wrapper
    assert any(r["lean"] for r in lean.report())
    got, expected = lean(*call), wrapped(*call)
    assert_same(got, expected, "grad on")
    assert not got[0].requires_grad if isinstance(got, (tuple, list)) else not got.requires_grad


def test_artifacts_loaded_from_the_cache_are_lean_too(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    x = torch.randn(8, 16)
    with torch.no_grad():
        for expected_source in ("compiled", "cache"):
            fast = sw.compile(model, sizes=[4, 8], backend="inductor", cache=str(tmp_path))
            fast(x), fast(x)
            assert_same(fast(x), model(x), expected_source)
            assert {(r["source"], r["lean"]) for r in fast.report()} == {(expected_source, True)}
