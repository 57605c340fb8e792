"""Instruments: Dump writes each stage to a folder; Verify checks each stage against eager."""

from __future__ import annotations

import math
import stat
import sys
from pathlib import Path

import pytest
import sympy
import torch

import shapewise as sw
from shapewise.instruments import Dump, Verify, max_error, random_inputs
from shapewise.ir import Report, format_graph, format_program, format_shapes
from shapewise.ir.program import ShapeInfo, TensorMeta
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer
from tests.helpers import dynamo_graph, is_png


def toy_graph(layers: int = 1):
    model = ToyTransformer(layers=layers).eval()
    with torch.no_grad():
        return dynamo_graph(model, torch.randint(0, 64, (6,)))


def pipeline(backend="aot_eager", sizes=(1, 4), ranges=((5, 32),), instruments=()):
    return sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(sizes=sizes, ranges=ranges),
                        sw.Lower(backend=backend)], instruments=instruments)


def split_only(gm, *instruments):
    """Only the Split stage (``apply``, unlike ``run``, adds no dispatch and so no compile)."""
    return sw.Pipeline([sw.Split(ops=[ATTENTION_OP])], instruments=instruments).apply(sw.Program(gm=gm))


STAGES = ["00_input", "01_split", "02_analyze_shapes", "03_concretize", "04_lower", "05_build_dispatch"]


def test_dump_writes_every_stage_through_the_canonical_printer(tmp_path):
    gm = toy_graph()
    dump = Dump(tmp_path / "dump", graphviz=None)
    runnable = pipeline(instruments=[dump]).run(gm)
    root = tmp_path / "dump"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == STAGES
    assert (root / "pipeline.txt").read_text().splitlines() == [
        "00 input", f"01 split{{ops={ATTENTION_OP}}}", "02 analyze_shapes",
        "03 concretize{sizes=1,4 ranges=((5,32),)}", "04 lower{backend=aot_eager}", "05 build_dispatch"]
    assert sorted(p.name for p in (root / "00_input").iterdir()) == ["graph.py", "program.txt"]
    assert (root / "00_input" / "graph.py").read_text() == format_graph(gm) + "\n"
    for record, stage in zip(runnable.trace, STAGES[1:]):
        folder = root / stage
        names = sorted(p.name for p in folder.iterdir())
        pieces = [f"{p.name}.py" for p in record.program.pieces]
        assert names == sorted(["graph.py", "program.txt", "stitch.py", "split.png", *pieces])
        assert (folder / "program.txt").read_text() == format_program(record.program) + "\n"
        assert (folder / "stitch.py").read_text() == format_graph(record.program.graph) + "\n"
        for p in record.program.pieces:
            text = (folder / f"{p.name}.py").read_text()
            assert text.endswith(format_graph(p.gm) + "\n")
            assert ("splitting op" in text.splitlines()[0]) == p.is_splitting
        is_png((folder / "split.png").read_bytes())


def test_dump_is_deterministic_and_replaces_an_earlier_dump(tmp_path):
    gm = toy_graph()
    for folder in ("a", "b"):
        pipeline(instruments=[Dump(tmp_path / folder, graphviz=None)]).run(gm)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b and len(files_a) > 20
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    # A shorter run into the same folder leaves no stale stage behind; other files are kept.
    (tmp_path / "a" / "notes.md").write_text("mine")
    split_only(gm, Dump(tmp_path / "a", graphviz=None))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["00_input", "01_split", "notes.md", "pipeline.txt"]
    assert (tmp_path / "a" / "notes.md").read_text() == "mine"


def test_dump_calls_graphviz_when_present(tmp_path):
    # A stand-in for graphviz's `dot` that checks its arguments and writes an SVG naming the nodes.
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys, re\n"
        "assert sys.argv[1] == '-Tsvg' and sys.argv[3] == '-o', sys.argv\n"
        "names = re.findall(r'^  \"(\\w+)\" \\[', open(sys.argv[2]).read(), re.M)\n"
        "open(sys.argv[4], 'w').write('<svg>' + ' '.join(names) + '</svg>')\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    gm = toy_graph()
    split_only(gm, Dump(tmp_path / "d", graphviz=str(fake)))
    stage = tmp_path / "d" / "01_split"
    assert (stage / "split.dot").read_text().startswith("digraph split {")
    assert (stage / "split.svg").read_text() == "<svg>input piece_0 piece_1 piece_2 output</svg>"
    # Not found on PATH: PNG only.
    split_only(gm, Dump(tmp_path / "e", graphviz="no-such-graphviz-binary"))
    assert sorted(p.suffix for p in (tmp_path / "e" / "01_split").iterdir() if p.name.startswith("split")) == [".png"]


