"""Split: where pieces start and end, and that split-then-stitch computes what the graph did."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import shapewise as sw
from shapewise.graph_split import plan_split, resolve_ops
from shapewise.ir.runner import make_runner
from shapewise.models import ATTENTION_OP, ATTENTION_OUT_OP, ToyTransformer
from tests.helpers import assert_before_after, assert_same, dynamo_graph, symbolic_graph


def run_stitched(program, *args):
    """Run the stitching graph with each piece's own (uncompiled) graph: no compile at all."""
    return make_runner(program.graph, {p.name: p.gm.forward for p in program.pieces})(*args)


def attn(q, k, v):
    return torch.ops.shapewise_toy.attention(q, k, v)


def two_attention(x, w):
    h = x @ w
    q = h.view(h.shape[0], 2, -1)
    a = attn(q, q, q)
    b = attn(a, a, q)  # consecutive splitting ops: one piece
    return (b.reshape(x.shape[0], -1) + h).relu()


def test_split_before_and_after_as_printed():
    # The split program as the canonical printer shows it: the op gets a piece of its own that
    # runs as is, the stitching graph calls the pieces in order and unpacks their outputs.
    gm = symbolic_graph(lambda x: torch.ops.shapewise_toy.attention(x * 2, x, x) + 1, torch.randn(2, 4, 8))
    assert_before_after(sw.Split(ops=[ATTENTION_OP]), gm, before="""
        # graph
        def forward(self, x_1):
            mul = torch.ops.aten.mul.Tensor(x_1, 2)
            attention = torch.ops.shapewise_toy.attention.default(mul, x_1, x_1)
            add = torch.ops.aten.add.Tensor(attention, 1)
            return add
        """, after="""
        # stitching graph
        def forward(self, x_1):
            piece_0 = self.piece_0(x_1)
            mul = piece_0[0]
            piece_1 = self.piece_1(mul, x_1)
            attention = piece_1[0]
            piece_2 = self.piece_2(attention)
            add = piece_2[0]
            return add
        # piece_0
        def forward(self, x_1):
            mul = torch.ops.aten.mul.Tensor(x_1, 2)
            return (mul,)
        # piece_1 [splitting op, runs as is]
        def forward(self, mul, x_1):
            attention = torch.ops.shapewise_toy.attention.default(mul, x_1, x_1)
            return (attention,)
        # piece_2
        def forward(self, attention):
            add = torch.ops.aten.add.Tensor(attention, 1)
            return (add,)
        """)


def test_custom_op_splits_and_consecutive_ops_share_a_piece():
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    gm = dynamo_graph(two_attention, x, w)
    program = sw.Split(ops=[ATTENTION_OP])(gm)
    kinds = [p.is_splitting for p in program.pieces]
    assert kinds == [False, True, False]
    split_piece = program.pieces[1]
    targets = [n.target for n in split_piece.gm.graph.nodes if n.op == "call_function"]
    assert len(targets) == 2
    for n in (1, 6, 9):
        xx = torch.randn(n, 8)
        assert_same(run_stitched(program, *_dynamo_args(gm, xx, w)), (two_attention(xx, w),))


def _dynamo_args(gm, *tensors):
    """Arguments in the Dynamo graph's placeholder order: SymInts from the tensors' dim 0."""
    out, it = [], iter(tensors)
    pending = None
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta["example_value"]
        if isinstance(val, torch.SymInt):
            pending = "sym"
            out.append(None)
        else:
            t = next(it)
            if pending == "sym":
                out[-1] = t.shape[0]
                pending = None
            out.append(t)
    return out


@pytest.mark.parametrize("spelling", [ATTENTION_OP, ATTENTION_OP + ".default",
                                      torch.ops.shapewise_toy.attention, torch.ops.shapewise_toy.attention.default])
def test_op_spellings_match_at_dynamo_and_aten_level(spelling):
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    for gm in (dynamo_graph(two_attention, x, w), symbolic_graph(two_attention, x, w)):
        program = sw.Split(ops=[spelling])(gm)
        assert [p.is_splitting for p in program.pieces] == [False, True, False]


