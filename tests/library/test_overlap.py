"""``sw.library.OverlapAllReduce``: row-parallel linear layers and their all-reduces in row chunks.
One gloo rank in this process (the all-reduce is then the identity, so eager is the reference);
two ranks, and Inductor's order of the chunks' collectives, are in ``tests/distributed``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shapewise as sw
from shapewise.errors import ConfigError
from tests.helpers import assert_before_after, assert_same, dynamo_graph


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class RowParallel(nn.Module):
    """A residual block whose two row-parallel projections end in all-reduces, in two spellings."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim)
        self.o = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        h = x + funcol.all_reduce(self.down(F.silu(self.up(x))), "sum", dist.group.WORLD)
        return h + funcol.all_reduce(h @ self.o.t(), "sum", dist.group.WORLD)


def _code(fast, n: int) -> str:
    (piece,) = fast.program.compute_pieces
    variant = next(v for v in piece.variants if v.binding.key == (n,))
    return (variant.gm if variant.gm is not None else piece.gm).code


def _collectives(fast, n: int) -> int:
    return _code(fast, n).count("_c10d_functional.all_reduce(")


class Mixed(nn.Module):
    """Row-wise up to the first all-reduce, then a cumulative sum over the rows (not row-wise:
    the slices must be put back together before it), then row-wise again."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim, bias=False)
        self.b = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        h = x + funcol.all_reduce(self.a(x).relu(), "sum", dist.group.WORLD)
        h = torch.cumsum(h, 0) / 8
        return funcol.all_reduce(self.b(h), "sum", dist.group.WORLD).softmax(-1)


def test_the_rewrite_in_two_pipelined_slices(one_rank):
    import torch.distributed._functional_collectives as funcol

    o = torch.randn(16, 16)

    def f(x):
        return x + funcol.all_reduce(F.linear(x, o), "sum", dist.group.WORLD)

    gm = dynamo_graph(f, torch.randn(64, 16))
    overlap = sw.library.OverlapAllReduce(chunks=2, min_tokens=64, align=16, min_slice=16)
    out = assert_before_after(overlap, sw.Concretize(sizes=[64])(gm), """
        def forward(self, l_x_, l_o_):
            linear = torch._C._nn.linear(l_x_, l_o_)
            tensor = torch.ops._c10d_functional.all_reduce(linear, 'sum', '<group>')
            wait_tensor = torch.ops._c10d_functional.wait_tensor(tensor)
            add = l_x_ + wait_tensor
            return (add,)
    """, """
        def forward(self, l_x_, l_o_):
            split = torch.functional.split(l_x_, [32, 32], dim = 0)
            getitem = split[0]
            getitem_1 = split[1]
            linear = torch._C._nn.linear(getitem, l_o_)
            tensor = torch.ops._c10d_functional.all_reduce(linear, 'sum', '<group>')
            linear_1 = torch._C._nn.linear(getitem_1, l_o_)
            tensor_1 = torch.ops._c10d_functional.all_reduce(linear_1, 'sum', '<group>')
            wait_tensor = torch.ops._c10d_functional.wait_tensor(tensor)
            add = getitem + wait_tensor
            wait_tensor_1 = torch.ops._c10d_functional.wait_tensor(tensor_1)
            add_1 = getitem_1 + wait_tensor_1
            cat = torch.cat([add, add_1], dim = 0)
            return (cat,)
    """)
    (variant,) = out.compute_pieces[0].variants
    x = torch.randn(64, 16)
    assert_same(variant.gm(x, o)[0], f(x))
    assert dict(variant.inductor_options) == overlap.inductor_options()
    # Under min_tokens: the rewrite says it changed nothing, and the variant keeps the piece's graph.
    assert sw.library.OverlapAllReduce(min_tokens=128).rewrite(gm, sw.passes.VariantSizes({})).modified is False


def test_chunks_above_min_tokens_and_answers_the_same(one_rank):
    torch.manual_seed(0)
    model = RowParallel().eval()
    sizes = [4, 64, 200]
    fast = sw.compile(model, sizes=sizes, ranges=[(5, 63)], backend="aot_eager", progress=False,
                      graph_passes=[sw.library.OverlapAllReduce(chunks=4, min_tokens=64, align=16, min_slice=16)])
    with torch.no_grad():
        for n in [*sizes, 9, 40]:
            x = torch.randn(n, 32)
            assert_same(fast(x), model(x), f"n={n}")
    # 200 rows: slices of 48, 48, 48, 56; 64 rows: four of 16; 4 rows and the range: untouched.
    assert sw.library.OverlapAllReduce(chunks=4, min_tokens=64, align=16, min_slice=16)._bounds(200) == [48, 48, 48, 56]
    assert _collectives(fast, 200) == 8 and _collectives(fast, 64) == 8 and _collectives(fast, 4) == 2
    labels = {row["key"]: row["passes"] for row in fast.report()}
    assert "overlap_all_reduce" in labels["{n=200}"] and not labels["{n=4}"] and not labels["{n=5..63}"]


def _sliced_at_64(model: nn.Module, chunks: int) -> str:
    """``model`` compiled at 64 rows with the pass (``chunks`` slices of 16 or more rows),
    checked against eager: the rewritten graph's code."""
    torch.manual_seed(0)
    fast = sw.compile(model.eval(), sizes=[64], backend="aot_eager", progress=False,
                      graph_passes=[sw.library.OverlapAllReduce(chunks=chunks, min_tokens=64, align=16, min_slice=16)])
    with torch.no_grad():
        x = torch.randn(64, 32)
        assert_same(fast(x), model(x), "n=64")
    return _code(fast, 64)