@pytest.mark.inductor
def test_dump_writes_inductor_code_per_variant(tmp_path):
    gm = dynamo_graph(MLP(), torch.randn(4, 32))
    sw.Pipeline([sw.Concretize(sizes=[4]), sw.Lower(backend="inductor")],
                instruments=[Dump(tmp_path, graphviz=None)]).run(gm)
    (code_file,) = (tmp_path / "04_lower").glob("piece_0.*=4.py")
    code = code_file.read_text()
    assert "def call(" in code and "(4, 32)" in code


def test_verify_reports_small_error_for_every_stage_and_size():
    verify = Verify(int_range=(0, 64))
    pipeline(instruments=[verify]).run(toy_graph(layers=2))
    by_pass: dict[str, list[dict]] = {}
    for row in verify.rows:
        by_pass.setdefault(row["pass"].split("{")[0], []).append(row)
    assert list(by_pass) == ["split", "analyze_shapes", "concretize", "lower", "build_dispatch"]
    assert len(by_pass["split"]) == 1 and by_pass["split"][0]["size"].endswith("=6}")  # the traced size
    for name in ("concretize", "lower", "build_dispatch"):
        sizes = [r["size"].split("=")[1].rstrip("}") for r in by_pass[name]]
        assert sizes == ["1", "4", "5", "32"]  # the static sizes, then the range's two ends
    assert {r["ran"] for r in by_pass["concretize"]} == {"pieces"}
    assert {r["ran"] for r in by_pass["lower"]} == {"variants"}
    assert {r["ran"] for r in by_pass["build_dispatch"]} == {"dispatch"}
    assert all(r["ok"] and r["max_error"] < 1e-5 for r in verify.rows)
    assert verify.worst < 1e-5


def broken(gm, example_inputs):
    """A backend whose compiled pieces are off by one."""
    fn = gm.forward

    def run(*args):
        return tuple(t + 1 if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in fn(*args))

    return run


def test_verify_flags_a_broken_backend():
    verify = Verify(int_range=(0, 64))
    pipeline(backend=broken, ranges=(), instruments=[verify]).run(toy_graph())
    for row in verify.rows:
        compiled = row["pass"].startswith(("lower", "build_dispatch"))
        assert row["ok"] is not compiled, row
        assert (row["max_error"] > 0.5) if compiled else (row["max_error"] < 1e-5)
    assert "False" in str(verify) and "lower{backend=broken}" in str(verify)


def test_verify_strict_raises_naming_pass_and_size():
    with pytest.raises(sw.ShapewiseError, match=r"after lower\{backend=broken\} at size \{\w+=1\}"):
        pipeline(backend=broken, ranges=(), instruments=[Verify(int_range=(0, 64), strict=True)]).run(toy_graph())


def test_verify_records_a_backend_that_raises():
    def raising(gm, example_inputs):
        def run(*args):
            raise RuntimeError("kernel exploded")
        return run

    verify = Verify(int_range=(0, 64), passes=("lower",))
    pipeline(backend=raising, ranges=(), instruments=[verify]).run(toy_graph())
    assert [r["pass"] for r in verify.rows] == ["lower{backend=raising}"] * 2
    assert all(r["error"] == "RuntimeError: kernel exploded" and r["max_error"] == math.inf for r in verify.rows)


def test_verify_with_given_sizes_and_inputs_fn():
    seen = []
    model = MLP()

    def inputs_fn(shapes, values):
        seen.append(dict(values))
        (n,) = values.values()
        return random_inputs(shapes, values, seed=n)

    verify = Verify(sizes=[3, 7], inputs_fn=inputs_fn, passes=("build_dispatch",))
    gm = dynamo_graph(model, torch.randn(4, 32))
    sw.Pipeline([sw.Concretize(ranges=[(1, 16)]), sw.Lower(backend="eager")], instruments=[verify]).run(gm)
    assert [list(v.values()) for v in seen] == [[3], [7]]
    assert [r["size"].split("=")[1] for r in verify.rows] == ["3}", "7}"]
    assert all(r["ok"] for r in verify.rows)


