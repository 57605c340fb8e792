"""Rewrite: graph passes per (piece, variant), gated by sizes (a range's as its (low, high));
visible in the report and the printer, checked by Verify, part of the content key; rewritten
variants run forward and backward in training; Inductor post-grad passes the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.fx import subgraph_rewriter

import shapewise as sw
from shapewise._compat import no_inductor_caches
from shapewise.lower import Lower
from shapewise.models import ATTENTION_OP
from tests.helpers import assert_before_after, assert_same, dynamo_graph, graph_args


def model(x, w):
    q = (x @ w).view(x.shape[0], 2, 8)
    a = torch.ops.shapewise_toy.attention(q, q, q).reshape(x.shape[0], 16)
    return torch.relu(a @ w) + 1


def _relu(x):
    return torch.relu(x)


def _clamp(x):
    return torch.clamp_min(x, 0.0)


@dataclass(frozen=True)
class ReluToClamp(sw.GraphPass):
    """relu -> clamp_min(x, 0) at sizes up to ``limit`` (the same function: a visible rewrite)."""

    name: ClassVar[str] = "relu_to_clamp"
    limit: int = 2

    def applies(self, sizes):
        return all(isinstance(v, int) and v <= self.limit for v in sizes.values())

    def rewrite(self, gm, sizes):
        return sw.PassResult(gm, bool(subgraph_rewriter.replace_pattern(gm, _relu, _clamp)))


@dataclass(frozen=True)
class DropRelu(ReluToClamp):
    """A wrong rewrite (relu removed) at small sizes: Verify must catch it. Returns the bare graph
    (the form without ``PassResult``: modified where its code differs)."""

    name: ClassVar[str] = "drop_relu"

    def rewrite(self, gm, sizes):
        subgraph_rewriter.replace_pattern(gm, _relu, lambda x: x * 1.0)
        return gm


def _targets(gm):
    return {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"}


RELU_PLUS_ONE = """
    def forward(self, l_x_):
        relu = torch.relu(l_x_)
        add = relu + 1
        return (add,)
