"""Training per size: one Dynamo trace, per size a compiled forward and backward (each piece
through AOTAutograd), splitting ops with autograd formulas run eagerly between pieces, and
gradients match eager at every size."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shapewise as sw
from shapewise._compat import backward_source, compiled_backward, compiled_source, dynamo_unique_graphs
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer
from tests.helpers import assert_same

# Dynamo names size symbols s<N>; Inductor's kernels take them as ks<N>.
SYMBOLIC = re.compile(r"\b(k?s\d+|u\d+)\b")


def grads_of(model: nn.Module, call: Callable, args: Sequence, loss_fn: Callable) -> tuple:
    """Loss, ``model``'s parameter grads and the input grads of ``loss_fn(call(*args)).backward()``
    (``call``: the model or its compiled version; grads cleared first, inputs fresh leaves)."""
    model.zero_grad(set_to_none=True)
    args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    loss = loss_fn(call(*args))
    loss.backward()
    params = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    inputs = [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return loss.detach(), params, inputs


def assert_grads_match(model: nn.Module, fast: Callable, args: Sequence, loss_fn: Callable, what: str) -> None:
    """The compiled model's loss and gradients (parameters and inputs) equal eager's."""
    loss, params, inputs = grads_of(model, fast, args, loss_fn)
    ref_loss, ref_params, ref_inputs = grads_of(model, model, args, loss_fn)
    assert_same(loss, ref_loss, f"{what} loss")
    assert params.keys() == ref_params.keys()
    for name, g in params.items():
        assert g is not None, f"{what}: no gradient reached {name}"
        assert_same(g, ref_params[name], f"{what} grad {name}")
    assert_same(inputs, ref_inputs, f"{what} input grads")


def assert_backward_compiled_per_variant(runnable: sw.Runnable) -> None:
    """Every variant of every compute piece is a training artifact whose backward was compiled
    with its forward (not lazily on the first backward call)."""
    for piece in runnable.program.compute_pieces:
        for v in piece.variants:
            assert compiled_backward(v.compiled) is not None, f"{piece.name} {v.binding}: no compiled backward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mlp_grads_match_eager_at_every_size(dtype):
    model = MLP().to(dtype)
    fast = sw.compile(model, sizes=[1, 2, 5, 8], ranges=[(9, 32)], backend="aot_eager")
    for n in (5, 1, 2, 8, 9, 20, 32):
        x = torch.randn(n, 32, dtype=dtype, requires_grad=n % 2 == 0)  # input grads too, at some sizes
        assert_grads_match(model, fast, (x,), lambda y: y.square().mean(), f"n={n}")
    assert dynamo_unique_graphs() == 2  # requires_grad of the input is guarded: one trace per setting
    assert fast.traces == 2
    for runnable in fast.runnables:
        assert_backward_compiled_per_variant(runnable)


def test_training_is_traced_once_for_every_size():
    model = ToyTransformer(layers=2)
    fast = sw.compile(model, sizes=[1, 2, 4, 16], ranges=[(17, 64)], splitting_ops=[ATTENTION_OP],
                      backend="aot_eager")
    for n in (16, 1, 2, 4, 17, 50, 64, 1):
        logits = fast(torch.randint(0, 64, (n,)))
        assert logits.requires_grad
        logits.square().mean().backward()
    assert dynamo_unique_graphs() == 1
    assert fast.traces == 1
    assert len(fast.report()) == 3 * 5  # 3 compute pieces x (4 sizes + 1 range), each forward + backward
    assert_backward_compiled_per_variant(fast.runnable)


def test_toy_transformer_split_at_attention_with_autograd_formula():
    model = ToyTransformer(layers=2)
    fast = sw.compile(model, sizes=[1, 3, 16], ranges=[(17, 40)], splitting_ops=[ATTENTION_OP], backend="aot_eager")
    for n in (16, 1, 3, 17, 40):
        ids = torch.randint(0, 64, (n,))
        assert_grads_match(model, fast, (ids,), lambda logits: logits.log_softmax(-1).mean(), f"n={n}")
    assert [p.is_splitting for p in fast.program.pieces] == [False, True, False, True, False]
    splitting = [p for p in fast.program.pieces if p.is_splitting]
    assert all(not p.variants for p in splitting)  # run as they are: eager, with their autograd formula
    # The attention op's backward is what carries gradient into q/k/v: nonzero grads before it.
    _, params, _ = grads_of(model, fast, (torch.randint(0, 64, (16,)),), lambda lg: lg.log_softmax(-1).mean())
    assert params["blocks.0.qkv.weight"].abs().sum() > 0
    assert dynamo_unique_graphs() == 1


class LossInside(nn.Module):
    """A causal LM that returns (logits, loss): two outputs, the loss computed in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = ToyTransformer(layers=1)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm(ids)
        return logits, F.cross_entropy(logits, targets)


