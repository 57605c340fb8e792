"""Static Inductor pieces go without Inductor's per-input ``assert_size_stride`` (issue 12's
host path): the runner checks, before such a piece, the layout of every argument a splitting op
made (the only values whose real layout may differ from their fake one), copies a value whose
strides differ into the compiled layout (warning once), and refuses one whose shape differs.
Range variants, pieces that call a non-ATen op, and an explicit ``size_asserts`` keep them."""

from __future__ import annotations

import logging

import pytest
import torch

import shapewise as sw
from shapewise._compat import compiled_source
from shapewise.errors import ShapewiseError
from shapewise.models import ATTENTION_OP
from tests.helpers import assert_same

pytestmark = pytest.mark.inductor

COLMAJOR = "shapewise_test_layout::colmajor"
WIDER = "shapewise_test_layout::wider"


@torch.library.custom_op(COLMAJOR, mutates_args=())
def _colmajor(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).t().contiguous().t()  # column-major: strides (1, rows)


@_colmajor.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # promises row-major


@torch.library.custom_op(WIDER, mutates_args=())
def _wider(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x[:, :1]], dim=1)  # one column more than its fake says


@_wider.register_fake
def _(x):
    return torch.empty_like(x)


class Stack(torch.nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.op(self.a(x).relu())
        # (h * 3).relu() is one generated kernel that indexes h by the compiled strides: the
        # wrong layout would give a wrong answer, not an error
        return self.b((h * 3).relu()).sum(0)


def _attention(h):
    return torch.ops.shapewise_toy.attention(h[:, None], h[:, None], h[:, None])[:, 0]


def _rows(fast):
    return {(r["piece"], r["key"]): r for r in fast.report()}


def test_static_pieces_leave_their_input_checks_to_the_runner():
    model = Stack(_attention)
    fast = sw.compile(model, sizes=[2, 5], ranges=[(6, 16)], splitting_ops=[ATTENTION_OP], backend="inductor",
                      cache=False)
    with torch.no_grad():
        for n in (2, 5, 9, 2):
            x = torch.randn(n, 8)
            assert_same(fast(x), model(x), f"n={n}")
    for row in fast.report():
        assert row["size_asserts"] is (not row["static"]), row
    for piece in fast.program.compute_pieces:
        for v in piece.variants:
            src = compiled_source(v.compiled)
            assert ("assert_size_stride(arg" in src) is (not v.binding.is_static), (piece.name, v.binding)


def test_a_splitting_op_whose_real_layout_differs_is_copied_into_the_compiled_one(caplog):
    model = Stack(torch.ops.shapewise_test_layout.colmajor)
    fast = sw.compile(model, sizes=[3, 4], splitting_ops=[COLMAJOR], backend="inductor", cache=False)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="shapewise"):
        for n in (3, 4, 3, 4):
            x = torch.randn(n, 8)
            assert_same(fast(x), model(x), f"n={n}")
    copies = [r for r in caplog.records if "copied into that layout" in r.getMessage()]
    assert len(copies) == 2, "one warning per (size, place), not per call"
    assert "piece_1's output" in copies[0].getMessage()


def test_a_splitting_op_whose_real_shape_differs_is_a_clear_error():
    model = Stack(torch.ops.shapewise_test_layout.wider)
    fast = sw.compile(model, sizes=[3], splitting_ops=[WIDER], backend="inductor", cache=False)
    with torch.no_grad(), pytest.raises(ShapewiseError, match=r"compiled for shape \(3, 8\), got shape \(3, 9\).*"
                                                              r"register_fake"):
        fast(torch.randn(3, 8))


def test_pieces_calling_other_ops_and_explicit_options_keep_the_asserts():
    model = Stack(torch.ops.shapewise_test_layout.colmajor)  # colmajor inside a piece: its fake is not trusted
    fast = sw.compile(model, sizes=[3], backend="inductor", cache=False)
    kept = sw.compile(Stack(torch.relu), sizes=[3], backend="inductor", cache=False,
                      static_options={"size_asserts": True})
    with torch.no_grad():
        x = torch.randn(3, 8)
        with pytest.raises(Exception, match="stride"):  # Inductor's own assert catches the fake's lie
            fast(x)
        assert_same(kept(x), kept.model(x))
    assert [r["size_asserts"] for r in fast.report()] == [True]
    assert [r["size_asserts"] for r in kept.report()] == [True]
