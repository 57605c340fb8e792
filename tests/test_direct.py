"""``direct_call=True``: calls past Dynamo's frame once a call has armed it (``shapewise.direct``).
Each test checks the answers against eager and whether the direct call or Dynamo served them."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import shapewise as sw
from shapewise.errors import DispatchMiss
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer
from tests.helpers import assert_same


def _served_directly(fast, call) -> bool:
    before = fast.direct_calls
    call()
    return fast.direct_calls == before + 1


def test_direct_calls_answer_as_eager_at_every_size_and_range():
    torch.manual_seed(0)
    model = MLP().eval()
    fast = sw.compile(model, sizes=[1, 4, 8], ranges=[(9, 64)], direct_call=True, backend="aot_eager",
                      progress=False)
    assert fast.direct_info == "not traced yet"
    with torch.no_grad():
        fast(torch.randn(4, 32))  # traces, compiles, arms
        assert fast.direct_info == "on"
        for n in (1, 4, 8, 9, 33, 64):
            x = torch.randn(n, 32)
            assert _served_directly(fast, lambda x=x: assert_same(fast(x), model(x), f"n={n}"))


def test_a_call_under_another_autocast_dtype_goes_through_dynamo():
    # Dynamo guards autocast's dtype as well as whether it is on: the direct call checks both (it
    # checked only on/off, and served bfloat16 code to a float16 autocast call).
    torch.manual_seed(0)
    model = MLP().eval()
    fast = sw.compile(model, sizes=[4], direct_call=True, backend="aot_eager", progress=False)
    x = torch.randn(4, 32)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast(x)
            assert _served_directly(fast, lambda: fast(x))
        with torch.autocast("cpu", dtype=torch.float16):
            assert not _served_directly(fast, lambda: assert_same(fast(x), model(x), "float16 autocast"))
            assert fast(x).dtype == torch.float16


def test_what_the_checks_refuse_goes_through_dynamo_and_stays_right():
    torch.manual_seed(0)
    model = MLP().eval()
    fast = sw.compile(model, sizes=[4, 8], direct_call=True, backend="aot_eager", progress=False)
    x = torch.randn(8, 32)
    with torch.no_grad():
        fast(torch.randn(4, 32))
        assert not _served_directly(fast, lambda: assert_same(fast(x=x), model(x), "by keyword"))
        assert _served_directly(fast, lambda: assert_same(fast(x), model(x), "as armed"))
        with pytest.raises(DispatchMiss):  # a size the table does not serve: Dynamo's path, its error
            fast(torch.randn(5, 32))
        model.train()
        assert not _served_directly(fast, lambda: assert_same(fast(x), model(x), "train mode"))
        model.eval()
        assert _served_directly(fast, lambda: assert_same(fast(x), model(x), "eval again"))
        t = torch.randn(32, 8).t()  # not contiguous: Dynamo's path, which traces again for it
        assert not _served_directly(fast, lambda: assert_same(fast(t), model(t), "transposed"))
        # The second trace's arming call is that non-contiguous one: its direct call checks the
        # strides and offset as Dynamo guards them; the first trace's still serves what it served.
        assert fast.traces == 2
        assert fast.direct_info == "trace 1: on; trace 2: on"
        t = torch.randn(32, 8).t()
        assert _served_directly(fast, lambda: assert_same(fast(t), model(t), "transposed again"))
        v = torch.randn(40, 8)[2:34].t()  # the same strides at another offset: Dynamo's path
        assert not _served_directly(fast, lambda: assert_same(fast(v), model(v), "offset"))
        assert _served_directly(fast, lambda: assert_same(fast(x), model(x), "after the second trace"))
    # Grad mode differs from the trace's: Dynamo's path.
    assert not _served_directly(fast, lambda: assert_same(fast(x), model(x), "grad on"))


class BranchesOnOne(nn.Module):
    """Branches on ``n > 1`` as transformers' sdpa_attention_forward does (is_causal = q_len > 1):
    a call at 1 fails the first trace's guards and makes a second trace, specialised to 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        return y.cumsum(0) if x.shape[0] > 1 else y * 2


