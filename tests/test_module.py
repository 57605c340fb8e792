"""shapewise.compile (``shapewise/module.py``: ShapewiseModule), end to end (eager/aot_eager): one trace,
the sizes it serves, re-traces, and the errors a user sees. The torch.compile backend: test_backend.py."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shapewise as sw
from shapewise._compat import dynamo_unique_graphs
from shapewise.models import ATTENTION_OP, ATTENTION_OUT_OP, MLP, ToyTransformer
from shapewise.trace_limit import TraceLimit
from tests.helpers import PerRow, assert_same


@pytest.mark.parametrize("first", [1, 33])
def test_mlp_one_trace_every_size_size_one_included(first):
    model = MLP()
    fast = sw.compile(model, sizes=[1, 2, 4, 8], ranges=[(9, 64)], backend="aot_eager")
    for n in (first, 1, 2, 4, 8, 9, 33, 64):
        x = torch.randn(n, 32)
        assert_same(fast(x), model(x), f"n={n}")
    assert dynamo_unique_graphs() == 1  # torch's own count
    assert fast.traces == 1
    rows = fast.report()
    assert [r["key"] for r in rows] == ["{n=1}", "{n=2}", "{n=4}", "{n=8}", "{n=9..64}"]
    assert [r["static"] for r in rows] == [True] * 4 + [False]
    assert all(r["source"] == "compiled" and r["seconds"] > 0 for r in rows)  # each compile was timed


@pytest.mark.parametrize("op, out_variant", [(ATTENTION_OP, False), (ATTENTION_OUT_OP, True)])
def test_toy_transformer_split_at_custom_attention(op, out_variant):
    model = ToyTransformer(layers=2, out_variant=out_variant)
    fast = sw.compile(model, sizes=[1, 2, 16], ranges=[(17, 128)], splitting_ops=[op], backend="aot_eager")
    for n in (16, 1, 2, 17, 100, 128):
        ids = torch.randint(0, 64, (n,))
        assert_same(fast(ids), model(ids), f"n={n}")
    assert dynamo_unique_graphs() == 1
    program = fast.program
    assert [p.is_splitting for p in program.pieces] == [False, True, False, True, False]
    assert len(fast.report()) == 3 * 4  # 3 compute pieces x 4 variants


def test_dynamic_dims_by_keyword_and_extra_kwargs():
    class HFLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.proj = nn.Linear(16, 50)

        def forward(self, input_ids, attention_mask=None, use_cache=True):
            h = self.embed(input_ids)
            if attention_mask is not None:
                h = h * attention_mask[..., None]
            return self.proj(h).log_softmax(-1)

    model = HFLike()
    fast = sw.compile(model, dynamic_dims={"input_ids": 1}, sizes=[1, 16], ranges=[(17, 512)], backend="eager")
    for seq in (16, 1, 200):
        ids = torch.randint(0, 50, (2, seq))
        assert_same(fast(input_ids=ids, use_cache=False), model(input_ids=ids, use_cache=False))
    assert fast.traces == 1


def test_two_named_dims_product_of_sizes():
    def f(x):
        return (x.softmax(-1) * 2).sum(0)

    fast = sw.compile(f, dynamic_dims={"x": {0: "batch", 1: "seq"}},
                      sizes={"batch": [1, 2, 4], "seq": [128, 256]}, backend="aot_eager")
    for b in (1, 2, 4):
        for s in (128, 256):
            x = torch.randn(b, s)
            assert_same(fast(x), f(x))
    assert fast.traces == 1 and dynamo_unique_graphs() == 1
    keys = [r["key"] for r in fast.report()]
    assert keys[0] == "{batch=1, seq=128}" and len(keys) == 6
    with pytest.raises(sw.DispatchMiss, match=r"\{batch=3, seq=128\}"):
        fast(torch.randn(3, 128))


def test_refused_size_is_named_with_its_guard_and_left_to_another_trace(caplog):
    def pairs(x):
        return x.view(-1, 2, x.shape[1]).sum(1)

    fast = sw.compile(pairs, sizes=[2, 4, 6, 7], backend="eager")
    x = torch.randn(4, 3)
    with caplog.at_level("WARNING", logger="shapewise"):
        assert_same(fast(x), pairs(x))
    assert re.search(r"skipping \{n=7\} in this trace: size \{n=7\} contradicts the trace's guard `.*Mod", caplog.text)
    assert [r["key"] for r in fast.report()] == ["{n=2}", "{n=4}", "{n=6}"]
    # A call at 7 traces again, at 7, where the model fails as it does in eager.
    with pytest.raises(RuntimeError, match="is invalid for input of size 21"):
        fast(torch.randn(7, 3))


def test_a_dim_that_changes_unmarked_is_named_when_it_traces_again(caplog):
    # The default marks dim 0; a transformers model called with input_ids [1, n] varies dim 1,
    # so Dynamo traces (and shapewise compiles) once per n. Say so, and name the fix, once.
    def scale(x):
        return x * 2

    fast = sw.compile(scale, sizes=[2], backend="eager")
    with caplog.at_level("WARNING", logger="shapewise"):
        for n in (3, 5, 7):
            x = torch.randn(2, n)
            assert_same(fast(x), scale(x))
    assert fast.traces == 3
    warned = [r.getMessage() for r in caplog.records if "is not a dynamic dim" in r.getMessage()]
    assert len(warned) == 1 and "dim 1 of 'x' was 3 in an earlier trace and is 5 now" in warned[0]
    assert "dynamic_dims={'x': 1}" in warned[0]
    caplog.clear()
    fast = sw.compile(scale, sizes=[3, 5], dynamic_dims={"x": 1}, backend="eager")
    with caplog.at_level("WARNING", logger="shapewise"):
        for n in (3, 5):
            fast(torch.randn(2, n))
    assert fast.traces == 1 and "is not a dynamic dim" not in caplog.text

    def scale_by(x, s=None):  # a 0-dim argument the first trace did not have (it made the warning raise)
        return x * 2 if s is None else x * s

    fast = sw.compile(scale_by, sizes=[2], backend="eager")
    x = torch.randn(2, 3)
    assert_same(fast(x), scale_by(x))
    assert_same(fast(x, torch.tensor(3.0)), scale_by(x, torch.tensor(3.0)))


def test_a_range_a_guard_refuses_is_an_error_up_front():
    def pairs(x):
        return x.view(-1, 2, x.shape[1]).sum(1)

    fast = sw.compile(pairs, ranges=[(2, 7)], backend="eager")
    with pytest.raises(sw.GuardViolation, match=r"range \{n=2\.\.7\} ends at the size \{n=7\}, which contradicts"):
        fast(torch.randn(4, 3))


def test_miss_names_size_sizes_and_ranges():
    fast = sw.compile(MLP(), sizes=[1, 2], ranges=[(8, 16)], backend="eager")
    fast(torch.randn(2, 32))
    with pytest.raises(sw.DispatchMiss, match=r"size \{n=5\}: compiled sizes: \{n=1\}, \{n=2\}; ranges: \{n=8\.\.16\}"):
        fast(torch.randn(5, 32))


def test_on_miss_eager_and_dynamic():
    model = MLP()
    for policy in ("eager", "dynamic"):
        fast = sw.compile(model, sizes=[2], on_miss=policy, backend="aot_eager")
        for n in (2, 5, 7):
            x = torch.randn(n, 32)
            assert_same(fast(x), model(x))
        assert fast.traces == 1


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(dynamic_dims={"y": 0}), "not an argument"),
        (dict(splitting_ops=["nope::op"]), "unknown splitting op"),
        (dict(backend="tvm"), "unknown backend"),
        (dict(on_miss="pad"), "on_miss"),
        (dict(bogus=1), "unknown option"),
    ],
)
def test_configuration_errors_up_front(kwargs, fragment):
    with pytest.raises(sw.ConfigError, match=fragment):
        sw.compile(MLP(), sizes=[1], **kwargs)


def test_general_variant_is_dynamic_for_a_symbol_found_through_args():
    # Dynamo traces torch's own modules (nn.Sequential) through a *args wrapper: the size is
    # L['args'][0].shape[0]. It is still named after the argument, and the general variant of
    # on_miss="dynamic" is symbolic in it (it was compiled at the traced size: wrong answers).
    model = nn.Sequential(PerRow())
    fast = sw.compile(model, sizes=[2, 8], on_miss="dynamic", backend="aot_eager")
    for n in (2, 5, 8, 13):
        x = torch.randn(n, 16)
        assert_same(fast(x), model(x), f"n={n}")
    rows = fast.report()
    assert [r["key"] for r in rows[:2]] == ["{n=2}", "{n=8}"]
    assert rows[-1]["key"] == "general (on_miss='dynamic')" and rows[-1]["static"] is False


def test_no_sizes_compiles_one_dynamic_variant_for_every_size():
    model = PerRow()
    fast = sw.compile(model, backend="aot_eager")
    for n in (3, 1, 7, 40):
        x = torch.randn(n, 16)
        assert_same(fast(x), model(x), f"n={n}")
    (row,) = fast.report()
    assert row["static"] is False and row["key"] == "{n=1..inf}"
    assert fast.traces == 1


def test_optional_argument_named_in_dynamic_dims_may_be_left_out():
    class WithLabels(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, labels=None):
            y = self.lin(x)
            return y if labels is None else (y, (y - labels).square().mean())

    model = WithLabels()
    fast = sw.compile(model, dynamic_dims={"x": 0, "labels": 0}, sizes=[2, 4], backend="aot_eager")
    x, labels = torch.randn(4, 8), torch.randn(4, 8)
    assert_same(fast(x), model(x))
    assert_same(fast(x, labels=labels), model(x, labels=labels))
    assert_same(fast(x[:2], labels=None), model(x[:2]))


def test_splitting_ops_that_match_nothing_warn(caplog):
    fast = sw.compile(MLP(), sizes=[2], splitting_ops=["sdpa"], backend="aot_eager")
    with caplog.at_level("WARNING", logger="shapewise"):
        fast(torch.randn(2, 32))
    assert "match no node of the graph: it stays one piece" in caplog.text
    assert len(fast.program.pieces) == 1


def test_report_table_shows_the_first_line_of_an_error():
    def failing(gm, example_inputs):
        raise RuntimeError("first line of the cause\nsecond line\nthird line")

    fast = sw.compile(MLP(), sizes=[2], backend=failing, on_compile_error="fallback")
    x = torch.randn(2, 32)
    assert_same(fast(x), MLP.forward(fast.model, x))
    report = fast.report()
    assert "second line" in report[0]["error"]  # the row keeps it all
    text = str(report)
    assert "first line of the cause..." in text and "second line" not in text


def test_many_compiled_models_of_one_class():
    # Each sw.compile has its own backend: Dynamo keeps an entry per model on the class's shared
    # forward code, and the 9th hit its recompile limit (an error under fullgraph=True).
    for i in range(11):
        model = PerRow()
        fast = sw.compile(model, sizes=[2, 4], backend="eager")
        for n in (2, 4):
            x = torch.randn(n, 16)
            assert_same(fast(x), model(x), f"model {i}, n={n}")


class _TupleIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, xs, scale: float = 1.0):
        a, b = xs
        return self.lin(a) * b * scale


@pytest.mark.parametrize("dims", [None, {"xs": 0}])
def test_tensors_inside_a_tuple_argument_vary(dims):
    model = _TupleIn()
    fast = sw.compile(model, sizes=[2, 4], ranges=[(5, 9)], dynamic_dims=dims, backend="aot_eager")
    for n in (4, 2, 7):
        xs = (torch.randn(n, 16), torch.randn(n, 16))
        assert_same(fast(xs), model(xs), f"n={n}")
    assert fast.traces == 1
    assert [r["key"] for r in fast.report()] == ["{n=2}", "{n=4}", "{n=5..9}"]
    with pytest.raises(sw.ConfigError, match="with no tensor in it"):
        sw.compile(model, sizes=[2], dynamic_dims={"scale": 0}, backend="eager")(
            (torch.randn(2, 16), torch.randn(2, 16)), scale=2.0)


def test_a_trace_without_dynamic_sizes_says_which_dims_were_marked():
    fast = sw.compile(nn.Linear(16, 16), sizes=[2, 4], backend="eager")
    with pytest.raises(sw.BindingError, match=r"the model fixes every dim that was marked dynamic \(marked: dim \[0\] "
                                              r"of 'input'\); name the dims that vary with dynamic_dims"):
        fast(torch.randn(16))  # a 1-d input to a Linear: its only dim is fixed at 16


def _star_args(*args):
    return args[0] * 2 + args[1]


def test_a_model_whose_own_parameter_is_star_args():
    # Dynamo's source for it is L['args'][i], as for torch's own *args wrapper around a
    # forward(self, x): it must read as the model's `args`, not as a positional parameter.
    fast = sw.compile(_star_args, dynamic_dims={"args": {0: "b"}}, sizes={"b": [2, 4]}, backend="eager")
    for n in (2, 4):
        a, b = torch.randn(n, 3), torch.randn(n, 3)
        assert_same(fast(a, b), _star_args(a, b))
    assert [r["key"] for r in fast.report()] == ["{b=2}", "{b=4}"]


def test_two_sizes_under_one_name_are_told_apart_in_messages():
    def two(a, b):
        return a.sum(0) + b.sum(0)

    fast = sw.compile(two, sizes=[4], backend="eager")  # both dim 0s are named "n" by default
    fast(torch.randn(4, 3), torch.randn(4, 3))
    # dims that share a name and a size print once; told apart where they differ
    with pytest.raises(sw.DispatchMiss, match=r"size \{n\[s\d+\]=4, n\[s\d+\]=6\}: compiled sizes: \{n=4\};"):
        fast(torch.randn(4, 3), torch.randn(6, 3))


class _Decoder(nn.Module):
    """Attention as transformers' SDPA path writes it: ``is_causal = q_len > 1 and mask is None``.
    A trace symbolic in q_len at q_len=1 would carry that as a SymBool (SDPA refuses it)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        is_causal = q.shape[2] > 1 and mask is None and True
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal).transpose(1, 2)


