"""The dispatch plan is data: no run-time object is reachable from a Program, and each Runnable
builds its own live objects from the plan."""

import dataclasses
import pickle
import threading
import types

import pytest
import torch

import shapewise as sw
from shapewise.dispatch.graphed import GraphedPiece, GraphPool, StagedInputs
from shapewise.dispatch.plan import DispatchPlan
from shapewise.dispatch.runtime import CompileWatch, DispatchRuntime
from shapewise.dispatch.table import DispatchTable
from shapewise.lower.lower import CompileSession
from tests.helpers import assert_same, dynamo_graph

LIVE = (threading.Thread, type(threading.Lock()), threading.Event, CompileSession, CompileWatch, DispatchRuntime,
        DispatchTable, GraphPool, GraphedPiece, StagedInputs)


def _live_objects(root, path="program", seen=None):
    """Every run-time object reachable from ``root`` (dataclass fields, containers, and what a
    function's closure holds): (path, object)."""
    seen = set() if seen is None else seen
    if id(root) in seen or isinstance(root, (str, bytes, int, float, bool, type(None), torch.Tensor, torch.nn.Module,
                                              type)):
        return []
    seen.add(id(root))
    if isinstance(root, LIVE) or type(root).__name__ in ("_Background", "_Deferred", "_GeneralVariant"):
        return [(path, root)]
    found = []
    if dataclasses.is_dataclass(root):
        for f in dataclasses.fields(root):
            found += _live_objects(getattr(root, f.name), f"{path}.{f.name}", seen)
    elif isinstance(root, dict):
        for k, v in root.items():
            found += _live_objects(v, f"{path}[{k!r}]", seen)
    elif isinstance(root, (list, tuple, set, frozenset)):
        for i, v in enumerate(root):
            found += _live_objects(v, f"{path}[{i}]", seen)
    elif isinstance(root, types.FunctionType):
        for i, cell in enumerate(root.__closure__ or ()):
            found += _live_objects(cell.cell_contents, f"{path}<closure {i}>", seen)
    elif hasattr(root, "__dict__") and not isinstance(root, types.ModuleType):
        for k, v in vars(root).items():
            found += _live_objects(v, f"{path}.{k}", seen)
    return found


def _square_plus(x):
    return x * x + 1


@pytest.mark.parametrize("lower", [
    {"backend": "eager"},
    {"backend": "eager", "compile": "lazy"},
    {"backend": "eager", "compile": "background"},
])
def test_no_run_time_object_is_reachable_from_the_program(lower):
    gm = dynamo_graph(_square_plus, torch.randn(6, 3))
    runnable = sw.Pipeline([sw.Concretize(sizes=[2, 4], ranges=[(5, 9)]), sw.Lower(**lower),
                            sw.BuildDispatch(on_miss="dynamic")]).run(gm)
    for n in (2, 4, 7, 12):  # lazy compiles, a range, a miss compiled by on_miss="dynamic"
        x = torch.randn(n, 3)
        args = [n, x] if len(runnable.program.shapes.inputs) == 2 else [x]
        assert_same(runnable(*args), (_square_plus(x),), f"n={n}")
    assert runnable.wait(timeout=60)
    program = runnable.program
    assert isinstance(program.dispatch, DispatchPlan)
    assert _live_objects(program) == []
    # the walk finds what it looks for: the runtime holds them, in named fields
    found = {type(o).__name__ for _, o in _live_objects(vars(runnable.runtime), "runtime")}
    assert {"DispatchTable", "CompileSession"} <= found, found
    assert ("_Background" in found) == (lower.get("compile") == "background")
    # the plan is data: it pickles, and it compares equal to itself rebuilt
    plan = program.dispatch
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert plan.compile == lower.get("compile", "eager_all") and plan.on_miss == "dynamic"
    assert {b.key for b in plan.exact} == {(2,), (4,)} and len(plan.ranges) == 1
    assert (plan.deferred == set(plan.exact) | set(plan.ranges)) == ("compile" in lower)


def test_two_runnables_of_one_program_share_no_run_time_state():
    gm = dynamo_graph(_square_plus, torch.randn(6, 3))
    first = sw.Pipeline([sw.Concretize(sizes=[2, 4]), sw.Lower(backend="eager", compile="lazy")]).run(gm)
    second = type(first)(first.program)
    assert first.table is not second.table and first.runtime.session is not second.runtime.session
    x = torch.randn(2, 3)
    args = [2, x] if len(first.program.shapes.inputs) == 2 else [x]
    assert_same(second(*args), (_square_plus(x),))
    assert [r["source"] for r in second.report()].count("pending") == 1  # {2} compiled by the second one only
    assert [r["source"] for r in first.report()].count("pending") == 2


def test_the_program_prints_its_plan():
    gm = dynamo_graph(_square_plus, torch.randn(6, 3))
    runnable = sw.Pipeline([sw.Concretize(sizes=[2], ranges=[(3, 9)]),
                            sw.Lower(backend="eager", compile="lazy")]).run(gm)
    text = str(runnable.program)
    dispatch = text[text.index("# dispatch"):].splitlines()
    assert dispatch[1].startswith("exact") and "compiled on first use" in dispatch[1]
    assert dispatch[2].startswith("range") and "=3..9}" in dispatch[2]


def test_a_bad_miss_policy_is_refused_when_the_pass_is_made():
    with pytest.raises(sw.ConfigError, match="on_miss must be one of"):
        sw.BuildDispatch(on_miss="recompile")
