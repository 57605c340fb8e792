"""The pass framework: specs, immutability, on-demand stages, trace records, instruments, errors."""

from __future__ import annotations

import dataclasses
import textwrap
import time

import pytest
import torch

import shapewise as sw
from shapewise.ir import format_graph
from shapewise.passes import parse_spec
from tests.helpers import dynamo_graph, symbolic_graph


def assert_graph(gm, expected: str) -> None:
    """Before/after helper: compare the canonical printout with an expected text."""
    assert format_graph(gm) == textwrap.dedent(expected).strip()


# Every registered pass of the package with options off their defaults, and each default: the
# round trip below covers the registry, and fails for a registered pass missing here.
CUDAGRAPHS = sw.passes.registered_passes()["cudagraphs"]  # by its spec name: the dispatch's modules may move
EXAMPLES = {
    "pipeline": [sw.Pipeline([sw.Split(ops=("sdpa",)), sw.Pipeline([sw.Concretize(sizes=(1, 8))]),
                              sw.Lower(backend="eager")])],
    "split": [sw.Split(ops=("sdpa", "shapewise_toy::attention")), sw.Split(ops=("sdpa",))],
    "analyze_shapes": [sw.AnalyzeShapes()],
    "concretize": [sw.Concretize(sizes=(1, 8)), sw.Concretize(sizes=(2,), ranges=((3, 64), (65, 512))),
                   sw.Concretize(sizes={"batch": [1, 2], "seq": [128]}, refused="skip-sizes", fixed={"seq": 1})],
    "rewrite": [sw.Rewrite(passes=[sw.library.DecodeGemv(max_tokens=4, devices=("cpu",)),
                                   sw.library.OverlapAllReduce(chunks=2)])],
    "lower": [sw.Lower(backend="aot_eager", static_options={"max_autotune": True}),
              sw.Lower(backend="eager", compile="lazy", cache="/tmp/a folder", dedupe=False, progress=False,
                       lean=False, on_compile_error="fallback", options={"a": 1, "b": "x y"})],
    "build_dispatch": [sw.BuildDispatch(on_miss="eager")],
    "cudagraphs": [CUDAGRAPHS(capture_sizes=(1, 8), mode="full", pad=True, full_up_to=16,
                            capture="startup", split_pools=False, copy_outputs=False),
                   CUDAGRAPHS(capture_sizes=(4,))],
    "decode_gemv": [sw.library.DecodeGemv(max_tokens=8, devices=("cpu", "cuda"), dtypes=("float32",))],
    "overlap_all_reduce": [sw.library.OverlapAllReduce(chunks=2, min_tokens=64, align=16, min_slice=16)],
    "fuse_projections": [sw.library.FuseProjections(max_tokens=16)],
    "grouped_decode_attention": [sw.library.GroupedDecodeAttention()],
    "batch_input_updates": [sw.library.BatchInputUpdates()],
}


def test_every_registered_pass_prints_a_spec_that_parses_back_to_an_equal_pass():
    ours = {name: cls for name, cls in sw.passes.registered_passes().items() if cls.__module__.startswith("shapewise.")}
    assert sorted(ours) == sorted(EXAMPLES), "a registered pass without an example here (or an example of none)"
    for name, cls in ours.items():
        for p in [cls(), *EXAMPLES[name]]:
            assert type(p) is cls
            spec = p.spec()
            assert parse_spec(spec) == p, spec
            assert parse_spec(spec).spec() == spec
    nested = EXAMPLES["pipeline"][0].spec()
    assert nested == "pipeline{split{ops=sdpa},pipeline{concretize{sizes=1,8}},lower{backend=eager}}"
    assert parse_spec(nested).passes[1] == sw.Pipeline([sw.Concretize(sizes=(1, 8))])


def test_spec_fields_are_read_by_their_types():
    assert parse_spec("decode_gemv{devices=cpu}").devices == ("cpu",)  # tuple[str, ...]: one name, a tuple
    # str: quoted where it reads as a literal
    from shapewise.passes.spec import format_value, parse_value

    assert format_value("1") == "'1'" and parse_value("'1'", str, parse_spec, lambda t: False) == "1"
    with pytest.raises(sw.ConfigError, match="max_tokens: 'four' is not an int"):
        parse_spec("decode_gemv{max_tokens=four}")
    with pytest.raises(sw.ConfigError, match="has no option 'size'"):
        parse_spec("concretize{size=1}")
    with pytest.raises(sw.ConfigError, match="not key=value"):
        parse_spec("concretize{sizes}")


def test_spec_text():
    assert sw.Concretize(sizes=[1, 8]).spec() == "concretize{sizes=1,8}"
    assert sw.Split().spec() == "split"
    with pytest.raises(sw.ShapewiseError, match="unknown pass"):
        parse_spec("concretise{sizes=1}")


def test_three_pass_line_runs_as_written_and_keeps_every_stage():
    gm = symbolic_graph(lambda x: (x * 2).sum(-1), torch.randn(4, 3))
    t0 = time.perf_counter()
    runnable = sw.Pipeline([sw.Split(), sw.Concretize(sizes=[2, 4]), sw.Lower(backend="eager")]).run(gm)
    wall = time.perf_counter() - t0
    specs = [r.spec for r in runnable.trace]
    assert specs == ["split", "analyze_shapes", "concretize{sizes=2,4}", "lower{backend=eager}", "build_dispatch"]
    assert [r.on_demand for r in runnable.trace if r.spec == "analyze_shapes"] == [True]
    assert specs[-1] == "build_dispatch"
    programs = [r.program for r in runnable.trace]
    assert programs[0].shapes is None and programs[1].shapes is not None
    assert all(r.seconds > 0 for r in runnable.trace) and sum(r.seconds for r in runnable.trace) <= wall
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