"""


def test_the_rewrite_turns_relu_into_clamp_where_it_applies_and_nowhere_else():
    gm = dynamo_graph(lambda x: torch.relu(x) + 1, torch.randn(4, 3))
    out = assert_before_after(ReluToClamp(limit=2), sw.Concretize(sizes=[2])(gm), RELU_PLUS_ONE, """
        def forward(self, l_x_):
            clamp_min = torch.clamp_min(l_x_, 0.0)
            add = clamp_min + 1
            return (add,)
    """)
    x = torch.randn(2, 3)
    assert_same(out.compute_pieces[0].variants[0].gm(x)[0], torch.relu(x) + 1)
    same = assert_before_after(ReluToClamp(limit=2), sw.Concretize(sizes=[4])(gm), RELU_PLUS_ONE, RELU_PLUS_ONE)
    assert same.compute_pieces[0].variants[0].gm is None  # not applied: the piece's graph, shared


def test_a_pass_rewrites_only_the_variants_it_applies_to_and_answers_stay_right():
    w = torch.randn(16, 16)
    fast = sw.compile(model, sizes=[1, 2, 4, 8], ranges=[(9, 32)], splitting_ops=[ATTENTION_OP], backend="aot_eager",
                      dynamic_dims={"x": 0}, graph_passes=[ReluToClamp(limit=2)])
    for n in (1, 2, 4, 8, 9, 20, 32):
        x = torch.randn(n, 16)
        assert_same(fast(x, w), model(x, w), f"n={n}")
    last = fast.program.compute_pieces[-1]
    for v in last.variants:
        small = v.binding.is_static and v.binding.key[0] <= 2
        assert (v.gm is not None) == small, v.binding
        if small:
            assert "clamp_min" in _targets(v.gm) and "relu" not in _targets(v.gm)
            assert v.passes and "relu_to_clamp{limit=2}@1" in v.passes[0]
    assert "relu" in _targets(last.gm)  # the piece's own graph is untouched
    rows = [r for r in fast.report() if r["piece"] == last.name]
    assert [r["passes"] for r in rows] == ["relu_to_clamp{limit=2}"] * 2 + [""] * 3
    text = str(fast.program)
    assert "rewritten by relu_to_clamp{limit=2} (its graph below)" in text and "clamp_min" in text
    # the first piece has no relu: no variant of it was copied
    assert all(v.gm is None for v in fast.program.compute_pieces[0].variants)


def test_the_pipeline_form_printafter_and_verify_see_rewritten_variants():
    w = torch.randn(16, 16)
    gm = dynamo_graph(model, torch.randn(4, 16), w)
    printed: list[str] = []
    verify = sw.Verify(passes=("rewrite",))
    sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(sizes=[2, 4]), sw.Rewrite(passes=[DropRelu(limit=2)]),
                 sw.Lower(backend="aot_eager")],
                instruments=[sw.PrintAfter(passes=("rewrite",), out=printed.append), verify]).run(gm)
    assert len(printed) == 1 and "rewrite{passes=drop_relu}" in printed[0] and "mul" in printed[0]
    # The wrong rewrite applies at size 2 only: Verify flags size 2 and passes size 4.
    assert [r["ok"] for r in verify.rows] == [False, True], verify.rows


def test_content_keys_tell_rewritten_variants_apart():
    w = torch.randn(16, 16)
    gm = dynamo_graph(model, torch.randn(4, 16), w)
    program = sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(sizes=[2])])(gm)
    piece = program.compute_pieces[-1]
    plain = piece.variants[0]
    rewritten = sw.Rewrite(passes=[ReluToClamp()])(program).compute_pieces[-1].variants[0]
    same_graph = type(plain)(plain.binding, plain.example_args, passes=("some.Pass:x@1",))
    session = Lower(backend="aot_eager").session()
    keys = {session.variant_key(piece, v)[0] for v in (plain, same_graph)}
    keys.add(session.variant_key(piece.as_compiled_for(rewritten), rewritten)[0])
    assert len(keys) == 3  # a pass, even one that changed nothing, never shares an artifact without it


@dataclass(frozen=True)
class NeedsOptions(ReluToClamp):
    """A rewrite whose graph asks Inductor for some config."""

    name: ClassVar[str] = "needs_options"

    def inductor_options(self):
        return {"size_asserts": True, "max_autotune": False}


def test_a_pass_s_inductor_options_apply_where_it_rewrote_under_the_user_s_own():
    w = torch.randn(16, 16)
    gm = dynamo_graph(model, torch.randn(4, 16), w)
    program = sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(sizes=[2, 4]),
                           sw.Rewrite(passes=[NeedsOptions(limit=2)])])(gm)
    piece = program.compute_pieces[-1]
    at2, at4 = piece.variants
    assert dict(at2.inductor_options) == {"size_asserts": True, "max_autotune": False} and not at4.inductor_options
    session = Lower(static_options={"max_autotune": True}).session()
    assert session.options(piece.as_compiled_for(at2), at2) == {"size_asserts": True, "max_autotune": True}
    assert "size_asserts" not in session.options(piece, at4) or session.options(piece, at4)["size_asserts"] is False
    # The options are part of the variant's content key.
    plain = type(at2)(at2.binding, at2.example_args, gm=at2.gm, passes=at2.passes)
    assert session.variant_key(piece.as_compiled_for(at2), at2)[0] != \
        session.variant_key(piece.as_compiled_for(plain), plain)[0]


@pytest.mark.parametrize("bad, fragment", [
    (lambda gm, sizes: 1 / 0, "raised ZeroDivisionError"),
    (lambda gm, sizes: None, "returned NoneType"),
])
def test_a_broken_pass_names_itself_the_piece_and_the_sizes(bad, fragment):
    @dataclass(frozen=True)
    class Broken(sw.GraphPass):
        name: ClassVar[str] = "broken"

        def rewrite(self, gm, sizes):
            return bad(gm, sizes)

    fast = sw.compile(model, sizes=[2], splitting_ops=[ATTENTION_OP], backend="aot_eager", dynamic_dims={"x": 0},
                      graph_passes=[Broken()])
    with pytest.raises(sw.ShapewiseError, match=rf"graph pass broken on piece_0 at sizes \{{'n': 2\}} {fragment}"):
        fast(torch.randn(2, 16), torch.randn(16, 16))


def test_a_pass_that_changes_the_inputs_is_refused():
    @dataclass(frozen=True)
    class AddsInput(sw.GraphPass):
        name: ClassVar[str] = "adds_input"

        def rewrite(self, gm, sizes):
            first = next(n for n in gm.graph.nodes if n.op == "placeholder")
            with gm.graph.inserting_before(first):
                gm.graph.placeholder("extra")
            return gm

    fast = sw.compile(model, sizes=[2], splitting_ops=[ATTENTION_OP], backend="aot_eager", dynamic_dims={"x": 0},
                      graph_passes=[AddsInput()])
    with pytest.raises(sw.ShapewiseError, match="changed the graph's inputs"):
        fast(torch.randn(2, 16), torch.randn(16, 16))
    with pytest.raises(sw.ConfigError, match="takes sw.GraphPass objects"):
        sw.Rewrite(passes=[lambda gm: gm])


@dataclass(frozen=True)
class CountAdds(sw.InductorPass):
    """Counts the add nodes Inductor's post-grad graph has, per call (the graph is left as is)."""

    name: ClassVar[str] = "count_adds"
    seen: list = None  # type: ignore[assignment] - a shared list, not part of the spec

    def applies(self, sizes):
        return all(isinstance(v, int) and v <= 2 for v in sizes.values())

    def rewrite(self, graph):
        self.seen.append(sum(1 for n in graph.nodes if "add" in str(n.target)))

    def spec(self):
        return self.name


