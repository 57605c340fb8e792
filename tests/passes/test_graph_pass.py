"""Graph and Inductor passes are passes: a stage of a Pipeline on their own, specs and registry
entries, a uuid with a hash of their source; a rewrite says whether it changed the graph."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch.fx import subgraph_rewriter

import shapewise as sw
from shapewise.passes import register_pass, source_hash
from tests.helpers import assert_same, dynamo_graph, graph_args


def _relu(x):
    return torch.relu(x)


def _sigmoid_gate(x):
    return x * (x > 0)


@dataclass(frozen=True)
class GateRelu(sw.GraphPass):
    """relu -> x * (x > 0), at every size."""

    name: ClassVar[str] = "gate_relu"

    def rewrite(self, gm, sizes):
        return sw.PassResult(gm, bool(subgraph_rewriter.replace_pattern(gm, _relu, _sigmoid_gate)))


@dataclass(frozen=True)
class Liar(sw.GraphPass):
    """Changes the graph and says it did not."""

    name: ClassVar[str] = "liar"

    def rewrite(self, gm, sizes):
        subgraph_rewriter.replace_pattern(gm, _relu, _sigmoid_gate)
        return sw.PassResult(gm, False)


def f(x):
    return torch.relu(x) * 2


def test_a_graph_pass_is_a_stage_of_a_pipeline_and_the_on_miss_variant_gets_it_too():
    gm = dynamo_graph(f, torch.randn(4, 3))
    runnable = sw.Pipeline([sw.Split(), sw.Concretize(sizes=[2, 4]), GateRelu(), sw.Lower(backend="eager"),
                            sw.BuildDispatch(on_miss="dynamic")]).run(gm)
    assert [r.spec for r in runnable.trace] == ["split", "analyze_shapes", "concretize{sizes=2,4}", "gate_relu",
                                                "lower{backend=eager}", "build_dispatch{on_miss=dynamic}"]
    program = runnable.trace[3].program
    assert program.rewrites == (GateRelu(),)
    for v in program.compute_pieces[0].variants:
        assert "relu" not in v.gm.code and v.passes == (GateRelu().uuid(),)
    for n in (2, 4, 7):  # 7: on_miss="dynamic" compiles a general variant, rewritten too
        x = torch.randn(n, 3)
        assert_same(runnable(*graph_args(gm, x))[0], f(x), f"n={n}")


_REWRITES: list[dict] = []


@dataclass(frozen=True)
class CountedGateRelu(GateRelu):
    """GateRelu that counts its rewrites; ``shared``: its rewrite_key says it never reads the sizes."""

    name: ClassVar[str] = "counted_gate_relu"
    shared: bool = False

    def rewrite_key(self, sizes):
        return "any" if self.shared else None

    def rewrite(self, gm, sizes):
        _REWRITES.append(dict(sizes))
        return super().rewrite(gm, sizes)


@pytest.mark.parametrize("shared", [False, True])
def test_variants_whose_rewrite_key_is_equal_are_rewritten_once_and_share_the_graph(shared):
    gm = dynamo_graph(f, torch.randn(4, 3))
    counted = CountedGateRelu(shared=shared)
    _REWRITES.clear()
    runnable = sw.Pipeline([sw.Split(), sw.Concretize(sizes=[2, 4, 8]), counted, sw.Lower(backend="eager")]).run(gm)
    variants = runnable.trace[3].program.compute_pieces[0].variants
    assert len(_REWRITES) == (1 if shared else 3) and len(variants) == 3
    assert len({id(v.gm) for v in variants}) == (1 if shared else 3)
    for v in variants:
        assert "relu" not in v.gm.code and v.passes == (counted.uuid(),)
    for n in (2, 4, 8):
        x = torch.randn(n, 3)
        assert_same(runnable(*graph_args(gm, x))[0], f(x), f"n={n}")


@dataclass(frozen=True)
class BadKey(GateRelu):
    name: ClassVar[str] = "bad_key"

    def rewrite_key(self, sizes):
        raise KeyError("seq")


def test_a_rewrite_key_that_raises_is_an_error_naming_the_pass_and_piece():
    gm = dynamo_graph(f, torch.randn(4, 3))
    with pytest.raises(sw.ShapewiseError, match=r"bad_key.*\.rewrite_key\(.*\) raised for .*KeyError"):
        sw.Pipeline([sw.Concretize(sizes=[2]), BadKey()])(gm)


def test_a_graph_pass_needs_concretize_and_runs_it_on_demand():
    gm = dynamo_graph(f, torch.randn(4, 3))
    out = sw.Pipeline([sw.Concretize(sizes=[2]), GateRelu()])(gm)
    assert "relu" not in out.compute_pieces[0].variants[0].gm.code
    alone = GateRelu()(gm)  # no bindings: concretize (with its defaults) first
    assert alone.bindings is not None


def test_a_rewrite_that_changes_the_graph_but_says_it_did_not_is_refused():
    gm = dynamo_graph(f, torch.randn(4, 3))
    with pytest.raises(sw.ShapewiseError, match="returned modified=False but changed the graph"):
        sw.Pipeline([sw.Concretize(sizes=[2]), Liar()])(gm)


def test_uuid_has_class_fields_version_and_a_hash_of_the_source():
    uuid = GateRelu().uuid()
    assert uuid.startswith(f"{__name__}.GateRelu:gate_relu@1#") and uuid.endswith(source_hash(GateRelu))
    assert source_hash(GateRelu) != source_hash(Liar)
    # The same class defined again with another body (as an edited file) gets another uuid.
    code = textwrap.dedent('''
        from dataclasses import dataclass
        from typing import ClassVar
        import shapewise as sw

        @dataclass(frozen=True)
        class P(sw.GraphPass):
            name: ClassVar[str] = "p"
            def rewrite(self, gm, sizes):
                return sw.PassResult(gm, BODY)
        print(P().uuid())
    ''')
    uuids = [subprocess.run([sys.executable, "-c", code.replace("BODY", body)], capture_output=True, text=True,
                            check=True).stdout.strip() for body in ("False", "False", "0 == 1")]
    assert uuids[0] == uuids[1] != uuids[2]  # deterministic across processes, and follows the source


def test_an_inductor_pass_called_on_a_graph_runs_its_rewrite_and_on_a_program_attaches_itself():
    seen = []

    @dataclass(frozen=True)
    class Count(sw.InductorPass):
        name: ClassVar[str] = "count"

        def rewrite(self, graph):
            seen.append(len(graph.nodes))

    gm = dynamo_graph(f, torch.randn(4, 3))
    Count()(gm.graph)
    assert seen == [len(gm.graph.nodes)]
    out = Count()(sw.Concretize(sizes=[2])(gm))
    assert out.compute_pieces[0].variants[0].inductor_passes == (Count(),)
    with pytest.raises(sw.ConfigError, match="an InductorPass goes in inductor_passes"):
        sw.Rewrite(passes=[Count()])


def test_a_pass_name_taken_by_another_class_is_refused():
    @dataclass(frozen=True)
    class Split(sw.Pass):
        name: ClassVar[str] = "split"

    with pytest.raises(sw.ConfigError, match="'split' .* is taken by shapewise.graph_split"):
        register_pass(Split)