@pytest.mark.parametrize("first", [4, 1])
def test_a_size_the_first_trace_cannot_serve_gets_a_trace_specialised_to_it(first):
    model = _Decoder()
    fast = sw.compile(model, dynamic_dims={"x": 1}, sizes=[1, 4, 16], ranges=[(17, 40)], backend="aot_eager")
    for t in (first, 1, 4, 16, 30, 1):
        x = torch.randn(2, t, 16)
        assert_same(fast(x), model(x), f"T={t}")
    assert fast.traces == 2  # one per branch of `q_len > 1`
    rows = fast.report()
    by_trace = {}
    for r in rows:
        by_trace.setdefault(r["trace"], set()).add(r["key"])
    general = "2" if first == 1 else "1"
    special = "1 (n=1)" if first == 1 else "2 (n=1)"
    assert by_trace == {general: {"{n=4}", "{n=16}", "{n=17..40}"}, special: {"{n=1}"}}
    assert "trace" in str(rows).splitlines()[0]
    # A size 1 nobody asked for is a miss in the trace made for it, with the traces listed.
    fast2 = sw.compile(model, dynamic_dims={"x": 1}, sizes=[4], backend="aot_eager")
    fast2(torch.randn(2, 4, 16))
    with pytest.raises(sw.DispatchMiss, match=r"trace 1: \{n=4\}; trace 2 \(n=1\): none"):
        fast2(torch.randn(2, 1, 16))


