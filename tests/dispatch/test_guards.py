"""Input guards of Pipeline runnables: the generated check, its fast path, the fixes it makes
(a copy into the compiled layout, a re-view for size-1 dims, a copy back for mutated inputs),
and the errors it raises (dtype, device, rank, shape), through a backend that trusts the
compiled layout as Inductor does (so a missed check would be a wrong answer, not an error)."""

from __future__ import annotations

import pytest
import sympy
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import shapewise as sw
from shapewise.dispatch.guards import python_expr
from shapewise.ir import evaluate
from shapewise.ir.effects import mutated_inputs
from tests.helpers import assert_same, dynamo_graph, graph_args, symbolic_graph
from tests.strategies import SYMS, _exprs, to_sympy


def layout_trusting(gm, example_inputs):
    """A backend that reads each tensor input as the layout it was compiled for, without
    checking (like Inductor with ``size_asserts=False``): a wrong layout gives a wrong answer."""
    layouts = [(tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else None for a in example_inputs]

    def run(*args):
        args = [a.as_strided(lay[0], lay[1], a.storage_offset()) if lay is not None and all(
            isinstance(d, int) for d in lay[0] + lay[1]) else a for a, lay in zip(args, layouts)]
        return gm(*args)

    return run


def mlp(x, w):
    return (x @ w).relu().sum(1), x[:, :2] * 3


def build(fn, *example, sizes=(8,), ranges=(), backend=layout_trusting, **kw):
    gm = dynamo_graph(fn, *example, **kw)
    return gm, sw.Pipeline([sw.Concretize(sizes=sizes, ranges=ranges), sw.Lower(backend=backend)]).run(gm)


W = torch.randn(4, 5)


def test_generated_check_covers_dtype_device_shape_stride_of_every_tensor():
    gm, r = build(mlp, torch.randn(8, 4), W)
    src = r.table.exact[(8,)].__source__
    assert "a1.dtype is _dtype_a1 and a1.is_cpu and a1.shape == (8, 4) and a1.stride() == (4, 1)" in src
    assert "a2.shape == (4, 5) and a2.stride() == (5, 1)" in src
    assert "a0." not in src  # the size argument is the dispatch key: nothing more to check


def test_fast_path_does_not_touch_the_slow_path(monkeypatch):
    from shapewise.dispatch.guards import _SlowPath

    gm, r = build(mlp, torch.randn(8, 4), W)
    calls = []
    slow = _SlowPath.__call__
    monkeypatch.setattr(_SlowPath, "__call__", lambda self, *a: calls.append(a) or slow(self, *a))
    x = torch.randn(8, 4)
    assert_same(r(*graph_args(gm, x, W)), mlp(x, W))
    assert calls == []
    xt = torch.randn(4, 8).t()
    assert_same(r(*graph_args(gm, xt, W)), mlp(xt, W))
    assert len(calls) == 1


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 8).t(),                 # transposed buffer
    lambda: torch.randn(16, 4)[::2],               # step slice
    lambda: torch.randn(8, 12)[:, 3:11:2],         # column step, offset
    lambda: torch.randn(24, 4)[8:16],              # offset only (same strides)
    lambda: torch.randn(1, 4).expand(8, 4),        # stride 0
], ids=["transposed", "step", "colstep", "offset", "expanded"])
def test_odd_layouts_at_a_compiled_size_give_the_right_answer(make):
    gm, r = build(mlp, torch.randn(8, 4), W, ranges=[(9, 64)])
    x = make()
    assert_same(r(*graph_args(gm, x, W)), mlp(x, W))
    wt = torch.randn(5, 4).t()
    assert_same(r(*graph_args(gm, x, wt)), mlp(x, wt))


def test_odd_layouts_in_a_range_give_the_right_answer():
    gm, r = build(mlp, torch.randn(8, 4), W, ranges=[(9, 64)])
    for n in (9, 33, 64):
        x = torch.randn(4, n).t()
        assert_same(r(*graph_args(gm, x, W)), mlp(x, W), f"n={n}")


def test_symbolic_strides_are_checked_in_ranges():
    # make_fx: every dim symbolic, so the compiled stride of dim 0 is a symbol expression.
    def f(x):
        return x.cumsum(1) * 2

    gm = symbolic_graph(f, torch.randn(6, 5))
    a, b = (str(s) for s in sw.AnalyzeShapes()(gm).shapes.symbols)
    r = sw.Pipeline([sw.Concretize(ranges=[{a: (2, 64), b: (2, 64)}]), sw.Lower(backend=layout_trusting)]).run(gm)
    assert "a0.stride() == (a0.shape[1], 1)" in r.table.find_range((7, 5)).__source__
    for x in (torch.randn(7, 5), torch.randn(9, 5)[::2], torch.randn(5, 7).t(), torch.randn(7, 9)[:, :5]):
        assert_same(r(x), f(x))


def test_only_size_one_dims_differ_is_a_view_not_a_copy():
    seen = []

    def spy(gm, example_inputs):
        def run(*args):
            seen.extend(a.data_ptr() for a in args if isinstance(a, torch.Tensor))
            return gm(*args)
        return run

    gm, r = build(mlp, torch.randn(8, 4), W, sizes=[1, 8], backend=spy)
    x = torch.randn(4, 1).t()  # shape (1, 4), stride (1, 1): the compiled stride is (4, 1)
    assert x.stride() != (4, 1)
    assert_same(r(*graph_args(gm, x, W)), mlp(x, W))
    assert x.data_ptr() in seen


