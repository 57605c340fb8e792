"""The IR on its own: symbolic helpers against Python arithmetic, ``TensorMeta.at`` against real
tensors, ``Binding`` corners and names, ``Program.callables``, the stitched runner's source,
and the renderer registry (the IR shows itself through what the layers above register)."""

from __future__ import annotations

import itertools

import sympy
import torch

import shapewise as sw
from shapewise._compat import FloorDiv
from shapewise.ir import INT_MAX, Binding, Program, TensorMeta, evaluate, make_runner, range_hint, range_text
from shapewise.ir.program import RENDERERS
from shapewise.models import ATTENTION_OP
from tests.helpers import dynamo_graph, graph_args

n, m = sympy.symbols("n m", integer=True, positive=True)


def test_range_text_prints_open_ends_as_inf():
    assert range_text(2, None) == "[2, inf]"
    assert range_text(65, INT_MAX) == "[65, inf]"
    assert range_text(6, 9, "..", "") == "6..9"
    assert range_text(None, 3) == "[None, 3]"


def test_range_hint_stays_inside_the_range_and_off_zero_and_one():
    for lo, hi in [(0, 1), (0, 5), (1, 2), (17, 64), (65, INT_MAX), (3, 3)]:
        for traced in (None, 0, 1, 2, lo, hi, 10_000):
            h = range_hint(lo, hi, traced)
            assert lo <= h <= hi, (lo, hi, traced, h)
            assert h >= 2 or hi < 2, (lo, hi, traced, h)
            if traced is not None and lo <= traced <= hi and traced >= 2:
                assert h == traced


def test_tensor_meta_at_matches_a_real_view():
    # x[:, 1::2] of an [n, 2m] tensor: shape [n, m], strides (2m, 2), offset 1.
    meta = TensorMeta(shape=(n, m), stride=(2 * m, sympy.Integer(2)), offset=sympy.Integer(1),
                      dtype=torch.float32, device=torch.device("cpu"))
    for nv, mv in itertools.product([1, 3], [2, 5]):
        real = torch.empty(nv, 2 * mv)[:, 1::2]
        assert meta.at({n: nv, m: mv}) == (tuple(real.shape), real.stride(), real.storage_offset())
    assert evaluate(FloorDiv(n + 1, 2), {n: 6}) == 3


def test_binding_corners_and_description():
    b = Binding.of({n: (2, 8), m: 4})
    assert b.corners() == [{n: 2, m: 4}, {n: 8, m: 4}]
    assert Binding.of({n: 3}).corners() == [{n: 3}]
    assert b.describe({n: "seq", m: "batch"}) == "{seq=2..8, batch=4}"
    assert Binding.of({n: (65, INT_MAX)}).describe({n: "seq"}) == "{seq=65..inf}"
    # Two symbols of one name print once when their values agree, told apart when not.
    assert Binding.of({n: 2, m: 2}).describe({n: "batch", m: "batch"}) == "{batch=2}"
    assert Binding.of({n: 2, m: 3}).describe({n: "batch", m: "batch"}) == "{batch[n]=2, batch[m]=3}"


def _split_program(sizes=(2, 4)):
    def f(x):
        y = torch.ops.shapewise_toy.attention(x[None], x[None], x[None])[0]
        return (y * 2).relu()

    gm = dynamo_graph(f, torch.randn(4, 8))
    return sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(sizes=list(sizes)), sw.Lower(backend="eager")]) \
        .run(gm).program


def test_callables_are_the_variants_the_splitting_calls_or_the_pieces_own_forward():
    program = _split_program()
    binding = program.bindings[0]
    got = program.callables(binding)
    for p in program.pieces:
        v = None if p.is_splitting else p.variant_for(binding)
        assert got[p.name] == (v.compiled if v is not None else p.call or p.gm.forward)
    assert all(fn == (p.call or p.gm.forward) for p, fn in zip(program.pieces, program.callables(None).values()))
    assert [p.call is not None for p in program.pieces] == [False, True, False], "the custom op's piece runs direct"


def test_the_stitched_runner_keeps_its_source_and_frees_intermediates():
    program = _split_program()
    run = make_runner(program.graph, program.callables(program.bindings[0]))
    src = run.__source__
    assert src.startswith("def run(") and "_piece_0(" in src and "del " in src
    x = torch.randn(2, 8)
    out = run(*graph_args(program.gm, x))
    expected = (torch.ops.shapewise_toy.attention(x[None], x[None], x[None])[0] * 2).relu()
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, expected)


def test_the_ir_shows_itself_through_registered_renderers():
    program = _split_program()
    # The printer (ir) registers text; shapewise.display registers HTML and PNG.
    assert ("Program", "text") in RENDERERS and ("Program", "html") in RENDERERS
    assert str(program).startswith("// program") or "piece_0" in str(program)
    html = program._repr_html_()
    assert html.startswith("<div>") and "pieces" in html
    saved = dict(RENDERERS)
    try:
        RENDERERS.clear()
        bare = Program(gm=program.gm)
        assert str(bare) == repr(bare) and bare._repr_html_() is None
    finally:
        RENDERERS.update(saved)


def test_augmented_assignment_counts_as_a_write():
    from shapewise.ir.effects import mutated_inputs

    def f(x, buf):
        buf += x.sum(0)  # Dynamo records operator.iadd
        return x * 2

    gm = dynamo_graph(f, torch.randn(4, 3), torch.zeros(3))
    written = mutated_inputs(gm)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert [names[i] for i in written] == [n for n in names if "buf" in n]