@pytest.mark.inductor
def test_inductor_passes_run_only_for_the_variants_they_apply_to():
    # Inductor's own caches would serve an earlier run's graph without running the pass (its
    # uuid is in their keys, so that is right; here the pass must run to be counted).
    with no_inductor_caches():
        _inductor_passes_run_only_for_the_variants_they_apply_to()


def _inductor_passes_run_only_for_the_variants_they_apply_to():
    seen: list[int] = []
    w = torch.randn(16, 16)
    fast = sw.compile(model, sizes=[2, 4], splitting_ops=[ATTENTION_OP], backend="inductor", dynamic_dims={"x": 0},
                      inductor_passes=[CountAdds(seen=seen)], cache=False)
    with torch.no_grad():
        for n in (2, 4):
            x = torch.randn(n, 16)
            assert_same(fast(x, w), model(x, w), f"n={n}")
    compute = len(fast.program.compute_pieces)
    assert len(seen) == compute  # once per piece at size 2, never at 4
    assert any(c > 0 for c in seen)
    rows = fast.report()
    assert {r["passes"] for r in rows if r["key"] == "{n=2}"} == {"count_adds"}
    assert {r["passes"] for r in rows if r["key"] == "{n=4}"} == {""}
    with pytest.raises(sw.ConfigError, match="run inside Inductor"):
        sw.compile(model, sizes=[2], splitting_ops=[ATTENTION_OP], backend="aot_eager", dynamic_dims={"x": 0},
                   inductor_passes=[CountAdds(seen=[])])(torch.randn(2, 16), w)


def test_graph_args_helper_still_matches_this_model():
    # The pipeline test above relies on it: the model's graph reads x, then w.
    w = torch.randn(16, 16)
    gm = dynamo_graph(model, torch.randn(4, 16), w)
    assert len(graph_args(gm, torch.randn(4, 16), w)) == sum(1 for n in gm.graph.nodes if n.op == "placeholder")


