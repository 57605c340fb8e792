"""Unbreakable: bad inputs and odd layouts through ``sw.compile``, configuration errors caught
before any trace, compile faults reported (or fallen back from), and one regression test per
library bug found while fuzzing (tests/test_fuzz.py)."""

from __future__ import annotations

import torch

import shapewise as sw
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer
from tests.conftest import assert_same
from tests.helpers import dynamo_graph

# -- regressions -------------------------------------------------------------------------------


def test_regression_bindings_given_as_a_list_of_dicts_reach_make_bindings():
    # Concretize froze [{"a": 2, "b": 4}] into tuples of pairs, which make_bindings then read as
    # plain sizes: "sizes must be ints, got (('a', 2), ('b', 4))".
    def f(x):
        return (x * 2).sum(1)

    gm = dynamo_graph(f, torch.randn(3, 5), dims={0: [0, 1]})
    a, b = (str(s) for s in sw.AnalyzeShapes()(gm).shapes.symbols)
    program = sw.Concretize(sizes=[{a: 2, b: 4}], ranges=[{a: (3, 9), b: (1, 10)}])(gm)
    assert [bd.key for bd in program.bindings] == [(2, 4), ((3, 9), (1, 10))]
    fast = sw.compile(f, dynamic_dims={"x": {0: "batch", 1: "seq"}}, backend="eager",
                      sizes=[{"batch": 2, "seq": 4}, {"batch": 3, "seq": 4}], ranges=[{"batch": (4, 8), "seq": (1, 9)}])
    for shape in ((2, 4), (3, 4), (5, 7)):
        x = torch.randn(shape)
        assert_same(fast(x), f(x))
    assert [r["key"] for r in fast.report()] == ["{batch=2, seq=4}", "{batch=3, seq=4}", "{batch=4..8, seq=1..9}"]


def test_regression_a_contiguous_call_after_a_strided_one_still_dispatches():
    # Dynamo gives a non-contiguous tensor with a dynamic dim a stride symbol of its own; it
    # was bound to its traced value like a size, so the trace accepted any stride but dispatch
    # knew one: after x[:, ::2], a contiguous x raised DispatchMiss {n=8, s7=32}. Layout-only
    # symbols are now fixed in the trace (a guard), so another layout traces again.
    model = MLP()
    fast = sw.compile(model, sizes=[4, 8], ranges=[(9, 32)], backend="eager")
    for x in (torch.randn(8, 64)[:, ::2], torch.randn(8, 32), torch.randn(20, 32), torch.randn(4, 64)[:, 1::2]):
        assert_same(fast(x), model(x), f"{tuple(x.shape)} {x.stride()}")
    assert fast.traces == 2
    assert all(len(r.program.shapes.symbols) == 1 for r in fast.runnables)


def test_one_splitting_op_may_be_given_as_a_string():
    # Regression: a string was split into characters ("unknown splitting op 's'").
    model = ToyTransformer(layers=1)
    fast = sw.compile(model, sizes=[4], splitting_ops=ATTENTION_OP, backend="eager")
    ids = torch.randint(0, 64, (4,))
    assert_same(fast(ids), model(ids))
    assert [p.is_splitting for p in fast.program.pieces] == [False, True, False]
