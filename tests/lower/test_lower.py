"""Lower: a compile that fails names the piece, the binding and the cause (or falls back to eager
for that variant only, with the error in the report); a failed Inductor compile leaves nothing
in the cache; a piece that reads a tensor's value compiles; a range whose compile holds on part of
it only compiles part by part."""

from __future__ import annotations

import copy

import pytest
import torch

import shapewise as sw
from shapewise.lower.cache import ArtifactCache
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer
from tests.helpers import assert_same


def _fails_for(n: int, piece_has: str):
    """A backend that raises for one size, in the piece whose code mentions ``piece_has``."""

    def backend(gm, example_inputs):
        sizes = [a.shape[0] for a in example_inputs if isinstance(a, torch.Tensor) and a.dim() > 0]
        if piece_has in gm.code and any(isinstance(s, int) and s == n for s in sizes):
            raise RuntimeError(f"backend exploded at size {n}")
        return gm.forward

    backend.__name__ = "flaky"
    return backend


def test_a_failing_compile_names_the_piece_the_binding_and_the_cause():
    model = ToyTransformer(layers=1)
    fast = sw.compile(model, sizes=[2, 4], ranges=[(5, 16)], splitting_ops=[ATTENTION_OP],
                      backend=_fails_for(4, "embedding"))
    with pytest.raises(sw.CompileError, match=r"compiling piece_0 for \{n=4\} with backend 'flaky' failed: "
                                              r"RuntimeError: backend exploded at size 4") as err:
        fast(torch.randint(0, 64, (2,)))
    assert isinstance(err.value.__cause__, RuntimeError)


def test_fallback_runs_the_failed_variant_eagerly_and_the_rest_compiled():
    model = ToyTransformer(layers=1)
    fast = sw.compile(model, sizes=[2, 4], ranges=[(5, 16)], splitting_ops=[ATTENTION_OP],
                      backend=_fails_for(4, "embedding"), on_compile_error="fallback")
    for n in (2, 4, 5, 16):
        ids = torch.randint(0, 64, (n,))
        assert_same(fast(ids), model(ids), f"n={n}")
    rows = {(r["piece"], r["key"]): r for r in fast.report()}
    assert len(rows) == 2 * 3
    bad = rows[("piece_0", "{n=4}")]
    assert bad["source"] == "fallback" and bad["error"] == "RuntimeError: backend exploded at size 4"
    others = [r for k, r in rows.items() if k != ("piece_0", "{n=4}")]
    assert all(r["source"] == "compiled" and "error" not in r for r in others)
    assert fast.traces == 1


@pytest.mark.inductor
def test_a_failed_inductor_compile_leaves_nothing_in_the_cache(tmp_path):
    # Range variants get an Inductor option that does not exist: their compiles fail (and fall
    # back to eager), the static ones compile and are stored. The cache then holds exactly the
    # static artifacts, each whole, and no temporary file.
    model = MLP()
    fast = sw.compile(model, sizes=[2, 4], ranges=[(5, 16)], backend="inductor", cache=str(tmp_path),
                      range_options={"no_such_inductor_option": True}, on_compile_error="fallback")
    with torch.no_grad():
        for n in (2, 4, 9):
            x = torch.randn(n, 32)
            assert_same(fast(x), model(x), f"n={n}")
    rows = fast.report()
    assert [r["source"] for r in rows] == ["compiled", "compiled", "fallback"]
    assert "no_such_inductor_option" in rows[2]["error"]
    cache = ArtifactCache(tmp_path)
    assert len(cache.keys()) == 2
    assert all(cache.load(k) is not None for k in cache.keys())
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith((".swa", ".lock"))]
    assert leftovers == []


class _ReadsAValue(torch.nn.Module):
    def forward(self, x):
        return x * x.sum().item()


def test_a_piece_that_reads_a_value_compiles_per_size():
    # .item() makes an unbacked value as the piece compiles, which needs a ShapeEnv: a static
    # compile gets one of its own (XLM's longest length, in the sweep). Right on fresh values.
    fast = sw.compile(_ReadsAValue(), sizes=[2, 4], backend="aot_eager")
    for n in (2, 4, 2):
        x = torch.randn(n, 8)
        assert_same(fast(x), _ReadsAValue()(x), f"n={n}")
    assert {r["source"] for r in fast.report()} == {"compiled"}
    fallback = sw.compile(_ReadsAValue(), sizes=[2, 4], backend=_fails_for(2, "item"), on_compile_error="fallback")
    for n in (2, 4):
        x = torch.randn(n, 8)
        assert_same(fallback(x), _ReadsAValue()(x), f"n={n}")
    assert sorted(r["source"] for r in fallback.report()) == ["compiled", "fallback"]