def test_each_trace_gets_its_own_direct_call():
    torch.manual_seed(0)
    model = BranchesOnOne().eval()
    fast = sw.compile(model, sizes=[1, 4, 8], direct_call=True, backend="aot_eager", progress=False)
    with torch.no_grad():
        fast(torch.randn(4, 16))  # trace 1 (n > 1): 4 and 8; arms its direct call
        fast(torch.randn(1, 16))  # trace 2 (n == 1); arms its direct call
        assert fast.traces == 2 and fast.direct_info == "trace 1: on; trace 2 (n=1): on"
        for n in (1, 8, 1, 1, 4, 8, 1):  # alternating traces, each answered by the right one
            x = torch.randn(n, 16)
            assert _served_directly(fast, lambda x=x, n=n: assert_same(fast(x), model(x), f"n={n}"))
        with pytest.raises(DispatchMiss):  # neither trace serves 5: Dynamo's path, its error
            fast(torch.randn(5, 16))
    assert fast.traces == 2 and fast.direct_fallbacks == 2  # the call that made trace 2, and 5


class ReturnsMore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, scale: float = 2.0):
        y = self.lin(x) * scale
        return {"y": y, "sum": y.sum(-1), "none": None, "n": 3}


def test_structured_results_and_constant_arguments():
    torch.manual_seed(0)
    model = ReturnsMore().eval()
    fast = sw.compile(model, sizes=[2, 4], direct_call=True, backend="aot_eager", progress=False)
    with torch.no_grad():
        fast(torch.randn(2, 16), 2.0)
        assert fast.direct_info == "on"
        for n in (2, 4):
            x = torch.randn(n, 16)
            out = {}
            assert _served_directly(fast, lambda x=x: out.update(fast(x, 2.0)))
            ref = model(x, 2.0)
            assert out["none"] is None and out["n"] == 3
            assert_same(out["y"], ref["y"], f"n={n}")
            assert_same(out["sum"], ref["sum"], f"n={n}")
        x = torch.randn(2, 16)
        assert not _served_directly(fast, lambda: assert_same(fast(x, 3.0)["y"], model(x, 3.0)["y"], "scale 3"))


class Identity(nn.Module):
    def forward(self, x):
        return x, x * 2


def test_a_result_it_cannot_rebuild_leaves_direct_calls_off_with_the_reason():
    fast = sw.compile(Identity(), sizes=[2, 4], direct_call=True, backend="aot_eager", progress=False)
    x = torch.randn(2, 3)
    out = fast(x)
    assert out[0] is x and not fast._directs.armed
    assert fast.direct_info.startswith("off: the result holds a tensor the compiled program did not return")


def test_splitting_ops_and_inductor():
    torch.manual_seed(0)
    model = ToyTransformer().eval()
    fast = sw.compile(model, sizes=[2, 4], splitting_ops=[ATTENTION_OP], direct_call=True, progress=False)
    with torch.no_grad():
        ids = torch.randint(0, 64, (2,))
        assert_same(fast(ids), model(ids), "arming call")
        for n in (2, 4):
            ids = torch.randint(0, 64, (n,))
            assert _served_directly(fast, lambda ids=ids: assert_same(fast(ids), model(ids), f"n={n}"))


def test_off_by_default():
    fast = sw.compile(MLP().eval(), sizes=[4], backend="aot_eager", progress=False)
    with torch.no_grad():
        fast(torch.randn(4, 32))
    assert not fast._directs.armed and fast.direct_info.startswith("off")


class AddsTwo(nn.Module):
    def forward(self, x, y):
        return x * 2 + y


def test_sizes_the_trace_fixed_or_shares_are_checked():
    # Dynamo guards y's dim 0 equal to x's (one symbol) and dim 1 to 8 (fixed): a call past its
    # frame must check the same, or a variant would run on inputs it was not compiled for.
    fast = sw.compile(AddsTwo(), sizes=[2, 4], dynamic_dims={"x": 0, "y": 0}, direct_call=True,
                      backend="aot_eager", progress=False)
    fast(torch.randn(2, 8), torch.randn(2, 8))
    assert fast.direct_info == "on"
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    assert _served_directly(fast, lambda: assert_same(fast(x, y), x * 2 + y, "as traced"))
    x, y = torch.randn(4, 3), torch.randn(4, 3)  # dim 1 differs from the trace's: Dynamo traces again
    assert not _served_directly(fast, lambda: assert_same(fast(x, y), x * 2 + y, "dim 1 = 3"))
    fallbacks = fast.direct_fallbacks
    # the shapes do not add: an error, through Dynamo (its marked trace's since no_new_trace: "must match")
    with pytest.raises(Exception, match="broadcast|must match the size"):
        fast(torch.randn(4, 8), torch.randn(2, 8))
    assert fast.direct_fallbacks == fallbacks + 1


