"""Unbreakable: bad inputs and odd layouts through ``sw.compile``, configuration errors caught
before any trace, compile faults reported (or fallen back from), and one regression test per
library bug found while fuzzing (tests/test_fuzz.py)."""

from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch

import shapewise as sw
from shapewise.concretize import check_binding
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer
from tests.helpers import assert_same, dynamo_graph

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


def test_regression_a_range_that_ends_at_a_refused_size_fails_before_compiling():
    # Found by the fuzzer: reshaping a transposed tensor guards n != 1 in the trace. A range
    # from 1 passed Concretize (only single sizes met the guards) and its compile failed later,
    # or, with a backend that does not trace again (eager), not at all.
    def f(x):
        return x.t().reshape(1, -1) * 2

    compiled = []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    fast = sw.compile(f, ranges=[(1, 8)], backend=backend)
    with pytest.raises(sw.GuardViolation, match=r"range \{n=1..8\} ends at the size \{n=1\}, which contradicts "
                                                r"the trace's guard `Ne\(n, 1\)`"):
        fast(torch.randn(4, 3))
    assert compiled == []
    fast = sw.compile(f, ranges=[(2, 8), (9, 100)], backend=backend)
    x = torch.randn(50, 3)
    assert_same(fast(x), f(x))
    # A guard that only sizes inside the range break (odd sizes under n % 2 == 0) leaves the
    # range alone: those sizes are the model's to refuse.
    program = sw.AnalyzeShapes()(dynamo_graph(lambda x: x * 2, torch.randn(6, 3)))
    (s,) = program.shapes.symbols
    for guard, box, refused in ((sympy.Ne(s, 37), (37, 100), True), (sympy.Ne(s, 37), (2, 100), False),
                                (sympy.Eq(sympy.Mod(s, 2), 0), (10, 64), False),
                                (sympy.Eq(sympy.Mod(s, 2), 0), (9, 64), True)):
        shapes = dataclasses.replace(program.shapes, guards=((guard, ""),))
        if refused:
            with pytest.raises(sw.GuardViolation, match="ends at the size"):
                check_binding(shapes, sw.Binding.of({s: box}))
        else:
            check_binding(shapes, sw.Binding.of({s: box}))


def test_regression_indexing_a_splitting_ops_output_is_computation_not_unpacking():
    # Found by the fuzzer: every getitem after a splitting op stayed in the splitting piece, so
    # y[torch.arange(0, n, 2)] (arange computed after the op) made the splitting piece read a
    # node of the next piece: "a get_attr node (arange ...) is read directly by the stitching graph".
    def f(x):
        y = torch.ops.shapewise_toy.attention(x[:, None], x[:, None], x[:, None])[:, 0]
        return y[torch.arange(0, y.shape[0], 2)] * 2

    gm = dynamo_graph(f, torch.randn(5, 6))
    plan = sw.Split(ops=[ATTENTION_OP]).plan(gm)
    by_node = dict(plan.assignment)
    assert [by_node[n.name] for n in gm.graph.nodes if n.op == "call_function"][-3:] == [2, 2, 2]
    fast = sw.compile(f, sizes=[1, 5], ranges=[(6, 32)], splitting_ops=[ATTENTION_OP], backend="aot_eager")
    for n in (5, 1, 17):
        x = torch.randn(n, 6)
        assert_same(fast(x), f(x), f"n={n}")


def _cat_then_attention(x):
    y = torch.cat([x, x[:1] * 3])  # s + 1 rows
    return torch.ops.shapewise_toy.attention(y[:, None], y[:, None], y[:, None])[:, 0] * 2


def test_regression_a_piece_gets_every_symbol_of_its_input_sizes():
    # Found by the fuzzer (with Inductor): the piece after the attention op saw only the size
    # s + 1, and a symbolic (range) Inductor compile cannot recover s from it: "For s63 + 1,
    # expected [s63] to have been codegen-ed". The piece now also takes s (unused, for binding).
    gm = dynamo_graph(_cat_then_attention, torch.randn(5, 6))
    program = sw.Split(ops=[ATTENTION_OP])(gm)
    size_arg = next(n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("s"))
    first, _, last = ([n.name for n in p.gm.graph.nodes if n.op == "placeholder"] for p in program.pieces)
    assert size_arg not in first  # x carries s bare: nothing to add
    assert last[-1] == size_arg


@pytest.mark.inductor
def test_regression_inductor_range_compile_of_a_piece_that_sees_only_s_plus_one():
    fast = sw.compile(_cat_then_attention, sizes=[1], ranges=[(2, 9)], splitting_ops=[ATTENTION_OP],
                      backend="inductor")
    with torch.no_grad():
        for n in (1, 2, 5, 9):
            x = torch.randn(n, 6)
            assert_same(fast(x), _cat_then_attention(x), f"n={n}")


