"""DispatchTable and Runnable: exact sizes win, ranges by bisect, misses are explicit."""

from __future__ import annotations

import pytest
import sympy
import torch

import shapewise as sw
from shapewise.dispatch import DispatchTable
from shapewise.ir.program import Binding, SymbolSource
from tests.helpers import assert_same, dynamo_graph

A, B = sympy.symbols("a b", integer=True, positive=True)


def table(exact, ranges, on_miss="error", miss_runner=None, symbols=(A,)):
    sources = [SymbolSource("size", 0, i) for i in range(len(symbols))]
    return DispatchTable(symbols, sources, exact, ranges, {A: "n", B: "m"}, on_miss, miss_runner)


def test_exact_wins_over_range_and_ranges_bisect():
    t = table({(8,): "exact8"}, [(Binding.of({A: (1, 16)}), "r1"), (Binding.of({A: (17, 512)}), "r2")])
    assert t.resolve((8,)) == "exact8"
    assert t.resolve((1,)) == "r1" and t.resolve((16,)) == "r1"
    assert t.resolve((17,)) == "r2" and t.resolve((512,)) == "r2"
    with pytest.raises(sw.DispatchMiss, match=r"no compiled variant for size \{n=513\}.*\{n=8\}.*\{n=1\.\.16\}"):
        t.resolve((513,))


def test_range_hits_are_memoised_into_the_exact_dict():
    t = table({}, [(Binding.of({A: (1, 100)}), "r")])
    assert (50,) not in t.exact
    t.resolve((50,))
    assert t.exact[(50,)] == "r"


def test_two_symbol_boxes():
    t = table({(1, 128): "e"}, [
        (Binding.of({A: (1, 4), B: (1, 256)}), "small"),
        (Binding.of({A: (5, 64), B: 512}), "wide"),
    ], symbols=(A, B))
    assert t.resolve((1, 128)) == "e"
    assert t.resolve((3, 200)) == "small"
    assert t.resolve((64, 512)) == "wide"
    for miss in ((5, 511), (65, 512), (4, 257)):
        with pytest.raises(sw.DispatchMiss):
            t.resolve(miss)


def test_overlapping_boxes_are_refused():
    with pytest.raises(sw.ConfigError, match="overlaps"):
        table({}, [(Binding.of({A: (1, 10)}), "x"), (Binding.of({A: (5, 20)}), "y")])


def test_miss_policies_on_a_runnable():
    gm = dynamo_graph(lambda x: (x * 2).relu(), torch.randn(4, 3))
    pipe = sw.Pipeline([sw.Concretize(sizes=[2, 4]), sw.Lower(backend="eager")])
    runnable = pipe.run(gm)
    n_args = lambda n: [n, torch.randn(n, 3)]  # noqa: E731 - Dynamo order: SymInt, tensor
    with pytest.raises(sw.DispatchMiss, match=r"size \{s\d+=3\}.*compiled sizes: \{s\d+=2\}, \{s\d+=4\}; ranges: none"):
        runnable(*n_args(3))
    for policy in ("eager", "dynamic"):
        program = runnable.program.replace(on_miss=policy)
        r = sw.Pipeline([sw.BuildDispatch()]).run(program)
        args = n_args(3)
        assert_same(r(*args), ((args[1] * 2).relu(),))
        rows = r.report()
        assert any("general" in row["key"] for row in rows) == (policy == "dynamic")


def test_runnable_per_call_path_is_a_key_build_a_lookup_and_a_call():
    gm = dynamo_graph(lambda x: x + 1, torch.randn(4, 3))
    r = sw.Pipeline([sw.Concretize(sizes=[1, 2, 4]), sw.Lower(backend="eager")]).run(gm)
    assert sorted(r.table.exact) == [(1,), (2,), (4,)]
    assert r.table.key_fn([7, torch.randn(7, 3)]) == (7,)