class _RoutedAcrossAttention(torch.nn.Module):
    """Split sizes read from a tensor's values (``.tolist()``, as JetMoE's expert counts) and used on both
    sides of an attention op: the piece after the split gets them as data-dependent inputs."""

    def forward(self, x, counts):
        sizes = counts.tolist()
        a, b = x.split(sizes)
        h = torch.cat([a * 2, b * 3]).view(x.shape[0], 2, 4)
        h = torch.ops.shapewise_toy.attention(h, h, h).reshape(x.shape)
        c, d = h.split(sizes)
        return torch.cat([c + 1, d.sin()])


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_sizes_read_from_values_before_a_split_compile_in_the_piece_after_it(backend):
    # The piece after the attention takes the two sizes the first piece read: they are data-dependent
    # in its compile too (what the compile assumes of them, sum == n, is checked when it runs, not
    # guarded at made-up values: JetMoE's "Split sizes add up to s44 + s51 + ... but got 24" before).
    # Right at every size and split of it.
    from shapewise.models import ATTENTION_OP

    model = _RoutedAcrossAttention()
    fast = sw.compile(model, sizes=[6, 9], splitting_ops=[ATTENTION_OP], backend=backend, cache=False,
                      progress=False)
    for n, first in ((6, 2), (9, 4), (6, 5), (9, 1)):
        x, counts = torch.randn(n, 8), torch.tensor([first, n - first])
        assert_same(fast(x, counts), model(x, counts), f"n={n}, split {first}")
    assert {r["source"] for r in fast.report()} == {"compiled"} and fast.traces == 1


def _specialising_backend(at: int, compiled: list):
    """A backend that decides ``n < at`` on its first input's size, as a compile may (Inductor and
    AOTAutograd's decompositions read sizes: mamba's ``(n // 8 - 1) // 2 == 1``), and returns code
    right only on that side: wrong answers if shapewise ran it past the guard it added."""

    def backend(gm, example_inputs):
        n = example_inputs[0].shape[0]
        below = bool(n < at)  # a guard in the range compile's ShapeEnv (a size only: no guard)
        compiled.append((n if isinstance(n, int) else str(n), below))

        def run(*args):
            out = gm(*args)
            wrong = (args[0].shape[0] < at) != below
            return tuple(o + 1000 for o in out) if wrong and isinstance(out, tuple) else out

        return run

    backend.__name__ = "specialising"
    return backend


def test_a_range_a_compile_holds_on_in_parts_is_compiled_part_by_part():
    # A range compile that assumes n < 40 at its hint serves 17..39; 40..64 compiles again (its
    # own compile assumes n >= 40): two compiles, right at every size, one variant in the table.
    compiled: list = []
    model = MLP()
    fast = sw.compile(model, ranges=[(17, 64)], backend=_specialising_backend(40, compiled))
    for n in (17, 33, 39, 40, 41, 64):
        x = torch.randn(n, 32)
        assert_same(fast(x), model(x), f"n={n}")
    assert sorted(b for _, b in compiled) == [False, True], compiled
    assert [r["key"] for r in fast.report()] == ["{n=17..64}"]


def test_a_range_that_would_take_too_many_parts_is_refused():
    # n even (a Mod guard) holds at one size in every two: more than MOST_PARTS compiles, refused
    # naming the guard, not compiled 24 times.
    def backend(gm, example_inputs):
        bool(example_inputs[0].shape[0] % 2 == 0)
        return gm.forward

    fast = sw.compile(MLP(), ranges=[(16, 40)], backend=backend)
    with pytest.raises(sw.CompileError, match="does not hold over the whole range"):
        fast(torch.randn(20, 32))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Regions(torch.nn.Module):
    """Three calls of one ``nested_compile_region``: Dynamo traces it once (an ``invoke_subgraph``
    call each) and hands it the batch size, a symbol in the trace."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.inductor
def test_nested_compile_regions_compile_static_at_each_size():
    # Inductor's compile from static example inputs passed the traced size to the region as a literal
    # and failed on it ("Expected Node with 'val' in meta"): every static variant of a model using
    # torch.compiler.nested_compile_region (a transformers MLP wrapped in one, through compile_generate,
    # failed the same way). The range compiles symbolic and always worked.
    torch.manual_seed(0)
    model = _Regions().eval()
    fast = sw.compile(model, sizes=[2, 4], ranges=[(5, 16)], cache=False, progress=False)
    with torch.no_grad():
        for n in (2, 4, 7):
            x = torch.randn(n, 16)
            assert_same(fast(x), model(x), f"n={n}")
    assert fast.traces == 1
    assert {r["key"]: r["source"] for r in fast.report()} == {"{n=2}": "compiled", "{n=4}": "compiled",
                                                              "{n=5..16}": "compiled"}
    # The region's copy with the size written in is shared by its three calls: one subgraph a size.
    traced = fast.program.pieces[0].gm
    inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    sizes = [isinstance(n.meta.get("val", n.meta.get("example_value")), torch.SymInt) for n in inputs]
    assert sizes.count(True) == 1
    gm = sw._compat.specialise_region_sizes(torch.fx.GraphModule(traced, copy.deepcopy(traced.graph)),
                                            [4 if is_size else None for is_size in sizes])
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 3 and len({n.args[0].target for n in calls}) == 1
    assert not any(inputs[sizes.index(True)].name == a.name for n in calls for a in n.args[2:]
                   if isinstance(a, torch.fx.Node))