def _wrapped(fn):
    # As transformers 5 wraps forward: a decorator taking *args, **kwargs around a forward that
    # has **kwargs of its own; Dynamo's sources are then L['kwargs']['input_ids'].
    import functools

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return wrapper


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)

    @_wrapped
    def forward(self, input_ids, attention_mask=None, **kwargs):
        h = self.emb(input_ids)
        return h * attention_mask[..., None] if attention_mask is not None else h


@pytest.mark.parametrize("by_keyword", [True, False])
def test_named_dims_bind_through_a_wrapped_forward_and_several_arguments(by_keyword):
    model = _Encoder()
    spec = {0: "batch", 1: "seq"}
    fast = sw.compile(model, dynamic_dims={"input_ids": spec, "attention_mask": spec},
                      sizes={"batch": [1, 2], "seq": [8, 16]}, ranges={"seq": [(17, 32)]}, backend="aot_eager")
    for b, t in ((2, 8), (1, 16), (2, 20), (1, 8)):
        ids, mask = torch.randint(0, 32, (b, t)), torch.ones(b, t)
        mask[0, t // 2:] = 0
        out = fast(input_ids=ids, attention_mask=mask) if by_keyword else fast(ids, mask)
        assert_same(out, model(ids, mask), f"{b}x{t}")
    assert fast.traces == 1
    keys = [r["key"] for r in fast.report()]
    # the two arguments' batch dims take one size per binding (not a product of the two)
    assert keys == ["{batch=1, seq=8}", "{batch=1, seq=16}", "{batch=2, seq=8}", "{batch=2, seq=16}",
                    "{batch=1..inf, seq=17..32}"]


def _view_valid_at_two(x):  # x[:, :-1] is viewable as [-1, 4] with B = 2 only where T - 1 == 1
    return x[:, :-1].reshape(-1, 4).sum()


def test_a_size_the_model_specialises_gets_a_trace_of_its_own():
    fast = sw.compile(_view_valid_at_two, dynamic_dims={"x": 1}, sizes=[2, 5], backend="aot_eager")
    for t in (5, 2, 5, 2):
        x = torch.randn(2, t, 4)
        assert_same(fast(x), _view_valid_at_two(x), f"T={t}")
    # the symbolic attempt at 2 was refused by Dynamo and left nothing behind
    assert [(r["trace"], r["key"]) for r in fast.report()] == [("1", "{n=5}"), ("2 (n=2)", "{n=2}")]


def _positions_from_a_python_list(x, mask=None):  # cpmant: torch.tensor(list(range(seqlen))), at every length
    positions = torch.tensor(list(range(x.shape[1])), dtype=x.dtype)
    out = x + positions[None, :, None]
    return out if mask is None else out * mask[..., None]


def test_a_model_that_fixes_every_size_gets_a_trace_per_asked_size_and_a_miss_for_others(caplog):
    # The model specialises seq at every call, and the optional mask (ctx) is left out: each size
    # asked for is a trace fixed at it (ctx follows), a size not asked for is a miss, not a
    # BindingError about dims that trace does not have; the retrace says the model fixes seq.
    fast = sw.compile(_positions_from_a_python_list, dynamic_dims={"x": {1: "seq"}, "mask": {-1: "ctx"}},
                      sizes=[{"seq": 4, "ctx": 4}, {"seq": 6, "ctx": 6}], backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="shapewise"):
        for t in (4, 6, 4):
            x = torch.randn(2, t, 3)
            assert_same(fast(x), _positions_from_a_python_list(x), f"seq={t}")
    assert fast.traces == 2
    assert "the model fixes {'seq': 6}: each other size of them is a trace of its own" in caplog.text
    with pytest.raises(sw.DispatchMiss, match=r"seq=5"):
        fast(torch.randn(2, 5, 3))


def _shifted_loss(x, labels):  # the pad guards labels' T != 1 before cross_entropy equates it with x's T
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(x.reshape(-1, 7), shifted.reshape(-1), ignore_index=-100, reduction="sum")


def test_a_guard_on_a_symbol_dynamo_replaced_is_kept():
    fast = sw.compile(_shifted_loss, dynamic_dims={"x": 1, "labels": 1}, sizes=[3], ranges=[(1, 5)],
                      backend="aot_eager")
    with pytest.raises(sw.GuardViolation, match=r"range \{n=1\.\.5\} ends at the size \{n=1\}.*`Ne\(n, 1\)`"):
        fast(torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3)))