def test_the_on_miss_variant_is_rewritten_too_and_fixed_dims_reach_the_pass():
    seen: list[dict] = []

    @dataclass(frozen=True)
    class Record(ReluToClamp):
        name: ClassVar[str] = "record"

        def applies(self, sizes):
            seen.append(dict(sizes))
            return True

    w = torch.randn(16, 16)
    fast = sw.compile(model, sizes=[4], splitting_ops=[ATTENTION_OP], backend="aot_eager", dynamic_dims={"x": 0},
                      graph_passes=[Record()], on_miss="dynamic")
    for n in (4, 6):
        x = torch.randn(n, 16)
        assert_same(fast(x, w), model(x, w), f"n={n}")
    rows = [r for r in fast.report() if r["piece"] == fast.program.compute_pieces[-1].name]
    assert {r["key"]: r["passes"] for r in rows} == {"{n=4}": "record{limit=2}",
                                                      "general (on_miss='dynamic')": "record{limit=2}"}
    assert {"n": 4} in seen

    # A decode trace fixes the dim: the pass still sees its size.
    gm = dynamo_graph(model, torch.randn(4, 16), w)
    program = sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(sizes=[4])])(gm)
    seen.clear()
    sw.Rewrite(passes=[Record()])(program.replace(fixed_sizes={"seq": 1}))
    assert all(s.get("seq") == 1 for s in seen) and seen


def test_rewrite_after_lower_is_refused():
    w = torch.randn(16, 16)
    gm = dynamo_graph(model, torch.randn(4, 16), w)
    for late in (sw.Rewrite(passes=[ReluToClamp()]), ReluToClamp()):
        with pytest.raises(sw.ConfigError, match=r"graph passes run before Lower: .* put relu_to_clamp|"
                                                 r"graph passes run before Lower: .* put rewrite\{passes=relu"):
            sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(sizes=[4]), sw.Lower(backend="aot_eager"),
                         late]).run(gm)


# -- a value-preserving rewrite whose every run is counted --------------------------------------------
# relu as two custom ops that count their calls by the token count (the forward, and its backward
# as an op of its own, so that AOTAutograd keeps it a call in the backward graph rather than
# tracing its body away): a rewritten variant that really runs says so, at run time.
CALLS: dict[str, list[int]] = {"forward": [], "backward": []}


@torch.library.custom_op("shapewise_test::counted_relu", mutates_args=())
def counted_relu(x: torch.Tensor) -> torch.Tensor:
    CALLS["forward"].append(x.shape[0])
    return torch.relu(x)