SCALE2 = "shapewise_robust::scale2"


@torch.library.custom_op(SCALE2, mutates_args=())
def _scale2(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x).copy_(x * 2)


@_scale2.register_fake
def _(x):
    return torch.empty_like(x)


def _size_across(x):
    y = x.unsqueeze(1).expand(-1, 2, -1).reshape(-1, x.shape[1])  # 2*s rows
    shape = y.size()  # crosses the split as size arguments 2*s and 6
    return torch.ops.shapewise_robust.scale2(y).reshape(-1).reshape(shape) + x.sum()  # x: s in a tensor dim


def test_regression_a_piece_with_a_size_argument_gets_its_symbol_as_an_argument():
    gm = dynamo_graph(_size_across, torch.randn(5, 6))
    program = sw.Split(ops=[SCALE2])(gm)
    size_arg = next(n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("s"))
    last = [n for n in program.pieces[-1].gm.graph.nodes if n.op == "placeholder"]
    assert any(isinstance(n.meta["example_value"], torch.SymInt) and n.name != size_arg for n in last)
    assert last[-1].name == size_arg


@pytest.mark.inductor
def test_regression_inductor_graph_cache_guards_over_size_arguments():
    # Found by the fuzzer (with Inductor): a piece whose size argument is 2*s but that had s only
    # in a tensor dim compiled once; compiling the same piece again (another process, the next
    # model) hit Inductor's graph cache, whose guards are stated over size arguments only, and
    # failed: "NameError: name 'shapewise_s77' is not defined".
    for _ in range(2):
        torch._dynamo.reset()
        fast = sw.compile(_size_across, ranges=[(1, 4)], splitting_ops=[SCALE2], backend="inductor")
        with torch.no_grad():
            for n in (1, 3, 4):
                x = torch.randn(n, 6)
                assert_same(fast(x), _size_across(x), f"n={n}")


def test_regression_a_second_trace_skips_the_sizes_only_the_first_serves(caplog):
    # Found by the fuzzer: a first call at n=1 traces a graph for n == 1 only (reshaping a
    # transposed tensor is a view only then). A call at n=5, compiled nowhere, failed that guard,
    # traced again, and that trace refused size 1: the call raised GuardViolation about a size it
    # had not asked for. A second trace now serves the sizes its own guards allow (none here),
    # and the call misses, with a note of what each trace serves.
    def f(x):
        return x.t().unsqueeze(1).expand(-1, 2, -1).reshape(-1, x.shape[0]) * 2

    fast = sw.compile(f, sizes=[1], backend="eager")
    x = torch.randn(1, 4)
    assert_same(fast(x), f(x))
    with pytest.raises(sw.DispatchMiss, match=r"size \{n=5\}") as err:
        fast(torch.randn(5, 4))
    assert "trace 1: {n=1}; trace 2: none" in "".join(err.value.__notes__)
    assert any("skipping {n=1} in this trace" in m and "Ne(n, 1)" in m for m in caplog.messages)
    assert_same(fast(x), f(x))
    gm = dynamo_graph(f, torch.randn(5, 4))
    program = sw.Concretize(sizes=[1, 3], refused="skip")(gm)
    assert [b.key for b in program.bindings] == [(3,)]
    with pytest.raises(sw.GuardViolation, match=r"size \{s\d+=1\} contradicts the trace's guard `Ne"):
        sw.Concretize(sizes=[1, 3])(gm)