def test_random_inputs_follow_shape_stride_offset_and_leave_the_global_rng_alone():
    s = sympy.Symbol("s0", integer=True, positive=True)
    shapes = ShapeInfo(
        symbols=(s,), sources={}, input_names=("x", "ids", "mask", "n"),
        inputs=(TensorMeta((2 * s + 1, 4), (1, 2 * s + 1), s, torch.float32, torch.device("cpu")),
                TensorMeta((s,), (1,), sympy.Integer(0), torch.int64, torch.device("cpu")),
                TensorMeta((s, 2), (2, 1), sympy.Integer(0), torch.bool, torch.device("cpu")),
                sympy.floor(s / 2)))
    state = torch.get_rng_state()
    x, ids, mask, n = random_inputs(shapes, {s: 5}, seed=3, int_range=(10, 20))
    assert torch.equal(torch.get_rng_state(), state)
    assert x.shape == (11, 4) and x.stride() == (1, 11) and x.storage_offset() == 5
    assert x.dtype == torch.float32 and x.std() > 0.3
    assert ids.dtype == torch.int64 and 10 <= int(ids.min()) and int(ids.max()) < 20
    assert mask.dtype == torch.bool and n == 2
    again = random_inputs(shapes, {s: 5}, seed=3, int_range=(10, 20))
    assert torch.equal(again[0], x) and torch.equal(again[1], ids)


def test_max_error_handles_structure_nan_and_dtype():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert max_error((a,), (a.clone(),)) == (0.0, 3.0)
    assert max_error((a,), (torch.tensor([1.0, 2.0, 3.0]),))[0] == math.inf
    assert max_error((a,), (a, a))[0] == math.inf
    assert max_error(a, a.double())[0] == math.inf
    assert max_error([torch.tensor([1, 2])], [torch.tensor([1, 5])])[0] == 3.0


def test_report_is_a_list_that_prints_as_a_table():
    model = MLP()
    fast = sw.compile(model, sizes=[2, 4], ranges=[(5, 8)], backend="eager")
    fast(torch.randn(4, 32))
    report = fast.runnable.report()
    assert isinstance(report, Report) and isinstance(report, list)
    assert report == [dict(r) for r in report] and len(report) == 3
    lines = str(report).splitlines()
    # The standard columns first, then any others the rows carry, in order.
    assert lines[0].split()[:6] == ["piece", "key", "static", "seconds", "source", "backend"]
    assert lines[0].split()[6:] == [k for k in report[0] if k not in lines[0].split()[:6]]
    assert [ln.split()[:3] for ln in lines[2:5]] == [["piece_0", "{n=2}", "True"], ["piece_0", "{n=4}", "True"],
                                                     ["piece_0", "{n=5..8}", "False"]]
    html = report._repr_html_()
    assert html.count("<tr>") == 4 and "piece_0" in html and "{n=5..8}" in html
    assert isinstance(fast.report(), Report)


def test_shapes_and_dispatch_table_display():
    def f(x):
        return x.view(x.shape[0] // 2, 2, -1).sum(1)

    gm = dynamo_graph(f, torch.randn(6, 4))
    runnable = sw.Pipeline([sw.Concretize(sizes=[2, 4]), sw.Lower(backend="eager")]).run(gm)
    shapes = runnable.program.shapes
    assert str(shapes) == format_shapes(shapes)
    html = shapes._repr_html_()
    assert "symbols" in html and "guards" in html and "Mod(" in html and str(shapes.symbols[0]) in html
    n = str(shapes.symbols[0])
    plan = runnable.program.dispatch  # the plan, data: what the program prints
    text = str(plan)
    assert text.splitlines()[0].startswith("DispatchPlan: 2 exact, 0 ranges, on_miss='error', compile='eager_all'")
    assert [line.split() for line in text.splitlines()[-2:]] == [["exact", f"{{{n}=2}}", "compiled"],
                                                               ["exact", f"{{{n}=4}}", "compiled"]]
    assert "<caption" in plan._repr_html_() and "exact" in plan._repr_html_()
    table = runnable.table  # the live table the runnable built from it
    text = str(table)
    assert text.splitlines()[0].startswith("DispatchTable: 2 exact, 0 ranges, on_miss='error'")
    assert text.splitlines()[-2:] == [f"exact  {{{n}=2}}", f"exact  {{{n}=4}}"]
    assert "<caption" in table._repr_html_() and "exact" in table._repr_html_()


def test_instruments_have_no_global_state():
    gm = toy_graph()
    v1, v2 = Verify(int_range=(0, 64), passes=("split",)), Verify(int_range=(0, 64), passes=("lower",))
    split_only(gm, v1)
    pipeline(instruments=[v2], ranges=()).run(gm)
    assert {r["pass"].split("{")[0] for r in v1.rows} == {"split"}
    assert {r["pass"].split("{")[0] for r in v2.rows} == {"lower"}
    assert Path(Dump().folder) == Path("shapewise-dump") and Dump().count == 0