class Parity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if x.shape[0] % 2 == 0 else y * 3


def test_a_range_size_its_trace_guards_out_is_not_served_directly():
    # The trace at 4 guards Eq(Mod(n, 2), 0); the range's ends (2, 16) pass, 5 inside it does not:
    # the direct call refuses 5 as Dynamo would, and Dynamo's new trace (the odd branch) serves
    # the part of the range the first cannot.
    torch.manual_seed(0)
    model = Parity().eval()
    fast = sw.compile(model, ranges=[(2, 16)], direct_call=True, backend="aot_eager", progress=False)
    with torch.no_grad():
        fast(torch.randn(4, 8))
        x = torch.randn(6, 8)
        assert _served_directly(fast, lambda: assert_same(fast(x), model(x), "n=6"))
        calls = fast.direct_calls
        x = torch.randn(5, 8)
        assert_same(fast(x), model(x), "n=5")
    assert fast.direct_calls == calls and fast.traces == 2


def test_on_miss_other_than_error_leaves_direct_calls_off():
    # The miss runner would serve any size with this trace's graph, past the trace's guards.
    fast = sw.compile(BranchesOnOne().eval(), sizes=[4], on_miss="eager", direct_call=True, backend="aot_eager",
                      progress=False)
    with torch.no_grad():
        fast(torch.randn(4, 16))
    assert fast.direct_info.startswith("off: on_miss='eager'")


def test_a_trace_dynamo_refuses_leaves_no_phantom_direct_call():
    # x[:, :-1].reshape(-1, 4) only views for T - 1 == 1: Dynamo refuses the first attempt at 2
    # after shapewise has seen it, and shapewise traces again with the size fixed.
    def f(x):
        return x[:, :-1].reshape(-1, 4).sum() * 1.0

    fast = sw.compile(f, dynamic_dims={"x": 1}, sizes=[2, 5], backend="aot_eager", direct_call=True, progress=False)
    for t in (5, 5, 2, 2, 2):
        x = torch.randn(2, t, 4)
        assert_same(fast(x), f(x), f"t={t}")
    assert fast.traces == 2 and fast.direct_info == "trace 1: on; trace 2 (n=2): on"


class _Layer:
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys, self.is_initialized = keys, True


class _Cache:
    """A KV cache as transformers' DynamicCache is built: layers whose tensors a step replaces."""

    def __init__(self, keys: torch.Tensor, scale: int = 2) -> None:
        self.layers, self.scale = [_Layer(keys)], scale


class _Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: _Cache) -> tuple[torch.Tensor, _Cache]:
        layer = cache.layers[0]
        layer.keys = torch.cat([layer.keys, self.proj(x)])
        return layer.keys.sum(0, keepdim=True) * cache.scale, cache


def test_tensors_inside_an_object_argument_and_the_tensors_the_forward_sets_on_it():
    torch.manual_seed(0)
    model = _Step().eval()
    fast = sw.compile(model, dynamic_dims={"cache": {0: "kv"}}, ranges=[{"kv": (1, 64)}], direct_call=True,
                      backend="aot_eager", progress=False)
    start = torch.randn(3, 8)
    mine, ref = _Cache(start.clone()), _Cache(start.clone())
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(1, 8)
            out, same = fast(x, mine)
            expected, _ = model(x, ref)
            assert same is mine
            assert_same(out, expected, f"step {step}")
            assert_same(mine.layers[0].keys, ref.layers[0].keys, f"the cache after step {step}")
        # Step 1 traced (the cache's length dynamic) and armed; steps 2-6 went past the frame.
        assert fast.direct_info == "on"
        assert fast.direct_calls == 5
        # A constant the model read, changed: Dynamo's guards decide (a new trace), not the direct call.
        mine.scale = ref.scale = 3
        x = torch.randn(1, 8)
        assert not _served_directly(fast, lambda: assert_same(fast(x, mine)[0], model(x, ref)[0], "scale 3"))
        # A cache with more layers than the trace's: Dynamo's path too.
        mine.layers.append(_Layer(torch.randn(2, 8)))
        ref.layers.append(_Layer(mine.layers[1].keys.clone()))
        assert not _served_directly(fast, lambda: assert_same(fast(x, mine)[0], model(x, ref)[0], "two layers"))