class _BranchesOnOne(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        return y.cumsum(0) if x.shape[0] > 1 else y * 2


def test_regression_many_compiled_instances_of_one_class_each_trace_twice():
    # Found trying direct calls on the transformers zoo in one process: every compiled instance
    # of a class puts its traces on the class's one forward code, and the 5th instance's second
    # trace (decode, 1 token) hit Dynamo's recompile limit (8), an error under fullgraph=True.
    models = [_BranchesOnOne().eval() for _ in range(6)]
    fasts = [sw.compile(m, sizes=[1, 4], backend="aot_eager", progress=False) for m in models]
    with torch.no_grad():
        for i, (model, fast) in enumerate(zip(models, fasts)):
            for n in (4, 1, 4, 1):
                x = torch.randn(n, 16)
                assert_same(fast(x), model(x), f"instance {i}, n={n}")
            assert fast.traces == 2


# -- 1. inputs a variant was not compiled for, through sw.compile ------------------------------
# Dynamo's guards sit in front of the runnable: a new layout, dtype or rank fails a guard and
# Dynamo traces again (dims marked dynamic again, so the new trace serves every size); nothing
# reaches a compiled variant that was not compiled for it. (Pipeline runnables, with no Dynamo in
# front, check their inputs themselves: tests/dispatch/test_guards.py.)

ODD_LAYOUTS = {
    "transposed": lambda n: torch.randn(32, n).t(),
    "step": lambda n: torch.randn(2 * n, 32)[::2],
    "column step": lambda n: torch.randn(n, 64)[:, 1::2],
    "offset": lambda n: torch.randn(n + 3, 32)[3:],
    "expanded": lambda n: torch.randn(1, 32).expand(n, 32),
}


def test_odd_layouts_through_compile_give_the_right_answer():
    model = MLP()
    fast = sw.compile(model, sizes=[1, 4, 8], ranges=[(9, 64)], backend="aot_eager")
    for n in (8, 1, 4, 33):
        x = torch.randn(n, 32)
        assert_same(fast(x), model(x), f"contiguous n={n}")
    assert fast.traces == 1
    for name, make in ODD_LAYOUTS.items():
        for n in (1, 4, 8, 33):
            x = make(n)
            assert_same(fast(x), model(x), f"{name} n={n}")
    # One new trace per new layout at most (each serves every size), never one per size.
    assert fast.traces <= 1 + len(ODD_LAYOUTS)


def test_another_dtype_through_compile_traces_again_or_fails_as_eager_does():
    def f(x):
        return (x * 2).softmax(-1)

    fast = sw.compile(f, sizes=[2, 8], backend="aot_eager")
    x = torch.randn(8, 5)
    assert_same(fast(x), f(x))
    for dtype in (torch.float64, torch.bfloat16):
        for n in (2, 8):
            x = torch.randn(n, 5, dtype=dtype)
            assert_same(fast(x), f(x), f"{dtype} n={n}")
    assert fast.traces == 3
    model = MLP()  # float32 weights: a float64 input fails in eager, and fails the same way here
    fast = sw.compile(model, sizes=[8], backend="aot_eager")
    fast(torch.randn(8, 32))
    x = torch.randn(8, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError) as eager_err:
        model(x)
    with pytest.raises(RuntimeError) as err:
        fast(x)
    assert "dtype" in str(eager_err.value) and "dtype" in str(err.value)


def test_another_rank_through_compile():
    model = MLP()
    fast = sw.compile(model, sizes=[2, 8], backend="aot_eager")
    fast(torch.randn(8, 32))
    x = torch.randn(2, 8, 32)  # Linear takes any rank: a new trace, batch dim 0 = 2 is compiled
    assert_same(fast(x), model(x))
    with pytest.raises(sw.DispatchMiss, match=r"size \{n=3\}"):
        fast(torch.randn(3, 8, 32))


# -- 2. configuration errors, before any trace -------------------------------------------------

class _Untraceable(torch.nn.Module):
    """Fails the test if anything traces it: configuration errors must come first."""

    def forward(self, x):
        raise AssertionError("traced: the configuration error should have been raised before any trace")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(sizes=[0]), r"sizes must be >= 1, got 0"),
    (dict(sizes=[4, -2]), r"sizes must be >= 1, got -2"),
    (dict(sizes=[1, 8, 8]), r"sizes lists 8 more than once"),
    (dict(sizes=[8.0]), r"sizes must be ints, got 8.0 \(float\)"),
    (dict(sizes="1,8"), r"sizes must be ints, a \{name: \[sizes\]\} dict or a list of \{name: size\} dicts"),
    (dict(sizes=[1, {"n": 2}]), r"sizes mixes ints and dicts"),
    (dict(sizes={"n": [2, 2]}), r"sizes\['n'\] lists 2 more than once"),
    (dict(ranges=[(9, 4)]), r"range \(9, 4\) is empty"),
    (dict(ranges=[(0, 4)]), r"sizes must be >= 1, got 0"),
    (dict(ranges=[(1, 8), (8, 16)]), r"ranges \(1, 8\) and \(8, 16\) overlap"),
    (dict(ranges=[(1, 10), (5, 6)]), r"ranges \(1, 10\) and \(5, 6\) overlap"),
    (dict(ranges=(9, 64)), r"did you mean ranges=\[\(9, 64\)\]"),
    (dict(ranges=[(1, 2, 3)]), r"a range is a \(low, high\) pair"),
    (dict(ranges={"n": [(1, 4), (3, 9)]}), r"ranges\['n'\]: ranges \(1, 4\) and \(3, 9\) overlap"),
    (dict(ranges=[{"n": (1, 4)}, {"n": (4, 9)}]), r"overlap"),
    (dict(dynamic_dims={"x": {0: "batch"}}, sizes={"bacth": [1, 2]}), r"'bacth', which is not a dynamic dim.*'batch'"),
    (dict(dynamic_dims={"x": {0: "batch"}}, ranges=[{"btch": (1, 2)}]), r"did you mean 'batch'"),
    (dict(sizes={"seq": [1]}), r"'seq', which is not a dynamic dim; the dynamic dims are \['n'\]"),
    (dict(dynamic_dims={"y": 0}), r"dynamic_dims names 'y', which is not an argument.*\['x'\]"),
    (dict(dynamic_dims={"x": "0"}), r"dynamic_dims\['x'\] must be a dim"),
    (dict(splitting_ops=["shapewise_toy::attentoin"]), r"closest registered names: \['shapewise_toy::attention"),
    (dict(splitting_ops="shapewise_toy::atention"), r"unknown splitting op 'shapewise_toy::atention'"),
    (dict(splitting_ops=["atention"]), r"unknown splitting op 'atention'"),
    (dict(backend="inductr"), r"unknown backend 'inductr'"),
    (dict(on_miss="pad"), r"on_miss must be"),
    (dict(on_compile_error="ignore"), r"on_compile_error must be 'raise' or 'fallback'"),
])
def test_configuration_errors_before_any_trace(kwargs, fragment):
    with pytest.raises(sw.ConfigError, match=fragment):
        sw.compile(_Untraceable(), **{"sizes": [1, 2], **kwargs})