@pytest.mark.parametrize("bad, fragment", [
    (lambda: torch.randn(8, 4, dtype=torch.float64),
     r"argument 1 \(l_x_\): expected dtype torch.float32, got torch.float64"),
    (lambda: torch.randn(8, 4, device="meta"), r"argument 1 \(l_x_\): expected a tensor on cpu, got one on meta"),
    (lambda: torch.randn(8, 4, 1), r"argument 1 \(l_x_\): expected a 2-dim tensor, got 3 dims"),
    (lambda: torch.randn(8, 3), r"argument 1 \(l_x_\): expected shape \(8, 4\) for size \{s\d+=8\}, got \(8, 3\)"),
    (lambda: [1, 2], r"argument 1 \(l_x_\): expected a tensor, got list"),
])
def test_mismatches_name_the_argument_what_was_expected_and_what_came(bad, fragment):
    gm, r = build(mlp, torch.randn(8, 4), W)
    with pytest.raises(sw.InputMismatch, match=fragment):
        r(8, bad(), W)


def test_size_argument_that_disagrees_with_the_tensor():
    gm, r = build(mlp, torch.randn(8, 4), W, sizes=[8, 16])
    with pytest.raises(sw.InputMismatch, match=r"expected shape \(8, 4\).*got \(16, 4\).*size arguments"):
        r(8, torch.randn(16, 4), W)


def test_an_input_traced_broadcast_is_not_squashed_into_one_row():
    gm = dynamo_graph(lambda x: x.cumsum(0), torch.randn(1, 4).expand(8, 4))  # traced with stride (0, 1)
    r = sw.Pipeline([sw.Concretize(sizes=[8]), sw.Lower(backend="eager")]).run(gm)
    x = torch.randn(1, 4).expand(8, 4)
    assert_same(r(*graph_args(gm, x)), (x.cumsum(0),))
    with pytest.raises(sw.InputMismatch, match=r"broadcast input with strides \(0, 1\).*got strides \(4, 1\)"):
        r(*graph_args(gm, torch.randn(8, 4)))


def test_a_mutated_input_is_copied_back():
    def f(x):
        x.mul_(2)
        return x + 1

    gm = dynamo_graph(f, torch.randn(8, 4))
    assert mutated_inputs(gm) == {1}
    assert mutated_inputs(dynamo_graph(mlp, torch.randn(8, 4), W)) == frozenset()
    r = sw.Pipeline([sw.Concretize(sizes=[8]), sw.Lower(backend="aot_eager")]).run(gm)
    x = torch.randn(4, 8).t()
    expected_x = x.clone()
    expected = f(expected_x)
    out = r(*graph_args(gm, x))
    assert_same(out, (expected,))
    assert_same(x, expected_x)  # the caller's tensor was written, as eager writes it


@pytest.mark.parametrize("policy", ["eager", "dynamic"])
def test_miss_runners_are_guarded_too(policy):
    gm = dynamo_graph(mlp, torch.randn(8, 4), W)
    program = sw.Pipeline([sw.Concretize(sizes=[8]), sw.Lower(backend="aot_eager")]).run(gm).program
    r = sw.Pipeline([sw.BuildDispatch(on_miss=policy)]).run(program.replace(on_miss=policy))
    x = torch.randn(4, 5).t()
    assert_same(r(*graph_args(gm, x, W)), mlp(x, W))
    with pytest.raises(sw.InputMismatch, match="expected dtype"):
        r(5, x.double(), W)


def test_runnables_behind_dynamo_add_no_checks():
    fast = sw.compile(mlp, sizes=[8], backend="eager", dynamic_dims={"x": 0})
    x = torch.randn(8, 4)
    fast(x, W)
    for fn in fast.runnable.table.exact.values():
        assert getattr(fn, "__name__", "") != "guarded"


@settings(max_examples=200, deadline=None, print_blob=True)
@given(tree=_exprs(), values=st.tuples(*[st.integers(1, 10**6)] * 3))
def test_python_spelling_of_size_expressions_matches_evaluate(tree, values):
    expr = to_sympy(tree)
    note(f"expr = {expr}, values = {values}")
    names = {s: f"v[{i}]" for i, s in enumerate(SYMS)}
    src = python_expr(expr, names)
    assert eval(src, {"v": values}) == evaluate(expr, dict(zip(SYMS, values)))  # noqa: S307


def test_python_spelling_refuses_what_it_cannot_spell():
    with pytest.raises(NotImplementedError, match="no Python spelling"):
        python_expr(sympy.sin(SYMS[0]), {SYMS[0]: "a"})


@pytest.mark.inductor
def test_inductor_static_and_range_variants_take_any_layout():
    gm = dynamo_graph(mlp, torch.randn(8, 4), W)
    for opts in ({}, {"size_asserts": False}):
        r = sw.Pipeline([sw.Concretize(sizes=[8], ranges=[(9, 32)]),
                         sw.Lower(backend="inductor", static_options=opts)]).run(gm)
        for x in (torch.randn(4, 8).t(), torch.randn(16, 4)[::2], torch.randn(4, 20).t(), torch.randn(40, 4)[::2]):
            for w in (W, torch.randn(5, 4).t()):
                assert_same(r(*graph_args(gm, x, w)), mlp(x, w), f"{opts} {tuple(x.shape)} {x.stride()}")