def _logs_then_doubles(x):
    print("a Python side effect Dynamo cannot put in one graph")
    return x * 2


def test_a_model_dynamo_cannot_trace_as_one_graph_gets_a_shapewise_error():
    fast = sw.compile(_logs_then_doubles, sizes=[2], backend="eager")
    with pytest.raises(sw.ShapewiseError, match=r"Dynamo cannot trace _logs_then_doubles as one graph.*fullgraph") as e:
        fast(torch.randn(2, 3))
    assert e.value.__cause__ is not None  # Dynamo's own message is kept


def _splits_by_counts(x):  # a MoE's routing: sizes from a tensor's values
    counts = torch.bincount((x[:, 0] > 0).long(), minlength=2)
    parts = x.split(counts.tolist(), dim=0)
    return torch.cat([parts[0] * 2, parts[1] * 3])


def test_a_model_that_reads_a_tensors_value_for_a_size_gets_a_shapewise_error_that_says_what_to_do():
    # Found by review: Dynamo's GuardOnDataDependentSymNode came out raw.
    fast = sw.compile(_splits_by_counts, dynamic_dims={"x": 0}, sizes=[4, 8], backend="aot_eager")
    with pytest.raises(sw.ShapewiseError, match=r"reads a tensor's value .* where Dynamo needs a size: put that code "
                                                r"in a torch.library.custom_op") as e:
        fast(torch.randn(8, 3))
    assert e.value.__cause__ is not None
    # A graph Dynamo did trace, whose compile fails: the piece that reads values is named so.
    from shapewise.lower.compile import reads_item_values

    assert reads_item_values(torch.fx.symbolic_trace(_splits_by_counts))
    assert not reads_item_values(torch.fx.symbolic_trace(_view_valid_at_two))


