"""AnalyzeShapes and Concretize: symbols, sources, guards, bindings, static example args."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import sympy
import torch

import shapewise as sw
from shapewise.concretize import make_bindings
from shapewise.ir.program import Program, SymbolSource, TensorMeta
from shapewise.models import MLP
from tests.helpers import column_major_after, dynamo_graph, symbolic_graph


def derived(x):
    y = torch.cat([x, x, x[:1]])  # 2*s + 1
    return y.view(-1, 2, x.shape[1]) if False else y * 2, x.view(-1, 2, x.shape[1]).sum(1)  # needs even s


def test_sources_for_symint_and_tensor_dims():
    gm = dynamo_graph(derived, torch.randn(6, 4))
    program = sw.AnalyzeShapes()(gm)
    shapes = program.shapes
    assert len(shapes.symbols) == 1
    (s,) = shapes.symbols
    # Dynamo passes the size as a SymInt argument.
    assert shapes.sources[s].kind == "int"
    assert shapes.hints[s] == 6


def test_symbolic_graph_reads_sizes_from_tensors():
    gm = symbolic_graph(lambda x, y: x.sum(0) + y, torch.randn(5, 3), torch.randn(3))
    shapes = sw.AnalyzeShapes()(gm).shapes
    s0, s1 = shapes.symbols
    assert shapes.sources[s0] == SymbolSource("size", 0, 0)
    assert shapes.sources[s1] == SymbolSource("size", 0, 1)


def test_guard_refuses_odd_size_before_compiling():
    gm = dynamo_graph(derived, torch.randn(6, 4))
    compiled = []

    def backend(g, args):
        compiled.append(g)
        return g.forward

    pipe = sw.Pipeline([sw.Concretize(sizes=[2, 4, 5]), sw.Lower(backend=backend)])
    with pytest.raises(sw.GuardViolation, match=r"size \{s\d+=5\} contradicts the trace's guard") as err:
        pipe.run(gm)
    assert "Mod" in str(err.value)
    assert compiled == []  # nothing compiled
    assert "concretize" in "".join(getattr(err.value, "__notes__", []))


def test_derived_and_strided_example_args():
    def f(x):
        y = torch.cat([x, x, x[:1]])  # [2s+1, 4]
        v = y.t()[:, 1::2]  # non-contiguous, offset 1, FloorDiv size
        a = torch.ops.shapewise_toy.attention(x[None], x[None], x[None])
        return v * 2, a

    gm = dynamo_graph(f, torch.randn(6, 4))
    program = sw.Concretize(sizes=[3, 8])(sw.Split(ops=["shapewise_toy::attention"])(gm))
    last = program.pieces[-1]
    for variant in last.variants:
        n = variant.binding.key[0]
        y = torch.cat([torch.randn(n, 4)] * 2 + [torch.randn(1, 4)])
        v = y.t()[:, 1::2]
        (arg,) = [a for a in variant.example_args if isinstance(a, torch.Tensor)]
        assert tuple(arg.shape) == tuple(v.shape)
        assert arg.stride() == v.stride()
        assert arg.storage_offset() == v.storage_offset()
        assert arg.untyped_storage().nbytes() // arg.element_size() == v.storage_offset() + 1 + sum(
            (s - 1) * st for s, st in zip(v.shape, v.stride()))


def _interleave_then_split(x):
    # At n=1 eager's reshape is a view with stride 0 (the trace, size-oblivious, shows a copy);
    # the piece after the split must be compiled for that layout, not the traced one.
    y = x.unsqueeze(1).expand(-1, 2, -1).reshape(-1, x.shape[1])
    return (y + torch.ops.shapewise_toy.attention(y.t()[None], y.t()[None], y.t()[None])[0].t()).reshape(1, -1)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_static_variant_takes_the_layout_eager_makes_at_its_size(backend):
    gm = dynamo_graph(_interleave_then_split, torch.randn(5, 6))
    runnable = sw.Pipeline([sw.Split(ops=["shapewise_toy::attention"]), sw.Concretize(sizes=[1, 2], ranges=[(3, 8)]),
                            sw.Lower(backend=backend)]).run(gm)
    last = runnable.program.pieces[-1]
    y_stride = {v.binding.key: [a.stride() for a in v.example_args if isinstance(a, torch.Tensor)]
                for v in last.variants if v.binding.is_static}
    assert (0, 1) in y_stride[(1,)] and (0, 1) not in y_stride[(2,)]
    printed = str(runnable.program)  # the printer names what differs from the trace
    assert "variant {s77=1}: compiled; eager's layout at this size: " in printed.replace(
        str(runnable.program.shapes.symbols[0]), "s77")
    assert "y stride=(0, 1) offset=0 (traced (6, 1) offset=0)" in printed
    for n in (1, 2, 3, 8):
        x = torch.randn(n, 6)
        torch.testing.assert_close(runnable(n, x), gm(n, x), msg=f"n={n}")


def test_observing_layouts_runs_no_piece_whose_outputs_only_the_program_returns(monkeypatch):
    # Only each piece's inputs are recorded: the last piece (a full graph's only one) is not run at
    # each size, and the layouts observed are as before (the stride-0 view at size 1 above).
    from shapewise.concretize import observe

    gm = dynamo_graph(_interleave_then_split, torch.randn(5, 6))
    split = sw.Pipeline([sw.Split(ops=["shapewise_toy::attention"])]).apply(Program(gm=gm))
    assert observe._unread_pieces(split.graph) == {split.pieces[-1].name}
    program = sw.Pipeline([sw.Split(ops=["shapewise_toy::attention"]), sw.AnalyzeShapes()]).apply(Program(gm=gm))
    last = program.pieces[-1]
    ran = []
    monkeypatch.setattr(last.gm, "forward", lambda *a: ran.append(a))
    binding = sw.Concretize(sizes=[1]).apply(program).pieces[0].variants[0].binding
    seen = observe.observed_inputs(program, binding)
    assert not ran and set(seen) == {p.name for p in program.pieces}
    assert any(isinstance(a, torch.Tensor) and a.stride() == (0, 1) for a in seen[last.name])
    full = sw.Pipeline([sw.Split(ops=[])]).apply(Program(gm=gm))
    assert observe._unread_pieces(full.graph) == {full.pieces[0].name}


def test_two_symbols_product_and_list_of_bindings():
    gm = dynamo_graph(lambda x: (x * 2).sum(1), torch.randn(3, 5), dims={0: [0, 1]})
    shapes = sw.AnalyzeShapes()(gm).shapes
    a, b = shapes.symbols
    by_product = make_bindings(shapes, {str(a): [1, 2], str(b): [16, 32]})
    assert [bd.key for bd in by_product] == [(1, 16), (1, 32), (2, 16), (2, 32)]
    listed = make_bindings(shapes, [{str(a): 4, str(b): 8}])
    assert listed[0].key == (4, 8)
    with pytest.raises(sw.BindingError, match="not a dynamic dim"):
        make_bindings(shapes, {"nope": [1]})


def test_plain_ints_bind_dim0_of_first_tensor_and_leave_others_at_trace_value():
    gm = symbolic_graph(lambda x, w: x @ w, torch.randn(5, 3), torch.randn(3, 7))
    shapes = sw.AnalyzeShapes()(gm).shapes
    (binding,) = make_bindings(shapes, [9])
    values = dict(binding.items)
    s0 = shapes.inputs[0].shape[0]
    assert values[s0] == 9
    assert sorted(v for s, v in values.items() if s != s0) == [3, 7]


def test_plain_ints_in_a_trace_dynamo_fixed_at_batch_one_serve_only_size_one():
    # torch.compile(dynamic=True) traces again at batch 1 with dim 0 specialised: the sizes
    # (meant for dim 0) must not bind the sequence, the trace's only symbol, instead.
    gm = dynamo_graph(lambda x: x.softmax(-1) * 2, torch.randn(1, 8), dims={0: [1]})
    shapes = sw.AnalyzeShapes()(gm).shapes
    (seq,) = shapes.symbols
    assert next(m for m in shapes.inputs if isinstance(m, TensorMeta)).shape[0] == 1
    assert [dict(b.items) for b in make_bindings(shapes, [1, 2, 4], [(5, 8)])] == [{seq: 8}]  # its traced value
    assert make_bindings(shapes, [2, 4], [(5, 8)]) == ()
    assert [dict(b.items) for b in make_bindings(shapes, [2], [(1, 4)])] == [{seq: 8}]


@pytest.mark.parametrize(
    "sizes, ranges, fragment",
    [
        ([0], (), "sizes must be >= 1"),
        ([2, 2], (), "more than once"),
        (["8"], (), "must be ints"),
        ((), [(10, 5)], "is empty"),
        ((), [(1, 10), (10, 20)], "overlap"),
        ((), [(1, 2, 3)], "a range is a"),
    ],
)
def test_bad_sizes_and_ranges(sizes, ranges, fragment):
    gm = dynamo_graph(lambda x: x * 2, torch.randn(4, 3))
    with pytest.raises(sw.ConfigError, match=fragment):
        sw.Concretize(sizes=sizes, ranges=ranges)(gm)


def test_range_variant_keeps_symbolic_args_in_a_fresh_shape_env():
    gm = dynamo_graph(lambda x: x * 2, torch.randn(4, 3))
    program = sw.Concretize(sizes=[2], ranges=[(3, 100)])(gm)
    static, ranged = program.pieces[0].variants
    (t,) = [a for a in static.example_args if isinstance(a, torch.Tensor)]
    assert isinstance(t.shape[0], int)
    (r,) = [a for a in ranged.example_args if isinstance(a, torch.Tensor)]
    assert isinstance(r.shape[0], torch.SymInt)
    env = r.shape[0].node.shape_env
    (sym,) = r.shape[0].node.expr.free_symbols
    assert (int(env.var_to_range[sym].lower), int(env.var_to_range[sym].upper)) == (3, 100)
    trace_env = next(n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"
                     and isinstance(n.meta["example_value"], torch.SymInt)).node.shape_env
    assert env is not trace_env


def test_tensor_meta_records_layout():
    gm = symbolic_graph(lambda x: x + 1, torch.randn(4, 6)[:, ::2])
    (meta,) = sw.AnalyzeShapes()(gm).shapes.inputs
    assert isinstance(meta, TensorMeta)
    assert all(isinstance(e, sympy.Basic) for e in meta.shape + meta.stride)


def test_guard_location_gets_back_the_letter_torch_cuts(tmp_path):
    from shapewise._compat.shapes import _repair_location

    f = tmp_path / "model.py"
    f.write_text("x = 1\n")
    cut = str(f)[2:]  # what torch prints for a file outside its folder: "/tmp/..." -> "mp/..."
    assert _repair_location(f"y = x.view(-1, 2)  # {cut}:3 in forward") == f"y = x.view(-1, 2)  # {f}:3 in forward"
    assert _repair_location("y  # nowhere/such.py:3 in f") == "y  # nowhere/such.py:3 in f"


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_static_variant_layout_where_the_trace_left_the_order_undecided(backend):
    gm = dynamo_graph(column_major_after, torch.randn(7, 5))
    # Over the range (3, 7) the range variant knows 3 <= n and makes z column-major too: the
    # next piece's range variant must be compiled for that, not for the trace's row-major.
    runnable = sw.Pipeline([sw.Split(ops=["shapewise_toy::attention"]), sw.Concretize(sizes=[2, 8], ranges=[(3, 7)]),
                            sw.Lower(backend=backend)]).run(gm)
    for n in (8, 2, 3, 5, 7):
        x = torch.randn(n, 5)
        torch.testing.assert_close(runnable(n, x), gm(n, x), msg=f"n={n}")


def _reshape_twice(x):
    return x.view(-1, x.shape[-1]).view(x.shape[0], x.shape[1]) * 2


def test_a_range_binding_with_one_dim_pinned_compiles():
    # The compile's own symbol (the view's -1) added a divisibility guard over it: no corner of
    # the range can decide such a guard, and it was reported as a broken assumption.
    fast = sw.compile(_reshape_twice, dynamic_dims={"x": {0: "batch", 1: "seq"}},
                      ranges=[{"batch": (5, 8), "seq": 8}], backend="aot_eager")
    for b in (5, 6, 8):
        x = torch.randn(b, 8)
        assert torch.equal(fast(x), _reshape_twice(x))


def test_sizes_and_ranges_are_parsed_once_into_three_forms():
    from shapewise.concretize.bindings import parse_ranges, parse_sizes

    assert parse_sizes([1, 8]) == ("primary", [1, 8])
    assert parse_sizes(4) == ("primary", [4])
    assert parse_sizes({"batch": [1, 2], "seq": 8}) == ("product", {"batch": [1, 2], "seq": [8]})
    assert parse_sizes([{"batch": 1, "seq": 8}]) == ("list", [{"batch": 1, "seq": 8}])
    assert parse_ranges([(9, 64)]) == ("primary", [(9, 64)])
    # One pair under a name is one range, however it is spelled ([17, 64] or (17, 64)).
    assert parse_ranges({"seq": [17, 64]}) == parse_ranges({"seq": (17, 64)}) == ("product", {"seq": [(17, 64)]})
    assert parse_ranges([{"batch": 2, "seq": (9, 64)}]) == ("list", [{"batch": 2, "seq": (9, 64)}])
    with pytest.raises(sw.ConfigError, match=r"did you mean ranges=\[\(9, 64\)\]"):
        parse_ranges((9, 64))
    with pytest.raises(sw.ConfigError, match="not a dynamic dim.*did you mean 'seq'"):
        parse_sizes({"sq": [1]}, names={"seq", "batch"})


@pytest.mark.parametrize("by_name", [True, False, "plain sympy"])
def test_symbol_names_are_keyed_by_a_symbol_or_by_its_name(by_name):
    # Program.symbol_names takes {symbol or its name: dim name}; a name (a str) was kept as it
    # was, so every reader (looking up by Symbol) missed it: the dispatch showed {s77=2} and a
    # graph pass saw {'s77': 2}.
    gm = dynamo_graph(MLP(), torch.randn(4, 32))
    (s,) = sw.AnalyzeShapes()(gm).shapes.symbols
    seen = []

    @dataclass(frozen=True)
    class Spy(sw.GraphPass):
        name: ClassVar[str] = "spy"

        def applies(self, sizes):
            seen.append(dict(sizes))
            return False

    key = {True: str(s), False: s, "plain sympy": sympy.Symbol(str(s))}[by_name]  # the last lacks torch's assumptions
    program = sw.Program(gm=gm, symbol_names={key: "n"})
    runnable = sw.Pipeline([sw.Split(), sw.Concretize(sizes=[{"n": 2}]), sw.Rewrite(passes=[Spy()]),
                            sw.Lower(backend="eager")]).run(program)
    assert runnable.program.shapes.names == {s: "n"}
    assert all(p.shapes.names == {s: "n"} for p in runnable.program.pieces if s in p.shapes.symbols)
    assert [r["key"] for r in runnable.report()] == ["{n=2}"]
    assert seen == [{"n": 2}]


def test_symbol_names_that_name_no_symbol_of_the_graph_are_refused():
    gm = dynamo_graph(MLP(), torch.randn(4, 32))
    (s,) = sw.AnalyzeShapes()(gm).shapes.symbols
    with pytest.raises(sw.ConfigError, match=rf"names 's999999' \(as 'n'\).*its symbols: {s}\n"):
        sw.AnalyzeShapes()(sw.Program(gm=gm, symbol_names={"s999999": "n"}))
