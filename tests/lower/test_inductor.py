"""Real Inductor (CPU C++ here, Triton on the GPU machine): static variants carry no symbolic
size in their generated code, range variants do, and every variant matches eager."""

from __future__ import annotations

import re

import pytest
import torch

import shapewise as sw
from shapewise._compat import compiled_source
from shapewise.models import ATTENTION_OP, ToyTransformer
from tests.helpers import assert_same

pytestmark = pytest.mark.inductor

# Dynamo names size symbols s<N>; Inductor's kernels take them as ks<N>.
SYMBOLIC = re.compile(r"\b(k?s\d+|u\d+)\b")


def symbols_in(fn) -> set[str]:
    src = compiled_source(fn)
    assert src, "Inductor kept no generated source for this variant"
    return set(SYMBOLIC.findall(src))


def test_static_variants_have_no_symbolic_sizes_and_ranges_do():
    model = ToyTransformer(layers=1, dim=32, hidden=64)
    fast = sw.compile(model, sizes=[1, 4], ranges=[(5, 64)], splitting_ops=[ATTENTION_OP], backend="inductor")
    with torch.no_grad():  # serving: inference graphs
        for n in (1, 4, 5, 37, 64):
            ids = torch.randint(0, 64, (n,))
            assert_same(fast(ids), model(ids), f"n={n}")
    assert fast.traces == 1
    seen_static = seen_range = 0
    for piece in fast.program.compute_pieces:
        for v in piece.variants:
            found = symbols_in(v.compiled)
            if v.binding.is_static:
                assert not found, f"{piece.name} {v.binding}: symbolic sizes {found} in static code"
                seen_static += 1
            else:
                assert found, f"{piece.name} {v.binding}: range variant has no symbolic size (test cannot fail?)"
                seen_range += 1
    assert seen_static == 2 * 2 and seen_range == 2


def test_static_options_reach_the_static_compile():
    def f(x):
        return torch.nn.functional.gelu(x @ x.t()).sum(0)

    # Static code checks its input layout with assert_size_stride(...) when size_asserts=True
    # (shapewise leaves them out by default, tests/lower/test_size_asserts.py): visible proof in
    # the generated code that the option reached the static compile.
    plain = sw.compile(f, sizes=[3], backend="inductor", static_options={"size_asserts": True})
    tuned = sw.compile(f, sizes=[3], ranges=[(4, 16)], backend="inductor", static_options={"size_asserts": False})
    with torch.no_grad():
        for n in (3, 9):
            x = torch.randn(n, 8)
            assert_same(tuned(x), f(x))
        plain(torch.randn(3, 8))
    assert "assert_size_stride(arg" in compiled_source(plain.program.pieces[0].variants[0].compiled)
    static, ranged = tuned.program.pieces[0].variants
    assert "assert_size_stride(arg" not in compiled_source(static.compiled)
    lower = tuned.program.lowering
    assert lower.options_for(static.binding) == {"size_asserts": False}
    assert lower.options_for(ranged.binding) == {}


def _halves_then_cumsum(x):
    y = torch.tanh(x[::2].cumsum(0))[:, ::2]  # over (1, 2), (n + 1) // 2 is 1: a range compile may rely on it
    q = y[:, None]
    out = torch.empty_like(q)
    torch.ops.shapewise_toy.attention_out(q, q, q, out)
    return out[:, 0] + 1


def test_two_ranges_of_one_graph_never_share_inductors_cached_code():
    # Regression (fuzzer): Inductor's FX graph cache keys a symbolic compile without its value
    # ranges, so the (8, 23) compile was served the (1, 2) code (sizes fixed to 1).
    fast = sw.compile(_halves_then_cumsum, ranges=[(1, 2), (8, 23)], splitting_ops=["shapewise_toy::attention_out"],
                      backend="inductor", cache=False)
    for n in (1, 2, 8, 15, 23):
        x = torch.randn(n, 12)
        assert_same(fast(x), _halves_then_cumsum(x), f"n={n}")
