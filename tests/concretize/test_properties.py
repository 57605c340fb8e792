"""Property tests of concretisation against two oracles: Python's own integer arithmetic
(for sympy expressions with torch's FloorDiv, CeilDiv, Mod, Max, Min over several symbols)
and real tensors (for the layout of every piece input, derived, non-contiguous, offset)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import shapewise as sw
from shapewise.ir import evaluate
from shapewise.ir.runner import make_runner
from tests.helpers import assert_same, dynamo_graph
from tests.strategies import SYMS, _exprs, to_sympy


def oracle(tree, values):
    kind = tree[0]
    if kind == "sym":
        return values[tree[1]]
    if kind == "const":
        return tree[1]
    a = oracle(tree[1], values)
    if kind == "floordiv":
        return a // tree[2]
    if kind == "ceildiv":
        return -(-a // tree[2])
    if kind == "mod":
        return a % tree[2]
    b = oracle(tree[2], values)
    return {"add": a + b, "mul": a * b, "max": max(a, b), "min": min(a, b)}[kind]


@settings(max_examples=300, deadline=None, print_blob=True)
@given(tree=_exprs(), values=st.tuples(*[st.integers(1, 10**6)] * 3))
def test_evaluate_matches_python_integer_arithmetic(tree, values):
    expr = to_sympy(tree)
    note(f"expr = {expr}, values = {values}")
    assert evaluate(expr, dict(zip(SYMS, values))) == oracle(tree, values)


# --- layouts against real tensors ---------------------------------------------------------

VIEW_OPS = {
    "cat2p1": lambda y: torch.cat([y, y, y[:1]]),             # 2*s + 1 rows
    "step2": lambda y: y[1::2],                                # FloorDiv rows, doubled stride, offset
    "step3": lambda y: y[::3],                                 # CeilDiv rows
    "transpose": lambda y: y.t(),                              # non-contiguous
    "narrow": lambda y: y[:, 1:],                              # storage offset
    "pad": lambda y: F.pad(y, (0, 0, 2, 1)),                   # s + 3 rows
    "double": lambda y: y.repeat(2, 1),                        # 2*s rows
}


def make_fn(recipe):
    def fn(x):
        y = x
        for op in recipe:
            y = VIEW_OPS[op](y)
        a = torch.ops.shapewise_toy.attention(x[:, None], x[:, None], x[:, None])  # the split point
        return (y * 3).sum(0), a.sum(), y
    return fn


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
@given(recipe=st.lists(st.sampled_from(sorted(VIEW_OPS)), min_size=1, max_size=4),
       sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3, unique=True))
def test_concretised_layouts_equal_real_tensors(recipe, sizes):
    fn = make_fn(recipe)
    note(f"recipe={recipe} sizes={sizes}")
    gm = dynamo_graph(fn, torch.randn(7, 5))
    try:
        program = sw.Concretize(sizes=sizes)(sw.Split(ops=["shapewise_toy::attention"])(gm))
    except sw.GuardViolation:
        return  # the recipe needs sizes the draw did not give; refusing is the right answer
    for binding in program.bindings:
        (n,) = binding.key
        x = torch.randn(n, 5)
        seen = {}

        def capture(name, piece_fn):
            def run(*args):
                seen[name] = args
                return piece_fn(*args)
            return run

        runner = make_runner(program.graph, {p.name: capture(p.name, p.gm.forward) for p in program.pieces})
        args = [n if isinstance(v, torch.SymInt) else x for v in
                (node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder")]
        assert_same(runner(*args), fn(x), f"recipe {recipe} at {n}")
        for piece in program.compute_pieces:
            variant = piece.variant_for(binding)
            for real, fake in zip(seen[piece.name], variant.example_args):
                if isinstance(real, torch.Tensor):
                    if any(isinstance(d, torch.SymInt) for d in (*fake.shape, *fake.stride())):
                        # A data-dependent size (unbacked symbol: torch 2.11 makes some for step
                        # slices) stays symbolic by design; the variant then compiles with symbolic args.
                        bound = dict(variant.binding.items)
                        assert any(s not in bound for s in piece.shapes.symbols), (piece.name, n, fake.shape)
                        continue
                    assert tuple(fake.shape) == tuple(real.shape), (piece.name, n)
                    # A size-1 dim's stride never addresses memory: only the others must agree.
                    strides = [(a, b) for a, b, size in zip(fake.stride(), real.stride(), real.shape) if size > 1]
                    assert all(a == b for a, b in strides), (piece.name, n, fake.stride(), real.stride())
                    assert fake.storage_offset() == real.storage_offset(), (piece.name, n)
                else:
                    assert fake == real, (piece.name, n)