def test_one_splitting_op_may_be_given_as_a_string():
    # Regression: a string was split into characters ("unknown splitting op 's'").
    model = ToyTransformer(layers=1)
    fast = sw.compile(model, sizes=[4], splitting_ops=ATTENTION_OP, backend="eager")
    ids = torch.randint(0, 64, (4,))
    assert_same(fast(ids), model(ids))
    assert [p.is_splitting for p in fast.program.pieces] == [False, True, False]


def test_pipeline_passes_refuse_bad_sizes_when_built():
    with pytest.raises(sw.ConfigError, match="more than once"):
        sw.Concretize(sizes=[2, 2])
    with pytest.raises(sw.ConfigError, match="overlap"):
        sw.Pipeline([sw.Concretize(ranges=[(1, 5), (5, 9)])])


def test_sizes_the_trace_refuses_name_the_guard_before_compiling():
    def pairs(x):
        return x.view(-1, 2, x.shape[1]).sum(1)

    compiled = []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    # A Pipeline refuses the size before any compile; sw.compile leaves it out of this trace
    # (a call at 7 traces again, at 7) and refuses a range the guard cuts, before any compile.
    gm = dynamo_graph(pairs, torch.randn(4, 3))
    with pytest.raises(sw.GuardViolation, match=r"size \{s\d+=7\} contradicts the trace's guard"):
        sw.Pipeline([sw.Concretize(sizes=[2, 4, 7]), sw.Lower(backend=backend)]).run(gm)
    fast = sw.compile(pairs, sizes=[2], ranges=[(4, 7)], backend=backend)
    with pytest.raises(sw.GuardViolation, match=r"range \{n=4\.\.7\} ends at the size \{n=7\}"):
        fast(torch.randn(4, 3))
    assert compiled == []


# -- 3. compile faults ------------------------------------------------------------------------


def test_regression_a_range_over_many_symbols_is_checked_guard_by_guard():
    # Found by the sweep: an encoder-decoder cache holds 24 tensors, each with a kv symbol of its
    # own in one decode range; the checks visited every corner of the box (2**24, and 6**24 for the
    # compile's guards), which ran bart's compile_generate out of memory. Each guard is now checked
    # at the corners of its own symbols.
    def f(xs):
        return sum(x.sum(0) for x in xs)

    xs = [torch.randn(5 + i, 3) for i in range(24)]
    fast = sw.compile(f, dynamic_dims={"xs": 0}, ranges=[(2, 64)], backend="aot_eager")
    assert_same(fast(xs), f(xs))
    assert len(fast.runnables[0].program.shapes.symbols) == 24


def test_a_first_trace_leaves_a_range_past_its_branch_to_another_trace():
    # deepseek_v4 reads tokens in chunks of 4: a trace at 5 guards n // 4 == 1 and serves 4..7; a
    # range 17..64 fails that guard at both ends, so it is another branch's, not a wrong range:
    # left out of this trace (a call in it traces again) instead of refusing the compile.
    def f(x):
        return x * 2 if x.shape[0] // 4 == 1 else x * 3

    fast = sw.compile(f, sizes=[5], ranges=[(17, 64)], backend="aot_eager")
    for n in (5, 33, 40):
        x = torch.randn(n, 3)
        assert_same(fast(x), f(x), f"n={n}")
    assert fast.traces == 2