def test_two_outputs_and_a_loss_inside_the_graph():
    model = LossInside()
    fast = sw.compile(model, sizes=[2, 8], ranges=[(9, 24)], splitting_ops=[ATTENTION_OP], backend="aot_eager")
    for n in (8, 2, 9, 24):
        ids, targets = torch.randint(0, 64, (n,)), torch.randint(0, 64, (n,))
        # backward through both outputs: the loss and a term of the logits
        assert_grads_match(model, fast, (ids, targets), lambda out: out[1] + 0.1 * out[0].mean(), f"n={n}")
    assert dynamo_unique_graphs() == 1


class Aliasing(nn.Module):
    """Outputs that alias the input and an intermediate; the input requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.proj(x)
        heads = h.view(-1, 2, 4)
        a = torch.ops.shapewise_toy.attention(heads, heads, heads)
        return x.view(-1), h.t(), a.flatten(1)


def test_outputs_aliasing_inputs_and_intermediates():
    model = Aliasing()
    fast = sw.compile(model, sizes=[1, 3, 6], splitting_ops=[ATTENTION_OP], backend="aot_eager")
    for n in (3, 1, 6):
        x = torch.randn(n, 8, requires_grad=True)
        out = fast(x)
        assert out[0]._base is x  # still a view of the caller's tensor
        assert_grads_match(model, fast, (x,), lambda o: o[0].sum() + o[1].square().sum() + o[2].sin().sum(), f"n={n}")
    assert dynamo_unique_graphs() == 1


def test_optimizer_steps_at_changing_sizes_match_eager():
    model = ToyTransformer(layers=1)
    ref = copy.deepcopy(model)
    fast = sw.compile(model, sizes=[4, 8, 12], splitting_ops=[ATTENTION_OP], backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for n in (8, 4, 12, 8, 4, 12):
        ids = torch.randint(0, 64, (n + 1,))
        for m, o in ((fast, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = F.cross_entropy(m(ids[:-1]), ids[1:])
            loss.backward()
            o.step()
        losses.append(loss.item())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_same(p.detach(), q.detach(), f"n={n} {name} after the step")
    assert fast.traces == 1 and dynamo_unique_graphs() == 1


def test_train_then_eval_then_train_retraces_with_dynamic_sizes():
    # Dynamo guards on grad mode: eval under no_grad re-traces. That trace must get the same
    # dynamic sizes as the first (it used to arrive static: "no symbolic sizes").
    model = ToyTransformer(layers=1)
    fast = sw.compile(model, sizes=[1, 4, 8], splitting_ops=[ATTENTION_OP], backend="aot_eager")
    ids = torch.randint(0, 64, (4,))
    assert_grads_match(model, fast, (ids,), lambda logits: logits.mean(), "train n=4")
    with torch.no_grad():
        for n in (8, 1, 4):
            ids = torch.randint(0, 64, (n,))
            out = fast(ids)
            assert out.grad_fn is None
            assert_same(out, model(ids), f"eval n={n}")
    ids = torch.randint(0, 64, (8,))
    assert_grads_match(model, fast, (ids,), lambda logits: logits.mean(), "train n=8")
    assert fast.traces == 2 and dynamo_unique_graphs() == 2
    train, evaluate = fast.runnables
    assert [r["key"] for r in evaluate.report()] == [r["key"] for r in train.report()]
    piece = evaluate.program.compute_pieces[0]
    assert all(compiled_backward(v.compiled) is None for v in piece.variants)  # inference graphs
    assert_backward_compiled_per_variant(train)


@pytest.mark.inductor
def test_inductor_static_backward_per_size_has_no_symbolic_sizes():
    model = ToyTransformer(layers=1)
    fast = sw.compile(model, sizes=[1, 8], ranges=[(9, 16)], splitting_ops=[ATTENTION_OP], backend="inductor")
    for n in (8, 1, 13):
        ids = torch.randint(0, 64, (n,))
        assert_grads_match(model, fast, (ids,), lambda logits: logits.log_softmax(-1).mean(), f"n={n}")
    assert dynamo_unique_graphs() == 1
    seen_static = seen_range = 0
    for piece in fast.program.compute_pieces:
        for v in piece.variants:
            bw = backward_source(v.compiled)
            assert bw, f"{piece.name} {v.binding}: no generated backward code"
            both = compiled_source(v.compiled)
            assert bw in both and len(both) > len(bw)  # the forward's code is there too
            found = set(SYMBOLIC.findall(bw))
            if v.binding.is_static:
                assert not found, f"{piece.name} {v.binding}: symbolic sizes {found} in static backward code"
                assert not SYMBOLIC.findall(both), f"{piece.name} {v.binding}: symbolic sizes in static forward"
                seen_static += 1
            else:
                assert found, f"{piece.name} {v.binding}: range backward has no symbolic size (test cannot fail?)"
                seen_range += 1
    assert (seen_static, seen_range) == (2 * 2, 2)


class _SeqNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(self.norm(x))


@pytest.mark.inductor
def test_inductor_range_backward_where_a_saved_stride_varies_with_the_size():
    # x [2, T, 32] is saved for LayerNorm's backward; its stride 32*T varies with T. The range
    # variant's backward asserted the strides of the range's trace value (AOTAutograd restrides
    # saved activations to them when size-oblivious reasoning is on): every other T failed.
    model = _SeqNorm()
    fast = sw.compile(model, dynamic_dims={"x": 1}, sizes=[12], ranges=[(13, 16)], backend="inductor", cache=False)
    for t in (16, 12, 13, 15):
        assert_grads_match(model, fast, (torch.randn(2, t, 32, requires_grad=True),), lambda y: y.square().mean(),
                           f"T={t}")
    assert_backward_compiled_per_variant(fast.runnable)


class _ShiftedLoss(nn.Module):
    """A causal-LM loss as transformers writes it: labels padded with -100 and shifted by one.
    Under fake tensors the pad of an int64 [2, T] tensor read T as an int: the range
    observation specialised T to its hint, and the range variant was compiled static at it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.lin = nn.Linear(32, 64)

    def forward(self, ids, labels):
        logits = self.lin(self.emb(ids))
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.reshape(-1, 64), shifted.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_range_training_with_a_fixed_batch_is_symbolic_in_forward_and_backward(backend):
    model = _ShiftedLoss()
    fast = sw.compile(model, dynamic_dims={"ids": 1, "labels": 1}, sizes=[8], ranges=[(17, 64)], backend=backend,
                      cache=False)
    for t in (8, 40, 17, 64):
        ids = torch.randint(0, 64, (2, t))
        assert_grads_match(model, fast, (ids, ids), lambda loss: loss, f"T={t}")
    assert fast.traces == 1
    assert_backward_compiled_per_variant(fast.runnable)
    if backend == "inductor":
        for piece in fast.program.compute_pieces:
            for v in piece.variants:
                fw, bw = compiled_source(v.compiled), backward_source(v.compiled)
                assert bw and bw in fw
                if v.binding.is_static:
                    assert not SYMBOLIC.findall(fw), f"{piece.name} {v.binding}: symbolic sizes in static code"
                else:
                    assert SYMBOLIC.findall(fw.replace(bw, "")), f"{piece.name} {v.binding}: static range forward"
                    assert SYMBOLIC.findall(bw), f"{piece.name} {v.binding}: static range backward"