def test_a_tensor_subclass_weight_compiles_per_size():
    # A traceable wrapper subclass as a weight (TwoTensor, PyTorch's own test subclass; DTensor
    # is one too, tests/distributed): each compile gets a fake one rebuilt around fake inner
    # tensors, its output is the subclass too, and the key spells the class and its inner layouts.
    from torch.testing._internal.two_tensor import TwoTensor

    from shapewise.ir.keys import graph_key

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            w = torch.randn(8, 8)
            self.w = torch.nn.Parameter(TwoTensor(w, 2 * w), requires_grad=False)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.w).relu()

    model = Scaled()
    fast = sw.compile(model, sizes=[2, 4], ranges=[(5, 16)], backend="aot_eager", direct_call=True)
    with torch.no_grad():
        for n in (2, 4, 7, 2):
            x = torch.randn(n, 8)
            out, ref = fast(x), model(x)
            assert isinstance(out, TwoTensor)
            assert_same(out.a, ref.a, f"n={n}")
            assert_same(out.b, ref.b, f"n={n}")
    assert [r["key"] for r in fast.report()] == ["{n=2}", "{n=4}", "{n=5..16}"]
    assert fast.direct_info == "on"
    piece = fast.program.compute_pieces[0]
    assert "two_tensor.TwoTensor{" in graph_key(piece.gm, piece.shapes).text
    assert "TwoTensor" in str(piece.shapes)