def test_a_forward_that_changes_other_python_state_keeps_dynamos_frame():
    class Logs(nn.Module):
        def forward(self, x: torch.Tensor, log: list) -> torch.Tensor:
            log.append(x.shape[0])
            return x * 2

    fast = sw.compile(Logs(), dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    for _ in range(3):
        log: list[int] = []
        assert_same(fast(torch.ones(2, 3), log), torch.full((2, 3), 2.0), "list")
        assert log == [2]
    assert fast.direct_info == "off: the forward changes L['log'] in place (a list, dict or cell: Dynamo replays " \
                               "it after the graph)"

    class Makes(nn.Module):
        def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
            cache.made = _Layer(x)  # an object set on an argument: not a tensor, not a constant
            return x * 2

    cache = _Cache(torch.zeros(1, 8))
    fast = sw.compile(Makes(), dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    for _ in range(2):
        fast(torch.ones(2, 3), cache)
    assert fast.direct_calls == 0
    assert fast.direct_info == "off: the forward sets L['cache'].made to a UserDefinedObjectVariable (Dynamo " \
                               "replays it, a direct call would not)", fast.direct_info


def test_constants_the_forward_sets_are_set_by_the_direct_call_and_checked_as_they_were_before():
    class Counts(nn.Module):
        def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
            cache.steps = cache.steps + 1  # read and set: each value is another trace for Dynamo
            cache.seen = True  # set only: the direct call sets it too
            return x * cache.steps

    model = Counts()
    fast = sw.compile(model, dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    x = torch.ones(2, 3)
    mine, ref = _Cache(torch.zeros(1, 8)), _Cache(torch.zeros(1, 8))
    for step in range(4):
        for c in (mine, ref):
            c.steps, c.seen = 1, False  # as before the traced call: served past Dynamo's frame after the first
        assert_same(fast(x, mine), model(x, ref), f"call {step}")
        assert (mine.steps, mine.seen) == (ref.steps, ref.seen) == (2, True)
    assert fast.direct_info == "on" and fast.direct_calls == 3
    mine.steps = ref.steps = 5  # not what the trace saw before its call: Dynamo's frame (a new trace)
    assert not _served_directly(fast, lambda: assert_same(fast(x, mine), model(x, ref), "steps 5"))
    assert mine.steps == ref.steps == 6


def test_a_dict_set_back_as_it_was_is_no_change_but_a_key_taken_out_is():
    # transformers (>= 5.2x) swaps a tensor-parallel linear's DTensor weights for local tensors
    # during its forward and puts them back: Dynamo counts the dict as changed; it is not.
    class Swaps(nn.Module):
        def forward(self, x: torch.Tensor, d: dict) -> torch.Tensor:
            old = d["w"]
            d["w"] = old * 2
            y = x @ d["w"]
            d["w"] = old
            return y

    class Pops(nn.Module):
        def forward(self, x: torch.Tensor, d: dict) -> torch.Tensor:
            return x @ d.pop("w")

    w = torch.randn(3, 3)
    fast = sw.compile(Swaps(), dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    d = {"w": w}
    x = torch.randn(2, 3)
    for _ in range(3):
        assert_same(fast(x, d), x @ (w * 2), "swapped")
        assert d["w"] is w
    assert fast.direct_info == "on" and fast.direct_calls == 2
    fast = sw.compile(Pops(), dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    d = {"w": w}
    assert_same(fast(x, d), x @ w, "popped")
    assert d == {}
    assert fast.direct_info.startswith("off: the forward changes L['d'] in place"), fast.direct_info


def test_a_forward_that_pops_from_its_own_kwargs_changes_nothing_outside():
    # transformers 5.17's forward decorators pop from the **kwargs they take: a dict Python builds
    # for each call, so Dynamo's replay of it changes nothing the caller holds.
    class Pops(nn.Module):
        def forward(self, x: torch.Tensor, **kwargs: int) -> torch.Tensor:
            return x * kwargs.pop("scale") + len(kwargs)

    fast = sw.compile(Pops(), dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    x = torch.randn(2, 3)
    for _ in range(3):
        assert_same(fast(x, scale=2), x * 2, "popped from its kwargs")
    assert fast.direct_info == "on" and fast.direct_calls == 2


class _Cfg:
    def __init__(self) -> None:
        self.scale = 2


class _Held:
    scale = 2  # a class attribute, read through the instance

    def __init__(self, keys: torch.Tensor, tag: str | None = None) -> None:
        self.keys, self.cfg, self.mode = keys, _Cfg(), 2
        if tag is not None:
            self.tag = tag


class _Reads(nn.Module):
    def forward(self, x: torch.Tensor, held: _Held) -> torch.Tensor:
        return (x + held.keys) * held.cfg.scale * held.scale * held.mode


def _change_cfg(h: _Held) -> None:
    h.cfg.scale = 10


def _change_class(h: _Held) -> None:
    _Held.scale = 10


def _change_type(h: _Held) -> None:
    h.mode = 2.0  # equal, but a float: the result's dtype changes


def _drop_tag(h: _Held) -> None:
    del h.tag  # an attribute the model never reads: a miss, not an AttributeError


@pytest.mark.parametrize("change", [_change_cfg, _change_class, _change_type, _drop_tag])
def test_what_an_object_argument_holds_is_checked_past_its_tensors(change):
    # Found by review: the first checks saw only constants in an object's own __dict__.
    model = _Reads()
    fast = sw.compile(model, dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    x = torch.ones(2, 3, dtype=torch.int64)
    held = _Held(torch.ones(2, 3, dtype=torch.int64), tag="first")
    try:
        for _ in range(2):
            assert_same(fast(x, held), model(x, held), "as armed")
        assert fast.direct_calls == 1
        change(held)
        assert not _served_directly(fast, lambda: assert_same(fast(x, held), model(x, held), change.__name__))
    finally:
        _Held.scale = 2


class _Layer:
    window = 4  # a class attribute, read through each layer

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys, self.size, self.kind, self.tag = keys, 3, "full", "t"


class _Stack:
    def __init__(self, n: int) -> None:
        self.layers = [_Layer(torch.ones(2, 3)) for _ in range(n)]


class _ReadsLayers(nn.Module):
    def forward(self, x: torch.Tensor, stack: _Stack) -> torch.Tensor:
        for layer in stack.layers:
            x = x + layer.keys * layer.size * layer.window * (2 if layer.kind == "full" else 3)
        return x


def _one_layer_value(s: _Stack) -> None:
    s.layers[2].size = 4


def _one_layer_type(s: _Stack) -> None:
    s.layers[3].size = 3.0  # equal, but a float


def _the_class(s: _Stack) -> None:
    _Layer.window = 5


def _one_layer_attribute_gone(s: _Stack) -> None:
    del s.layers[1].tag  # one the model never reads: a miss, not an AttributeError


def _one_layer_twice(s: _Stack) -> None:
    s.layers[4] = s.layers[0]  # the list's items were distinct (one C pass over their ids checks it)


@pytest.mark.parametrize("change", [_one_layer_value, _one_layer_type, _the_class, _one_layer_attribute_gone,
                                    _one_layer_twice])
def test_the_layers_constants_are_checked_at_once_and_each_change_is_refused(change):
    # Objects holding the same constants (a cache's layers) are checked by one map over all of
    # them, and their class once (direct_checks.merge_checks): still every change is refused.
    model = _ReadsLayers()
    fast = sw.compile(model, dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    x, stack = torch.ones(2, 3), _Stack(5)
    try:
        for _ in range(2):
            assert_same(fast(x, stack), model(x, stack), "as armed")
        assert fast.direct_calls == 1
        (direct,) = fast._directs.armed
        assert direct.source.count("tuple(map(XG") == 1 and direct.source.count("XC") == 1, direct.source
        change(stack)
        assert not _served_directly(fast, lambda: assert_same(fast(x, stack), model(x, stack), change.__name__))
    finally:
        _Layer.window = 4


def _compiled_layers():
    model = _ReadsLayers()
    fast = sw.compile(model, dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    return model, fast


def test_unchanged_objects_are_checked_by_their_dict_versions_and_any_change_is_seen(monkeypatch):
    # Once a call passed every check of the layers' attributes, later calls compare the objects'
    # dict versions instead (direct_checks.memo): a changed attribute, a layer replaced by an equal
    # one, a new stack, or an argument that is one of the tensors inside are each seen.
    if sw._compat.dict_version is None:
        pytest.skip("no dict versions on this Python and torch")
    model, fast = _compiled_layers()
    x, stack = torch.ones(2, 3), _Stack(5)
    for _ in range(4):
        assert_same(fast(x, stack), model(x, stack), "as armed")
    assert fast.direct_calls == 3 and "MEMO[0]" in fast._directs.armed[0].source
    stack.layers[2].size = 4  # changed after calls served by the dict versions alone
    assert not _served_directly(fast, lambda: assert_same(fast(x, stack), model(x, stack), "size 4"))
    stack.layers[2].size = 3  # back as armed: served directly again
    assert _served_directly(fast, lambda: assert_same(fast(x, stack), model(x, stack), "size 3 again"))
    stack.layers[1] = _Layer(torch.full((2, 3), 2.0))  # a new layer object with equal attributes
    assert _served_directly(fast, lambda: assert_same(fast(x, stack), model(x, stack), "new layer"))
    fresh = _Stack(5)  # a new cache, as each generate() makes
    for _ in range(2):
        assert _served_directly(fast, lambda: assert_same(fast(x, fresh), model(x, fresh), "new stack"))
    inner = fresh.layers[0].keys  # an argument that is a tensor read inside: aliasing the trace did not see
    assert not _served_directly(fast, lambda: assert_same(fast(inner, fresh), model(inner, fresh), "aliased"))
    monkeypatch.setattr(sw._compat, "dict_version", None)  # where there are none: every attribute, every call
    model, fast = _compiled_layers()
    for _ in range(3):
        assert_same(fast(x, stack), model(x, stack), "no dict versions")
    assert fast.direct_calls == 2 and "MEMO" not in fast._directs.armed[0].source


class _HeldLayer(_Layer):
    """A layer whose keys are a property reading a list it holds: they change with no change to
    the layer's ``__dict__``."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.held, self.size, self.kind, self.tag = [keys], 3, "full", "t"

    @property
    def keys(self) -> torch.Tensor:
        return self.held[0]


def test_a_tensor_its_objects_dict_versions_do_not_cover_is_checked_every_call():
    # Dynamo reads through the property into the list: the tensor there is checked each call,
    # its aliasing with the arguments too.
    if sw._compat.dict_version is None:
        pytest.skip("no dict versions on this Python and torch")
    model, fast = _compiled_layers()
    x, stack = torch.ones(2, 3), _Stack(3)
    stack.layers[1] = _HeldLayer(torch.ones(2, 3))
    for _ in range(3):
        assert_same(fast(x, stack), model(x, stack), "as armed")
    assert fast.direct_calls == 2 and "MEMO[0]" in fast._directs.armed[0].source
    stack.layers[1].held[0] = torch.full((2, 3), 5.0)
    assert _served_directly(fast, lambda: assert_same(fast(x, stack), model(x, stack), "new keys"))
    stack.layers[1].held[0] = x
    assert not _served_directly(fast, lambda: assert_same(fast(x, stack), model(x, stack), "keys are x"))


def test_aliasing_is_checked_as_the_arming_call_had_it():
    class Grows(nn.Module):
        def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
            out = x
            for layer in cache.layers:
                layer.keys = torch.cat([layer.keys, x])
                out = out + layer.keys.sum(0)
            return out

    class Adds(nn.Module):
        def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            a.add_(1)
            return x + b * 2

    model = Grows()
    fast = sw.compile(model, dynamic_dims={"x": 0, "cache": {}}, sizes=[1], direct_call=True, backend="aot_eager",
                      progress=False)
    x = torch.ones(1, 3)
    shared = _Cache(torch.ones(1, 3))
    shared.layers.append(shared.layers[0])  # one layer object at two places
    fast(x, shared)
    mine, ref = (_Cache(torch.ones(1, 3)) for _ in range(2))
    for c in (mine, ref):
        c.layers.append(_Layer(torch.ones(1, 3)))
    assert not _served_directly(fast, lambda: assert_same(fast(x, mine), model(x, ref), "two layers"))
    assert_same(mine.layers[1].keys, ref.layers[1].keys, "the second layer grew")
    model = Adds()
    fast = sw.compile(model, dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    x = torch.zeros(2, 3)
    for _ in range(2):
        fast(x, torch.zeros(2, 3), torch.zeros(2, 3))
    t, r = torch.zeros(2, 3), torch.zeros(2, 3)
    assert not _served_directly(fast, lambda: assert_same(fast(x, t, t), model(x, r, r), "one tensor twice"))


class _Reads4(nn.Module):
    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        return (x @ cache.layers[0].keys.t()).sum(1) * cache.scale  # reads the cache's tensor in place


def _to_float64(c: _Cache) -> None:
    c.layers[0].keys = c.layers[0].keys.double()


def _longer(c: _Cache) -> None:
    c.layers[0].keys = torch.randn(5, 8)


def _transposed(c: _Cache) -> None:  # same shape and dtype, not contiguous
    c.layers[0].keys = torch.randn(8, 4).t()


def _needs_grad(c: _Cache) -> None:
    c.layers[0].keys = torch.randn(4, 8, requires_grad=True)


def _a_parameter(c: _Cache) -> None:  # a Tensor subclass
    c.layers[0].keys = nn.Parameter(torch.randn(4, 8), requires_grad=False)


def _more_dims(c: _Cache) -> None:
    c.layers[0].keys = torch.randn(4, 8, 1)


@pytest.mark.parametrize("change", [_to_float64, _longer, _transposed, _needs_grad, _a_parameter, _more_dims])
def test_tensors_inside_an_object_are_checked_in_one_call_that_refuses_each_change(change):
    # The tensors an object argument holds (a KV cache's, 2 to 4 per layer) are checked by one
    # C++ call (Dynamo's TensorGuards) for type, dtype, device, grad, rank, sizes and strides, not
    # a line of Python each: it must refuse what the Python checks refused.
    model = _Reads4()
    fast = sw.compile(model, dynamic_dims={"x": 0}, sizes=[2], direct_call=True, backend="aot_eager",
                      progress=False)
    x = torch.randn(2, 8)
    cache = _Cache(torch.randn(4, 8))
    with torch.no_grad():
        for _ in range(3):
            assert_same(fast(x, cache), model(x, cache), "as armed")
        assert fast.direct_calls == 2
        assert "TG.check(" in fast._directs.armed[0].source
        change(cache)
        try:
            expected = model(x, cache)
        except RuntimeError:  # float64 keys against a float32 x: eager fails, and so must the compiled call
            with pytest.raises(RuntimeError):
                fast(x, cache)
            return
        assert not _served_directly(fast, lambda: assert_same(fast(x, cache), expected, change.__name__))


class _WithModelOutput(nn.Module):
    """Returns transformers' ``CausalLMOutputWithPast``, as a causal LM does: a dataclass dict."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=self.lin(x))


@functools.cache
def _tagged_output():
    """A ModelOutput whose ``__post_init__`` sets an attribute of its own (a pytree node, as every
    ModelOutput subclass registers itself)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    @dataclasses.dataclass
    class Tagged(CausalLMOutputWithPast):
        def __post_init__(self):
            super().__post_init__()
            self.tag = "made by __post_init__"

    return Tagged


def test_a_model_output_is_rebuilt_past_its_init_and_equals_the_one_through_dynamo():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    import shapewise.direct as direct

    model = _WithModelOutput()
    fast = sw.compile(model, sizes=[2, 4], backend="eager", direct_call=True)
    with torch.no_grad():
        first = fast(torch.randn(2, 8))  # through Dynamo: arms the direct call
        x = torch.randn(4, 8)
        assert _served_directly(fast, lambda: fast(x))
        got = fast(x)
    assert "return build(" in fast._directs.armed[0].source  # the fast rebuild, not pytree's
    ref = CausalLMOutputWithPast(logits=got.logits)
    assert type(got) is type(first) is CausalLMOutputWithPast
    assert list(got.keys()) == list(ref.keys()) == ["logits"] and vars(got).keys() == vars(ref).keys()
    assert got.loss is None and got[0] is got.logits and got.to_tuple() == ref.to_tuple()
    assert_same(got.logits, model(x).logits)
    # what the fast rebuild cannot make as pytree does is rebuilt by pytree
    leaves, spec = torch.utils._pytree.tree_flatten(ref)
    assert direct.model_output_builder(spec, leaves) is not None
    assert direct.model_output_builder(torch.utils._pytree.tree_flatten((1, 2))[1], [1, 2]) is None
    leaves, spec = torch.utils._pytree.tree_flatten(_tagged_output()(logits=got.logits))
    assert direct.model_output_builder(spec, leaves) is None
