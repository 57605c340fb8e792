"""What several test modules share: small graphs, the dtype-set comparison, checks of
pictures and printed graphs. Test modules import from here, never from each other."""

from __future__ import annotations

import struct
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shapewise._compat import no_zero_one_specialisation


def dynamo_graph(fn, *args, dims=None):
    """Trace ``fn`` once with Dynamo (dim 0 of the first argument dynamic, or ``dims``: {argpos: [dims]})
    and return the GraphModule Dynamo hands its backend."""
    torch._dynamo.reset()  # a fresh trace, however often the same function is traced
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            for d in (dims if dims is not None else {0: [0]}).get(i, []):
                torch._dynamo.mark_dynamic(a, d)
    with no_zero_one_specialisation():
        torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def symbolic_graph(fn, *args):
    """``make_fx(tracing_mode="symbolic")``: every dim symbolic."""
    return make_fx(fn, tracing_mode="symbolic")(*args)


def graph_args(gm, *tensors, **named):
    """The positional arguments of ``gm`` for a call with ``tensors`` (the function's tensor
    arguments, in the order the graph first reads them) or ``named`` ({argument name: tensor},
    matched to Dynamo's ``L_<name>_`` placeholders); a SymInt placeholder takes the size (or
    stride) of the tensor whose traced layout carries that symbol."""
    from shapewise._compat import node_value, sym_expr

    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [node_value(n) for n in nodes]
    it = iter(tensors)
    out = [(named[str(n.target)[2:-1]] if named else next(it)) if isinstance(v, torch.Tensor) else None
           for n, v in zip(nodes, values)]
    for i, v in enumerate(values):
        if not isinstance(v, torch.SymInt):
            continue
        e = sym_expr(v)
        for t, real in zip(values, out):
            if isinstance(t, torch.Tensor):
                hit = [real.shape[d] for d, s in enumerate(t.shape) if sym_expr(s) == e]
                hit += [real.stride(d) for d, s in enumerate(t.stride()) if sym_expr(s) == e]
                if hit:
                    out[i] = hit[0]
                    break
        assert out[i] is not None, f"no tensor carries symbol {e}"
    return out


TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def assert_same(actual, expected, what: str = "") -> None:
    """Compare outputs (tensors or nested tuples of them) with tolerances set by dtype."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{what}[{i}]")
        return
    if not isinstance(expected, torch.Tensor):
        assert actual == expected, what
        return
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}, expected a tensor"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.is_floating_point():
        rtol, atol = TOLERANCES.get(expected.dtype, (1e-4, 1e-5))
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), what


def is_png(data: bytes) -> tuple[int, int]:
    """Check the PNG signature and IHDR chunk; return (width, height)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"
    return width, height


def column_major_after(x):
    # The order of z's strides depends on n vs 3, which the size-oblivious trace leaves undecided
    # (row-major, no guard); eager at n=8 makes it column-major (1, 3). No size is 0 or 1.
    z = x.t().contiguous().t()[::3] * 2
    s = torch.ops.shapewise_toy.attention(x[None], x[None], x[None])[0]
    return z + s[::3]


def normalised(text: str) -> str:
    """Printed graph text made comparable across torch versions and runs: symbols renamed
    ``s0, s1, ...`` in order of appearance, collectives' group names as ``'<group>'``, trailing
    spaces and blank lines dropped."""
    import re

    names: dict[str, str] = {}
    text = re.sub(r"\b[su]\d+\b", lambda m: names.setdefault(m.group(0), f"s{len(names)}"), text)
    # A c10d collective's process-group name depends on how many groups the process made before.
    text = re.sub(r"(_c10d_functional\.\w+\(.*'(?:sum|avg|max|min|product)', )'[^']*'", r"\1'<group>'", text)
    return "\n".join(ln.rstrip() for ln in text.strip().splitlines() if ln.strip())


def assert_before_after(pass_, program, before: str, after: str) -> Any:
    """Check that ``pass_`` turns graph A into graph B. Runs ``pass_`` on ``program`` (a Program or
    a GraphModule) and compares the printed text before and after it with ``before`` and ``after``
    (dedented, normalised: see ``normalised``): for a program pass the canonical printer's text of
    the program; for a graph pass (``sw.GraphPass``) the graph of the program's one compute piece
    and that of its one variant after the pass (the program is concretized to one size first if it
    is not). Returns the pass's output. On a mismatch the message shows the text that was
    printed, to paste into the test once it is checked by eye."""
    import textwrap

    import shapewise as sw
    from shapewise.ir import format_graph

    program = program if isinstance(program, sw.Program) else sw.Program(gm=program)
    if isinstance(pass_, sw.GraphPass):
        (piece,) = program.compute_pieces
        assert len(piece.variants) == 1, f"a graph pass's before/after needs one variant, got {len(piece.variants)}"
        got_before = normalised(format_graph(piece.gm))
        out = pass_(program)
        (piece,) = out.compute_pieces
        (variant,) = piece.variants
        got_after = normalised(format_graph(variant.gm if variant.gm is not None else piece.gm))
    else:
        got_before = normalised(str(program))
        out = pass_(program)
        got_after = normalised(str(out))
    for what, got, want in (("before", got_before, before), ("after", got_after, after)):
        want = normalised(textwrap.dedent(want))
        assert got == want, f"{pass_.spec()}: the {'graph' if isinstance(pass_, sw.GraphPass) else 'program'} " \
                            f"{what} it differs; printed:\n{got}"
    return out


class PerRow(torch.nn.Module):
    """A linear layer divided by the batch size: wrong at any size but the traced one if the size
    were baked in."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) / x.shape[0]