def _marks(t: torch.Tensor) -> dict:
    return {a: v for a, v in vars(t).items() if "dynamo" in a}


def test_a_trace_takes_its_dim_marks_off_the_callers_tensors():
    # The trace marks the call's dynamic dims on the caller's tensors; they come off after it, so a
    # tensor handed on (to another compiled model, or to a warm start's loaded trace in the same
    # process) fails no guard of a trace made without them. A mark the caller made stays as it was.
    torch.manual_seed(0)
    model = MLP().eval()
    x, y = torch.randn(4, 32), torch.randn(8, 32)
    torch._dynamo.maybe_mark_dynamic(y, 0)
    theirs = _marks(y)
    fast = sw.compile(model, sizes=[4, 8], backend="aot_eager", progress=False)
    with torch.no_grad():
        assert_same(fast(x), model(x))
        assert not _marks(x)
        assert_same(fast(y), model(y))
        assert _marks(y) == theirs
        other = sw.compile(MLP().eval(), sizes=[4], backend="aot_eager", progress=False)
        other(x)
    assert fast.traces == 1 and other.traces == 1 and not _marks(x)


def test_marks_come_off_a_subclass_inputs_inner_tensors_too():
    # Dynamo's mark_dynamic marks a tensor subclass's inner tensors of the same rank as well (and
    # keeps a _specialize_on table beside the marks): all of it comes off.
    from torch.testing._internal.two_tensor import TwoTensor

    def marks(t):
        return {a: v for a, v in vars(t).items() if "dynamo" in a or a == "_specialize_on"}

    pair = TwoTensor(torch.randn(4, 3), torch.randn(4, 3))
    with sw._compat.marks_taken_off():
        sw._compat.mark_dynamic(pair, 0)
        assert marks(pair) and marks(pair.a) and marks(pair.b)
    assert not marks(pair) and not marks(pair.a) and not marks(pair.b)


