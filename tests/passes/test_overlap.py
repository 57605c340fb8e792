"""``sw.passes.OverlapAllReduce``: row-parallel linear layers and their all-reduces in row chunks.
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
from tests.helpers import assert_same


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


def _collectives(fast, n: int) -> int:
    (piece,) = fast.program.compute_pieces
    variant = next(v for v in piece.variants if v.binding.key == (n,))
    gm = variant.gm if variant.gm is not None else piece.gm
    return gm.code.count("_c10d_functional.all_reduce(")


def test_chunks_above_min_tokens_and_answers_the_same(one_rank):
    torch.manual_seed(0)
    model = RowParallel().eval()
    sizes = [4, 64, 200]
    fast = sw.compile(model, sizes=sizes, ranges=[(5, 63)], backend="aot_eager", progress=False,
                      graph_passes=[sw.passes.OverlapAllReduce(chunks=4, min_tokens=64, align=16)])
    with torch.no_grad():
        for n in [*sizes, 9, 40]:
            x = torch.randn(n, 32)
            assert_same(fast(x), model(x), f"n={n}")
    # 200 rows: chunks of 64, 64, 64, 8; 64 rows: four of 16; 4 rows and the range: untouched.
    assert _collectives(fast, 200) == 8 and _collectives(fast, 64) == 8 and _collectives(fast, 4) == 2
    labels = {row["key"]: row["passes"] for row in fast.report()}
    assert "overlap_all_reduce" in labels["{n=200}"] and not labels["{n=4}"] and not labels["{n=5..63}"]


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="chunks"):
        sw.passes.OverlapAllReduce(chunks=1)
    with pytest.raises(ConfigError, match="min_tokens"):
        sw.passes.OverlapAllReduce(min_tokens=0)
