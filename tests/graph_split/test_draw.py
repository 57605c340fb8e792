"""The split as a networkx graph and as a picture: nodes, edges with symbolic shapes, stable colours."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sympy
import torch

import shapewise as sw
from shapewise.graph_split.draw import INPUT, OUTPUT, Crossing, draw_split, piece_colour, split_dot, split_graph
from shapewise.models import ATTENTION_OP, ToyTransformer
from tests.helpers import dynamo_graph, is_png

REPO = Path(__file__).resolve().parents[2]


def attn(q, k, v):
    return torch.ops.shapewise_toy.attention(q, k, v)


def derived(x, w):
    h = torch.cat([x, x, x[:1]]) @ w  # 2*s + 1 rows
    q = h.view(h.shape[0], 2, -1)
    a = attn(q, q, q)
    return (a.reshape(h.shape[0], -1) + h).relu()


def split_program(fn=derived, *args):
    args = args or (torch.randn(6, 8), torch.randn(8, 8))
    gm = dynamo_graph(fn, *args)
    return sw.AnalyzeShapes()(sw.Split(ops=[ATTENTION_OP])(gm))


def test_nodes_are_input_pieces_output_in_order_with_attributes():
    program = split_program()
    g = split_graph(program)
    assert list(g.nodes) == [INPUT, "piece_0", "piece_1", "piece_2", OUTPUT]
    assert [g.nodes[n]["splitting"] for n in g.nodes] == [False, False, True, False, False]
    assert g.nodes["piece_1"]["targets"] == ("shapewise_toy.attention",)
    assert g.nodes["piece_1"]["ops"] == 1
    for p in program.pieces:
        calls = sum(1 for n in p.gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
        assert g.nodes[p.name]["ops"] == calls and g.nodes[p.name]["name"] == p.name


def test_edges_carry_symbolic_shapes_derived_ones_included():
    program = split_program()
    (s,) = program.shapes.symbols
    g = split_graph(program)
    into_attention = {c.name: c for c in g.edges["piece_0", "piece_1"]["values"]}
    assert into_attention["q"].shape == (2 * s + 1, 2, 4)
    assert into_attention["q"].dtype == torch.float32
    # The derived size crosses as a SymInt carrying its expression.
    sym = [c for c in g.edges["piece_0", "piece_2"]["values"] if c.expr is not None]
    assert [c.expr for c in sym] == [2 * s + 1]
    (out,) = g.edges["piece_1", "piece_2"]["values"]
    assert out.shape == (2 * s + 1, 2, 4)
    inputs = {c.name: c for c in g.edges[INPUT, "piece_0"]["values"]}
    assert inputs["l_x_"].shape == (s, 8) and inputs["l_w_"].shape == (8, 8)
    assert not inputs["l_w_"].is_dynamic and inputs["l_x_"].is_dynamic
    (final,) = g.edges["piece_2", OUTPUT]["values"]
    assert final.shape == (2 * s + 1, 8)
    assert "q: float32[2*s" in g.edges["piece_0", "piece_1"]["label"]


def test_every_piece_input_arrives_on_exactly_one_edge():
    model = ToyTransformer(layers=2)
    fast = sw.compile(model, sizes=[4], splitting_ops=[ATTENTION_OP], backend="eager")
    fast(torch.randint(0, 64, (4,)))
    program = fast.program
    g = split_graph(program)
    stitch_calls = {n.target: n for n in program.graph.graph.nodes if n.op == "call_module"}
    for p in program.pieces:
        arriving = [c.name for _, _, d in g.in_edges(p.name, data=True) for c in d["values"]]
        assert sorted(arriving) == sorted(a.name for a in stitch_calls[p.name].all_input_nodes)
    (s,) = program.shapes.symbols
    # Each layer's residual skips over attention: piece_0 -> piece_2 and piece_2 -> piece_4.
    for u, v in (("piece_0", "piece_2"), ("piece_2", "piece_4")):
        (c,) = g.edges[u, v]["values"]
        assert c.shape == (s, 32)
    assert [(u, v) for u, v in g.edges if u == INPUT] == [(INPUT, "piece_0"), (INPUT, "piece_2"), (INPUT, "piece_4")]


def test_colours_come_from_a_stable_hash():
    model = ToyTransformer(layers=2)
    fast = sw.compile(model, sizes=[4], splitting_ops=[ATTENTION_OP], backend="eager")
    fast(torch.randint(0, 64, (4,)))
    g1, g2 = split_graph(fast.program), split_graph(fast.program)
    colours = [g1.nodes[n]["colour"] for n in g1.nodes]
    assert colours == [g2.nodes[n]["colour"] for n in g2.nodes]
    assert all(c.startswith("#") and len(c) == 7 for c in colours)
    # Both attention pieces call the same op: same colour; the compute pieces differ.
    assert g1.nodes["piece_1"]["colour"] == g1.nodes["piece_3"]["colour"]
    assert len({g1.nodes[f"piece_{i}"]["colour"] for i in (0, 1, 2, 4)}) == 4


def _hash_probe(x):
    h = (x @ x.T)[:, :4].reshape(-1, 2, 2)
    return torch.ops.shapewise_toy.attention(h, h, h).sum(1) + 1


def test_colours_do_not_depend_on_python_hash_randomisation():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(_hash_probe, tracing_mode="symbolic")(torch.randn(6, 4))
    g = split_graph(sw.Split(ops=[ATTENTION_OP])(gm))
    here = [g.nodes[n]["colour"] for n in g.nodes]
    # The same colours from a process with another string-hash seed.
    script = textwrap.dedent("""
        import torch, shapewise as sw
        from shapewise.graph_split.draw import split_graph
        from torch.fx.experimental.proxy_tensor import make_fx
        from tests.graph_split.test_draw import _hash_probe
        gm = make_fx(_hash_probe, tracing_mode="symbolic")(torch.randn(6, 4))
        g = split_graph(sw.Split(ops=["shapewise_toy::attention"])(gm))
        print(" ".join(g.nodes[n]["colour"] for n in g.nodes))
    """)
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONHASHSEED": seed})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == here and len(here) == 5


def test_piece_colour_marks_splitting_pieces_more_saturated():
    program = split_program()
    light = [piece_colour(p) for p in program.pieces if not p.is_splitting]
    strong = [piece_colour(p) for p in program.pieces if p.is_splitting]

    def saturation(hex_colour: str) -> float:
        rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return (max(rgb) - min(rgb)) / max(rgb)

    assert min(saturation(c) for c in strong) > max(saturation(c) for c in light)


def test_draw_split_writes_a_valid_deterministic_png(tmp_path):
    program = split_program()
    draw_split(program, tmp_path / "a.png")
    draw_split(program, tmp_path / "b.png")
    a, b = (tmp_path / "a.png").read_bytes(), (tmp_path / "b.png").read_bytes()
    width, height = is_png(a)
    assert width > height > 50  # pieces left to right
    assert a == b


def test_draw_split_into_a_given_axes():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    out = draw_split(split_program(), ax=ax)
    assert out is fig
    texts = [t.get_text() for t in ax.texts]
    assert any(t.startswith("piece_1\nattention") for t in texts)  # the splitting op is named
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1  # one splitting piece


def test_split_dot_text():
    program = split_program()
    dot = split_dot(program)
    assert dot.startswith("digraph split {") and dot.rstrip().endswith("}")
    for name in ("input", "piece_0", "piece_1", "piece_2", "output"):
        assert f'"{name}" [' in dot
    assert dot.count("shape=hexagon") == 1
    assert '"piece_0" -> "piece_1" [label="q: float32[2*s' in dot


def test_unsplit_program_is_refused_and_has_no_picture():
    gm = dynamo_graph(lambda x: x * 2, torch.randn(4, 3))
    program = sw.Program(gm=gm)
    with pytest.raises(sw.ShapewiseError, match="run Split first"):
        split_graph(program)
    assert program._repr_png_() is None
    assert "not split yet" in program._repr_html_()


def test_program_rich_display_names_the_pieces():
    program = split_program()
    html = program._repr_html_()
    for p in program.pieces:
        assert f"<td style='text-align:left'>{p.name}</td>" in html
    assert "data:image/png;base64," in html
    assert "splitting op (runs as is)" in html
    is_png(program._repr_png_())


def test_crossing_text():
    s = sympy.Symbol("s0", integer=True, positive=True)
    assert str(Crossing("q", (2 * s + 1, 4), torch.float16)) == "q: float16[2*s0 + 1, 4]"
    assert str(Crossing("n", expr=2 * s)) == "n: sym 2*s0"
    assert Crossing("w", (sympy.Integer(3),), torch.float32).is_dynamic is False
