"""The pass framework: specs, immutability, on-demand stages, trace records, instruments, errors."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

import shapewise as sw
from shapewise.ir import format_graph
from shapewise.passes import parse_spec
from tests.helpers import dynamo_graph, symbolic_graph


def assert_graph(gm, expected: str) -> None:
    """Before/after helper: compare the canonical printout with an expected text."""
    assert format_graph(gm) == textwrap.dedent(expected).strip()


@pytest.mark.parametrize(
    "p",
    [
        sw.Concretize(sizes=(1, 8)),
        sw.Concretize(sizes=(2,), ranges=((3, 64), (65, 512))),
        sw.Split(ops=("sdpa", "shapewise_toy::attention")),
        sw.Lower(backend="aot_eager", static_options={"max_autotune": True}),
        sw.AnalyzeShapes(),
    ],
)
def test_specs_print_and_parse_back(p):
    spec = p.spec()
    assert parse_spec(spec) == p, spec


def test_spec_text():
    assert sw.Concretize(sizes=[1, 8]).spec() == "concretize{sizes=1,8}"
    assert sw.Split().spec() == "split"
    with pytest.raises(sw.ShapewiseError, match="unknown pass"):
        parse_spec("concretise{sizes=1}")


def test_three_pass_line_runs_as_written_and_keeps_every_stage():
    gm = symbolic_graph(lambda x: (x * 2).sum(-1), torch.randn(4, 3))
    runnable = sw.Pipeline([sw.Split(), sw.Concretize(sizes=[2, 4]), sw.Lower(backend="eager")]).run(gm)
    specs = [r.spec for r in runnable.trace]
    assert specs == ["split", "analyze_shapes", "concretize{sizes=2,4}", "lower{backend=eager}", "build_dispatch"]
    assert [r.on_demand for r in runnable.trace if r.spec == "analyze_shapes"] == [True]
    assert specs[-1] == "build_dispatch"
    programs = [r.program for r in runnable.trace]
    assert programs[0].shapes is None and programs[1].shapes is not None
    assert all(r.seconds >= 0 for r in runnable.trace)
    x = torch.randn(4, 3)
    torch.testing.assert_close(runnable(x), (x * 2).sum(-1))


def test_passes_never_mutate_their_input():
    gm = dynamo_graph(lambda x: x.relu() + 1, torch.randn(4, 3))
    p0 = sw.Program(gm=gm)
    p1 = sw.Split()(p0)
    p2 = sw.Concretize(sizes=[2])(p1)
    assert p0.graph is None and p1.bindings is None and p2.bindings is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        p2.bindings = None


def test_errors_name_the_pass_and_the_passes_before():
    gm = dynamo_graph(lambda x: x + 1, torch.randn(4, 3))
    with pytest.raises(sw.ConfigError) as err:  # a name only the graph can refuse (sizes <= 0 fail up front)
        sw.Pipeline([sw.Split(), sw.Concretize(sizes={"nope": [1]})]).run(gm)
    notes = "".join(err.value.__notes__)
    assert "concretize{sizes={'nope':[1]}}" in notes and "after split, analyze_shapes" in notes


def test_instruments_see_every_pass():
    gm = dynamo_graph(lambda x: x * 3, torch.randn(4, 3))
    printed: list[str] = []
    timing = sw.Timing()
    sw.Pipeline([sw.Concretize(sizes=[1]), sw.Lower(backend="eager")],
                instruments=[sw.PrintAfter(out=printed.append), timing]).run(gm)
    assert [s for s, _ in timing.rows] == ["split", "analyze_shapes", "concretize{sizes=1}", "lower{backend=eager}",
                                           "build_dispatch"]
    assert len(printed) == 5 and "# dispatch" in printed[-1]


def test_pipelines_nest():
    gm = dynamo_graph(lambda x: x - 1, torch.randn(4, 3))
    inner = sw.Pipeline([sw.Split(), sw.Concretize(sizes=[2])])
    runnable = sw.Pipeline([inner, sw.Lower(backend="eager")]).run(gm)
    assert [r.spec for r in runnable.trace][:3] == ["split", "analyze_shapes", "concretize{sizes=2}"]
    x = torch.randn(2, 3)
    torch.testing.assert_close(runnable(2, x)[0], x - 1)


def test_split_before_after():
    def f(x):
        a = torch.ops.shapewise_toy.attention(x, x, x)
        return a * 2

    gm = dynamo_graph(f, torch.randn(4, 2, 8))
    program = sw.Split(ops=["shapewise_toy::attention"])(gm)
    assert_graph(program.pieces[0].gm, """
        def forward(self, l_x_):
            a = torch.ops.shapewise_toy.attention(l_x_, l_x_, l_x_)
            return (a,)
    """)
    assert_graph(program.pieces[1].gm, """
        def forward(self, a):
            mul = a * 2
            return (mul,)
    """)