def test_a_compile_that_specialises_a_ranged_size_is_caught():
    import sympy

    from shapewise._compat import range_guard_violations, symbolic_env

    mode, new = symbolic_env({"s": (17, 64, 32)})
    (s,) = new.values()
    assert range_guard_violations(mode) == []
    mode.shape_env.evaluate_expr(sympy.Eq(s, 32))  # as a fake kernel does when it reads a size as an int
    assert any("fixed to 32" in b for b in range_guard_violations(mode))


class _LearnedMaskAttention(nn.Module):
    """T5's learned position bias as SDPA's float mask: on CPU, SDPA lays its output out
    otherwise when the mask needs grad, so the piece after it must be compiled for that."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 4, 1, 1))

    def forward(self, x):  # x: [B, T, 4, 8]
        q = x.transpose(1, 2)
        mask = self.bias.expand(1, 4, x.shape[1], x.shape[1])
        o = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return o.transpose(1, 2).contiguous().view(x.shape[0], x.shape[1], -1)


@pytest.mark.parametrize("grad", [True, False])
def test_layouts_are_observed_in_the_grad_mode_of_the_call(grad):
    model = _LearnedMaskAttention()
    fast = sw.compile(model, dynamic_dims={"x": 1}, sizes=[8], ranges=[(9, 16)], splitting_ops=["sdpa"],
                      backend="aot_eager")
    with torch.set_grad_enabled(grad):
        for t in (8, 12):
            x = torch.randn(2, t, 4, 8)
            if grad:
                assert_grads_match(model, fast, (x,), lambda y: y.square().mean(), f"T={t}")
            else:
                assert_same(fast(x), model(x), f"T={t}")