def test_sdpa_alias_at_dynamo_level():
    def f(x):
        q = x.view(1, x.shape[0], 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(x.shape[0], 8) * 2

    x = torch.randn(5, 8)
    gm = dynamo_graph(f, x)
    program = sw.Split(ops=["sdpa"])(gm)
    assert [p.is_splitting for p in program.pieces] == [False, True, False]
    for n in (1, 3, 7):
        xx = torch.randn(n, 8)
        assert_same(run_stitched(program, *_dynamo_args(gm, xx)), (f(xx),))


def test_sdpa_alias_at_aten_level():
    def f(x):
        q = x.view(1, x.shape[0], 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(x.shape[0], 8) * 2

    from torch._decomp import core_aten_decompositions  # noqa: F401 - aten graph without decomposing sdpa
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f, tracing_mode="symbolic", pre_dispatch=True)(torch.randn(5, 8))
    matcher = resolve_ops(["sdpa"])[0]
    assert any(matcher(n) for n in gm.graph.nodes), gm.code
    program = sw.Split(ops=["sdpa"])(gm)
    assert sum(p.is_splitting for p in program.pieces) == 1


def test_getitem_stays_with_its_producer():
    def f(x):
        a, b = torch.ops.shapewise_toy.attention(x, x, x).chunk(2, dim=-1)  # getitem of a compute op
        return a * b

    gm = dynamo_graph(f, torch.randn(4, 2, 8))
    plan = plan_split(gm, resolve_ops([ATTENTION_OP]))
    nodes = {n.name: n for n in gm.graph.nodes}
    where = dict(plan.assignment)
    for name, node in nodes.items():
        if node.op == "call_function" and node.target is operator.getitem:
            assert where[name] == where[node.args[0].name]


def test_mutating_op_and_allocation_merge():
    """vLLM-style attention writing into a preallocated buffer: the buffer is allocated in the
    compute piece before it; an allocation-only piece between splitting ops joins them."""

    def f(x):
        q = x.view(x.shape[0], 2, 4)
        out1 = torch.empty_like(q)
        torch.ops.shapewise_toy.attention_out(q, q, q, out1)
        out2 = torch.empty_like(q)  # only an allocation between two splitting ops
        torch.ops.shapewise_toy.attention_out(out1, out1, q, out2)
        return out2.reshape(x.shape[0], 8) + 1

    x = torch.randn(5, 8)
    gm = dynamo_graph(f, x)
    program = sw.Split(ops=[ATTENTION_OUT_OP])(gm)
    assert [p.is_splitting for p in program.pieces] == [False, True, False]
    for n in (1, 5, 11):
        xx = torch.randn(n, 8)
        assert_same(run_stitched(program, *_dynamo_args(gm, xx)), (f(xx),))


def test_size_tuple_crossing_a_boundary_is_decomposed():
    def f(x):
        size = x.size()
        a = torch.ops.shapewise_toy.attention(x, x, x)
        return a.reshape(size) + a.new_zeros(size), size[0]

    x = torch.randn(6, 2, 4)
    gm = dynamo_graph(f, x)
    program = sw.Split(ops=[ATTENTION_OP])(gm)
    for p in program.pieces:
        for node in p.gm.graph.nodes:
            assert not (node.op == "call_method" and node.target == "size" and len(node.args) == 1), node.format_node()
    for n in (1, 3, 6):
        xx = torch.randn(n, 2, 4)
        got = run_stitched(program, *_dynamo_args(gm, xx))
        ref = f(xx)
        assert_same(got[0], ref[0])


def test_no_splitting_ops_gives_one_piece():
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    gm = dynamo_graph(two_attention, x, w)
    program = sw.Split()(gm)
    assert len(program.pieces) == 1 and not program.pieces[0].is_splitting


def test_toy_transformer_pieces_alternate():
    model = ToyTransformer(layers=3)
    gm = dynamo_graph(model, torch.randint(0, 64, (7,)))
    program = sw.Split(ops=[ATTENTION_OP])(gm)
    assert [p.is_splitting for p in program.pieces] == [False, True] * 3 + [False]
    names = [p.name for p in program.pieces]
    assert names == [f"piece_{i}" for i in range(7)]


def test_split_does_not_mutate_its_input():
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    gm = dynamo_graph(two_attention, x, w)
    before = gm.code
    program = sw.Program(gm=gm)
    out = sw.Split(ops=[ATTENTION_OP])(program)
    assert gm.code == before and program.graph is None and out is not program


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("shapewise_toy::atention", "closest registered names"),
        ("shapewise_toy::attention.nope", "has overloads"),
        ("sdap", "did you mean"),
        (42, "cannot use 42"),
    ],
)
def test_unknown_splitting_ops_fail_early_with_close_names(bad, fragment):
    with pytest.raises(sw.ConfigError, match=fragment):
        sw.Split(ops=[bad])


def test_python_callable_and_predicate_ops():
    from shapewise.graph_split import OpMatcher

    def f(x):
        return torch.relu(x * 2) + 1

    gm = dynamo_graph(f, torch.randn(4, 3))
    program = sw.Split(ops=[torch.relu])(gm)
    assert [p.is_splitting for p in program.pieces] == [False, True, False]
    by_predicate = OpMatcher("add", lambda n: n.target is operator.add)
    program = sw.Split(ops=[by_predicate])(gm)
    assert [p.is_splitting for p in program.pieces] == [False, True]