class _CountsCalls(nn.Module):
    """A model that changes a Python int every call: Dynamo guards on it, so each call fits no earlier trace."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return self.lin(x) * self.step


def test_past_max_traces_a_call_that_fits_no_trace_runs_uncompiled_without_a_trace(caplog):
    model, reference = _CountsCalls(), _CountsCalls()
    reference.load_state_dict(model.state_dict())
    fast = sw.compile(model, sizes=[2], backend="aot_eager", max_traces=3)
    graphs = dynamo_unique_graphs()
    with caplog.at_level(logging.WARNING, logger="shapewise"):
        for call in range(7):
            x = torch.randn(2, 8)
            assert_same(fast(x), reference(x), f"call {call}")
    assert fast.traces == 3  # calls 4-7 ran uncompiled
    assert dynamo_unique_graphs() == graphs + 3  # and Dynamo traced none of them (eager_on_recompile)
    warnings = [r.getMessage() for r in caplog.records if "max_traces=3" in r.getMessage()]
    assert len(warnings) == 1 and "run uncompiled from now on" in warnings[0], warnings
    model.step = reference.step = 1  # a state a trace was made for: that trace serves it still
    x = torch.randn(2, 8)
    assert_same(fast(x), reference(x), "a traced state")
    assert fast.traces == 3 and dynamo_unique_graphs() == graphs + 3


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "many"])
def test_max_traces_refuses_what_is_not_a_bound(bad):
    with pytest.raises(sw.ConfigError, match=r"max_traces must be 'auto', None \(no bound\) or an int >= 1"):
        sw.compile(MLP(), sizes=[2], backend="eager", max_traces=bad)


def test_max_traces_auto_allows_eight_traces_beyond_one_per_size_and_range():
    model, reference = _CountsCalls(), _CountsCalls()
    reference.load_state_dict(model.state_dict())
    fast = sw.compile(model, sizes=[2, 4], ranges=[(5, 9)], backend="eager")  # auto: 8 + 3
    for call in range(13):
        x = torch.randn(2, 8)
        assert_same(fast(x), reference(x), f"call {call}")
    assert fast.traces == 11
    assert TraceLimit("auto", {"batch": [1, 2], "seq": [128, 256]}, [(1, 4)]).limit == 8 + 4 + 1  # a product: 4 sizes
    unbounded = sw.compile(_CountsCalls(), sizes=[2], backend="eager", max_traces=None)
    for _ in range(12):
        unbounded(torch.randn(2, 8))
    assert unbounded.traces == 12