def test_slices_are_pipelined_each_waits_for_its_own_all_reduce_only(one_rank):
    # Pipeline order: every slice's first all-reduce is issued before any slice waits; slice 0's
    # second-stage work (and its second all-reduce) comes before slice 1 waits for its first.
    lines = [ln.strip() for ln in _sliced_at_64(RowParallel(), chunks=2).splitlines()]
    reduces = [i for i, ln in enumerate(lines) if "_c10d_functional.all_reduce(" in ln]
    waits = [i for i, ln in enumerate(lines) if "_c10d_functional.wait_tensor(" in ln]
    assert len(reduces) == 4 and len(waits) == 4
    assert reduces[1] < waits[0]          # both first-stage all-reduces issued before any wait
    assert waits[0] < reduces[2] < waits[1]  # slice 0's second all-reduce before slice 1's first wait


def test_a_node_that_mixes_rows_ends_the_chunked_region(one_rank):
    code = _sliced_at_64(Mixed(), chunks=4)
    # The first all-reduce in four slices of 16 rows, the cumsum on the whole (after a cat), the
    # rest whole too.
    assert code.count("_c10d_functional.all_reduce(") == 5 and "torch.cat" in code


def test_slice_sizes():
    bounds = sw.library.OverlapAllReduce(chunks=4, align=256, min_slice=256)._bounds
    assert bounds(4096) == [1024] * 4  # whole 256-row matmul tiles
    assert bounds(1000) == [256, 256, 488]  # three slices: four would be under 256 rows
    assert bounds(600) == [256, 344]
    assert bounds(300) is None
    for rows in range(512, 9000, 37):
        sizes = bounds(rows)
        assert sum(sizes) == rows and len(sizes) > 1 and all(s % 256 == 0 for s in sizes[:-1]), (rows, sizes)


def test_slices_are_never_under_min_slice():
    bounds = sw.library.OverlapAllReduce()._bounds  # chunks=4, align=256, min_slice=1024
    assert bounds(4096) == [1024] * 4 and bounds(2048) == [1024, 1024] and bounds(3000) == [1280, 1720]
    assert bounds(2047) is None


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="chunks"):
        sw.library.OverlapAllReduce(chunks=1)
    with pytest.raises(ConfigError, match="min_tokens"):
        sw.library.OverlapAllReduce(min_tokens=0)