@counted_relu.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("shapewise_test::counted_relu_backward", mutates_args=())
def counted_relu_backward(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    CALLS["backward"].append(grad.shape[0])
    return grad * (out > 0)


@counted_relu_backward.register_fake
def _(grad, out):
    return torch.empty_like(grad)


def _counted_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _counted_grad(ctx, grad):
    (out,) = ctx.saved_tensors
    return torch.ops.shapewise_test.counted_relu_backward(grad, out)


counted_relu.register_autograd(_counted_grad, setup_context=_counted_setup)


def _counted(x):
    return torch.ops.shapewise_test.counted_relu(x)


def _calls() -> dict[str, list[int]]:
    """The counted calls so far, and a fresh count."""
    out = {k: list(v) for k, v in CALLS.items()}
    for v in CALLS.values():
        v.clear()
    return out


@dataclass(frozen=True)
class CountedRelu(ReluToClamp):
    """relu -> shapewise_test::counted_relu at static sizes up to ``limit``."""

    name: ClassVar[str] = "counted_relu"

    def rewrite(self, gm, sizes):
        subgraph_rewriter.replace_pattern(gm, _relu, _counted)
        return gm


def test_a_pass_on_a_range_variant_sees_the_range_and_its_rewrite_serves_every_size_in_it():
    seen: list[dict] = []

    @dataclass(frozen=True)
    class OnShortRanges(CountedRelu):
        """Only on range variants that end at ``limit`` or below."""

        name: ClassVar[str] = "on_short_ranges"
        limit: int = 16

        def applies(self, sizes):
            seen.append(dict(sizes))
            return all(isinstance(v, tuple) and v[1] <= self.limit for v in sizes.values())

    w = torch.randn(16, 16)
    fast = sw.compile(model, sizes=[4], ranges=[(9, 16), (17, 32)], splitting_ops=[ATTENTION_OP], backend="aot_eager",
                      dynamic_dims={"x": 0}, graph_passes=[OnShortRanges()])
    _calls()
    for n in (9, 12, 16, 4, 17, 25, 32):
        x = torch.randn(n, 16)
        assert_same(fast(x, w), model(x, w), f"n={n}")
    # Asked once per (compute piece, variant), a range as its (low, high).
    pieces = len(fast.program.compute_pieces)
    assert sorted(map(str, seen)) == sorted(map(str, [{"n": 4}, {"n": (9, 16)}, {"n": (17, 32)}] * pieces))
    # The rewritten range variant is what ran at every size inside its range, and only there.
    assert _calls() == {"forward": [9, 12, 16], "backward": []}
    last = fast.program.compute_pieces[-1]
    assert {v.binding.describe(last.shapes.names): v.gm is not None for v in last.variants} == {
        "{n=4}": False, "{n=9..16}": True, "{n=17..32}": False}
    rows = {r["key"]: r["passes"] for r in fast.report() if r["piece"] == last.name}
    assert rows == {"{n=4}": "", "{n=9..16}": "on_short_ranges{limit=16}", "{n=17..32}": ""}, rows
    assert not any(r["passes"] for r in fast.report() if r["piece"] != last.name)  # no relu there


class ReluNet(nn.Module):
    """Linear, attention (the splitting op), relu, linear: parameters on both sides of the split."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        q = self.inp(x).view(x.shape[0], 2, 8)
        a = torch.ops.shapewise_toy.attention(q, q, q).reshape(x.shape[0], 16)
        return self.out(torch.relu(a))


def _grads(net: nn.Module, call, x: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Loss, parameter grads and input grad of ``call(x).square().mean().backward()``."""
    net.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    loss = call(x).square().mean()
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in net.named_parameters()}, x.grad


def test_passes_under_training_forward_and_backward_equal_eager_where_they_apply_and_elsewhere():
    torch.manual_seed(0)
    net = ReluNet()
    fast = sw.compile(net, sizes=[1, 2, 8], ranges=[(9, 16)], splitting_ops=[ATTENTION_OP], backend="aot_eager",
                      graph_passes=[CountedRelu(limit=2)])
    _calls()
    for n in (2, 8, 1, 12, 16, 2):
        x = torch.randn(n, 16)
        loss, params, x_grad = _grads(net, fast, x)
        ran = _calls()
        # the rewritten forward, and the backward AOTAutograd derived from it, ran exactly at the
        # sizes the pass applies to
        assert ran == ({"forward": [n], "backward": [n]} if n <= 2 else {"forward": [], "backward": []}), (n, ran)
        ref_loss, ref_params, ref_x_grad = _grads(net, net, x)
        assert _calls() == {"forward": [], "backward": []}  # eager never sees the custom op
        assert_same(loss, ref_loss, f"n={n} loss")
        assert params.keys() == ref_params.keys() and all(g is not None for g in params.values())
        for name, g in params.items():
            assert_same(g, ref_params[name], f"n={n} grad {name}")
        assert_same(x_grad, ref_x_grad, f"n={n} input grad")
    assert fast.traces == 1
    rows = {r["key"]: r["passes"] for r in fast.report() if r["piece"] == fast.program.compute_pieces[-1].name}
    rewritten = "counted_relu{limit=2}"
    assert rows == {"{n=1}": rewritten, "{n=2}": rewritten, "{n=8}": "", "{n=9..16}": ""}, rows
