"""Piecewise graphs' run-time objects on the CPU, with CUDA graphs stood in for: the order in
which a size captures again after a splitting op's output moved, and which inputs the graphs
may read where a splitting op put them."""

from __future__ import annotations

import contextlib

import pytest
import torch

import shapewise as sw
from shapewise.dispatch.cudagraphs import split_fed_inputs
from shapewise.dispatch.graphed import GraphedPiece, GraphPool, SizeGraphs, StagedInputs
from shapewise.models import ATTENTION_OP, ToyTransformer


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (the graphs only read ``is_cuda``)."""

    @property
    def is_cuda(self):
        return True


def _cuda(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_OnCuda, t)


@pytest.fixture
def events(monkeypatch):
    """Stand-in CUDA graphs (capture runs the function, replay does nothing); warm-ups and captures logged."""
    log: list[str] = []

    class Graph:
        def replay(self):
            log.append("replay")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (1, 0))
    for step in ("_warm_up", "_capture"):
        real = getattr(GraphedPiece, step)

        def logged(self, args, real=real, step=step):
            log.append(f"{step.strip('_').replace('_', '-')} {self.name}")
            return real(self, args)

        monkeypatch.setattr(GraphedPiece, step, logged)
    return log


def test_a_moved_output_makes_every_graph_of_the_size_capture_again_in_order(events):
    # Graphs sharing a pool must replay in the order they were captured: after a move, the rest
    # of that call runs uncaptured and the next call captures every piece, first to last.
    pool = GraphPool()
    group = SizeGraphs((4,), pool, None)
    group.adopt = True  # as with a private pool
    piece = {name: GraphedPiece(fn, name, (4,), pool, [None] * 2, group, adopt)
             for name, fn, adopt in (("p0", lambda x: (_cuda(x + 1), _cuda(x * 0 + 2)), frozenset()),
                                     ("p1", lambda s, cos: _cuda(s + cos), frozenset({0})),
                                     ("p2", lambda s, cos: _cuda(s * cos), frozenset({0})),
                                     ("p3", lambda h, cos: _cuda(h - cos), frozenset()))}
    outputs = [_cuda(torch.zeros(4)), _cuda(torch.zeros(4))]  # where the splitting op puts its outputs
    moved = {"now": False}

    def split(h, j):
        return (_cuda(torch.empty(4)) if moved["now"] else outputs[j]).copy_(h * 2)

    def run(x):
        h, cos = piece["p0"](x)
        h = piece["p1"](split(h, 0), cos)
        h = piece["p2"](split(h, 1), cos)
        return piece["p3"](h, cos)

    staged = StagedInputs(run, (4,), pool, [None], frozenset(), group)
    calls = []
    for call in range(6):
        moved["now"] = call >= 3
        events.clear()
        staged(_cuda(torch.full((4,), float(call))))  # (stand-in replays compute nothing: the GPU tests check values)
        calls.append([e for e in events if e != "replay"])
    assert calls[0] == ["warm-up p0", "warm-up p1", "warm-up p2", "warm-up p3"]
    assert calls[1] == ["capture p0", "capture p1", "capture p2", "capture p3"]
    assert calls[2] == []  # replays only
    assert calls[3] == []  # p1's input moved: the rest of the call runs as compiled
    assert calls[4] == ["capture p0", "capture p1", "capture p2", "capture p3"]  # in order, with copies
    assert calls[5] == []
    assert group.recaptures == 1 and not group.adopt and not group.resetting
    assert all(not p.adopted for p in piece.values())
    assert [i for i, _ in piece["p3"].fixed_slots] == [0, 1]  # p2's output and p0's cos, both in place


def test_graphs_may_read_in_place_every_attention_output():
    torch.manual_seed(0)
    model = ToyTransformer(layers=3, dim=32, heads=2, hidden=64, vocab=64)
    fast = sw.compile(model, sizes=[4], splitting_ops=[ATTENTION_OP], backend="aot_eager", progress=False)
    with torch.no_grad():
        fast(torch.randint(0, 64, (4,)))
    program = fast.runnables[0].program
    fed = split_fed_inputs(program)
    splitting = [p.name for p in program.pieces if p.is_splitting]
    assert len(splitting) == 3
    after = [n.target for n in program.graph.graph.nodes if n.op == "call_module" and n.target not in splitting][1:]
    # q, k and v are views of one qkv output (outputs aliasing each other): still read in place.
    assert [len(fed[name]) for name in after] == [1, 1, 1]


@pytest.mark.parametrize("layout_guarded", [False, True])
def test_an_input_where_it_was_is_used_in_place_a_fresh_one_is_copied_and_a_moved_one_recaptures(events,
                                                                                                  layout_guarded):
    # A KV cache the model keeps (unmarked: transformers makes a static cache's tensors inside the
    # trace) is at one address on the warm-up and the capture: read and written there, no copy in or
    # back. The caller's fresh input is copied in. A tensor used in place that moves within a few
    # replays makes the graph capture again, with it copied in from then on.
    pool = GraphPool()
    cache = _cuda(torch.zeros(4))

    def step(x, kv):
        kv.add_(x)  # written in place, as a cache update
        return _cuda(kv * 2)

    piece = GraphedPiece(step, "forward", (4,), pool, [None, None], layout_guarded=layout_guarded)
    fresh = [_cuda(torch.randn(4)) for _ in range(7)]  # all alive: each at an address of its own
    for x in fresh[:3]:
        piece(x, cache)
    assert events == ["warm-up forward", "capture forward", "replay", "replay"]
    assert [i for i, *_ in piece.kept] == [1] and [i for i, _ in piece.copy_slots] == [0]
    assert piece.write_back == [] and piece.recaptures == 0
    events.clear()
    elsewhere = _cuda(torch.zeros(4))  # moved one replay after the capture (fewer than KEEP_AFTER)
    piece(fresh[4], elsewhere)  # runs uncaptured
    piece(fresh[5], elsewhere)  # captures again
    piece(fresh[6], elsewhere)
    assert events == ["capture forward", "replay", "replay"] and piece.recaptures == 1
    assert piece.kept == [] and sorted(i for i, _ in piece.copy_slots) == [0, 1]
    assert [i for i, _ in piece.write_back] == [1]  # copied in, so the graph's write goes back to the caller's


@pytest.mark.parametrize("layout_guarded", [False, True])
def test_a_cache_made_anew_per_generate_is_captured_in_place_again(events, layout_guarded):
    # transformers makes a new static cache per generate() call: its tensors move after a whole
    # generation of replays. The graph captures again reading the new cache in place (no copies),
    # and the dropped graph stays alive until the new capture (the allocator refuses a capture
    # into a pool no graph holds).
    pool = GraphPool()
    piece = GraphedPiece(lambda x, kv: _cuda(kv.add_(x) * 2), "forward", (4,), pool, [None, None],
                         layout_guarded=layout_guarded)
    fresh = [_cuda(torch.randn(4)) for _ in range(30)]
    for cache in (_cuda(torch.zeros(4)), _cuda(torch.zeros(4))):  # two generate() calls
        for x in fresh[:14]:
            piece(x, cache)
        assert [i for i, *_ in piece.kept] == [1] and [i for i, _ in piece.copy_slots] == [0]
        assert piece.write_back == [] and pool.retired == []
    assert piece.recaptures == 1 and piece.moved_inputs == set()
    assert events.count("capture forward") == 2 and events.count("warm-up forward") == 1
    old = piece.graph
    piece(fresh[0], _cuda(torch.zeros(4)))  # moved again: dropped, held until the next capture
    assert piece.graph is None and pool.retired == [old]
    piece(fresh[1], _cuda(torch.zeros(4)))  # a fresh tensor again: copied, captured; the old graph goes
    assert piece.graph is not None and pool.retired == [] and [i for i, _ in piece.copy_slots] == [0, 1]


def test_a_whole_forward_graph_checks_kept_inputs_and_weights_in_one_pass_by_address(events):
    # A whole-forward graph's inputs are the program's own, laid out as the trace's guards say: a
    # kept input (a KV cache) is checked by address alone, in the weights' pass. A weight that moved
    # runs the piece uncaptured (the graph stays); a kept input that moved captures again.
    pool = GraphPool()
    weight, cache = torch.nn.Parameter(_cuda(torch.ones(4))), _cuda(torch.zeros(4))
    piece = GraphedPiece(lambda x, w, kv: _cuda(kv.add_(x * w) * 2), "forward", (4,), pool, [None] * 3,
                         layout_guarded=True)
    fresh = [_cuda(torch.randn(4)) for _ in range(20)]
    for x in fresh[:4]:
        piece(x, weight, cache)
    assert [i for i, *_ in piece.kept] == [2] and piece.fixed_slots == [(1, weight.data_ptr())]
    assert piece._kept_check is None and [r[0] for r in piece._fixed_check.rows] == [1, 2]
    assert all(len(r) == 2 for r in piece._fixed_check.rows)  # addresses only, no strides
    events.clear()
    moved_weight = torch.nn.Parameter(_cuda(torch.ones(4)))
    out = piece(fresh[4], moved_weight, cache)  # uncaptured, right; the graph is kept
    assert events == [] and piece.fallbacks == 1 and piece.graph is not None
    torch.testing.assert_close(out, cache * 2)
    piece(fresh[5], weight, cache)
    assert events == ["replay"]
    events.clear()
    elsewhere = _cuda(torch.zeros(4))  # a new cache after replays: the next call captures it in place
    for x in fresh[6:9]:
        piece(x, weight, elsewhere)
    assert piece.recaptures == 1 and events == ["capture forward", "replay", "replay"]
    assert [i for i, *_ in piece.kept] == [2] and piece.fallbacks == 1


def test_staged_inputs_copy_only_what_moved_between_the_first_two_calls(events):
    pool = GraphPool()
    kept = _cuda(torch.ones(4))  # a persistent buffer the caller passes every call
    group = SizeGraphs((4,), pool, None)
    piece = GraphedPiece(lambda x, b: _cuda(x + b), "p0", (4,), pool, [None, None], group)

    class Buffer:
        def view(self, key):
            return _cuda(torch.empty(4))

    staged = StagedInputs(lambda x, b: piece(x, b), (4,), pool, [Buffer(), Buffer()], frozenset(), group)
    for x in [_cuda(torch.randn(4)) for _ in range(3)]:
        staged(x, kept)
    assert [i for i, _ in staged.slots] == [0]  # the fresh input, staged once for every piece
    assert [i for i, *_ in piece.kept] == [1] and piece.copy_slots == []  # (0: a staged buffer, live)


def test_a_fresh_input_where_the_last_one_was_freed_is_still_copied(events):
    # The caching allocator often puts a new input where the last one was: same address, another
    # tensor. Only the warm-up's own tensor, still there, is read in place.
    pool = GraphPool()
    storage = torch.randn(4)
    cache = _cuda(torch.zeros(4))
    piece = GraphedPiece(lambda x, kv: _cuda(x + kv), "forward", (4,), pool, [None, None])
    first, second = _cuda(storage), _cuda(storage)  # two tensors at one address
    assert first.data_ptr() == second.data_ptr() and first is not second
    piece(first, cache)
    piece(second, cache)
    assert [i for i, _ in piece.copy_slots] == [0] and [i for i, *_ in piece.kept] == [1]


def test_the_address_check_finds_the_first_input_not_where_the_capture_found_it():
    from shapewise.dispatch.graphed import AddressCheck

    ts = [torch.zeros(4, 4) for _ in range(5)]
    args = ("not a tensor", *ts)
    in_place = AddressCheck([(i, args[i].data_ptr()) for i in (1, 3, 4)])
    laid_out = AddressCheck([(2, ts[1].data_ptr(), ts[1].stride())])
    one = AddressCheck([(5, ts[4].data_ptr())])
    assert in_place.moved(args) is None and laid_out.moved(args) is None and one.moved(args) is None
    moved = (*args[:3], torch.zeros(4, 4), *args[4:])
    assert in_place.moved(moved) == 3 and laid_out.moved(moved) is None
    relaid = (*args[:2], ts[1].t(), *args[3:])  # same address, other strides
    assert laid_out.moved(relaid) == 2 and in_place.moved(relaid) is None
    assert one.moved((*args[:5], torch.zeros(4, 4))) == 5


def test_the_inner_address_check_of_subclass_inputs_finds_the_first_one_that_moved():
    # Tensor-subclass inputs read in place (DTensor weights) are checked by their inner tensors'
    # addresses, in one C pass per set of inner names; a nested subclass, one by one.
    from torch.testing._internal.two_tensor import TwoTensor

    from shapewise.dispatch.graphed import InnerAddressCheck, address

    pairs = [TwoTensor(torch.zeros(4), torch.ones(4)) for _ in range(3)]
    nested = TwoTensor(TwoTensor(torch.zeros(2), torch.zeros(2)), TwoTensor(torch.ones(2), torch.ones(2)))
    args = ("not a tensor", *pairs, nested)
    both = InnerAddressCheck([(i, ("a", "b"), address(args[i])) for i in (1, 2, 3)])
    first = InnerAddressCheck([(2, ("a",), (pairs[1].a.data_ptr(),))])
    deep = InnerAddressCheck([(1, ("a", "b"), address(pairs[0])), (4, ("a", "b"), address(nested))])
    assert both.moved(args) is None and first.moved(args) is None and deep.moved(args) is None
    b_moved = TwoTensor(pairs[1].a, torch.ones(4))  # the same "a", a new "b"
    assert both.moved((*args[:2], b_moved, *args[3:])) == 2 and first.moved((*args[:2], b_moved, *args[3:])) is None
    assert both.moved((*args[:3], TwoTensor(torch.zeros(4), torch.ones(4)), args[4])) == 3
    inner_moved = TwoTensor(TwoTensor(torch.zeros(2), torch.zeros(2)), nested.b)
    assert deep.moved((*args[:4], inner_moved)) == 4 and deep.moved(args) is None
    assert both.moved((*args[:3], torch.zeros(4), args[4])) == 3  # not a subclass any more: moved, no error


def test_fresh_inputs_of_three_dtypes_are_copied_in_by_their_bytes_in_one_foreach_copy(monkeypatch):
    from shapewise.dispatch.copies import CopyIn

    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (calls.append(len(dst)), real(dst, src)))
    # A decode step's fresh inputs: token ids and positions (int64), the mask (bool), and a bf16 row.
    statics = [torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
               torch.zeros(1, 1, 1, 11, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.bfloat16)]
    copy_in = CopyIn([(0, statics[0]), (2, statics[1]), (3, statics[2]), (4, statics[3])])
    for step in range(3):
        args = (torch.tensor([[7 + step]]), "not copied", torch.tensor([[-(2 ** 40) - step]]),
                torch.rand(1, 1, 1, 11) > 0.5, torch.randn(2, 3, dtype=torch.bfloat16))
        copy_in(args)
        for static, a in zip(statics, args[:1] + args[2:]):
            assert static.dtype == a.dtype and torch.equal(static, a)
    assert calls == [4, 4, 4]
    # A source that has no bytes view (an int64 row of a transposed tensor: its last dimension is
    # strided) is copied value by value, and so is every later call.
    row = torch.arange(6, dtype=torch.int64).reshape(2, 3).t()[:1]
    out = [torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.bool)]
    copy_in = CopyIn([(0, out[0]), (1, out[1])])
    copy_in((row, torch.ones(1, 2, dtype=torch.bool)))
    assert torch.equal(out[0], row) and out[1].all() and calls == [4, 4, 4]
    copy_in((torch.full((1, 2), 5), torch.zeros(1, 2, dtype=torch.bool)))
    assert (out[0] == 5).all() and not out[1].any() and calls == [4, 4, 4]
    # Nothing in a bytes view for a 0-d or complex buffer: one by one from the start.
    scalar, cplx = torch.zeros((), dtype=torch.int64), torch.zeros(2, dtype=torch.complex64)
    copy_in = CopyIn([(0, scalar), (1, cplx)])
    copy_in((torch.tensor(3), torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)))
    assert scalar.item() == 3 and torch.equal(cplx, torch.tensor([1 + 2j, 3 - 1j])) and calls == [4, 4, 4]


def test_a_whole_forward_graph_clones_its_outputs_but_where_they_are_borrowed(events):
    # A replay's outputs live in the graph pool, overwritten by the next replay: the caller gets
    # copies, but inside borrowed_outputs() (generate()), the graph's own buffers.
    pool = GraphPool()
    piece = GraphedPiece(lambda x: _cuda(x * 2), "forward", (4,), pool, [None])
    piece.copy_outputs = True
    x = _cuda(torch.randn(4))
    for _ in range(2):  # warm-up, capture: the capture's outputs are the pool's too
        out = piece(x)
        assert out is not piece.outputs or piece.outputs is None
    replayed = piece(x)
    assert events[-1] == "replay" and replayed is not piece.outputs
    torch.testing.assert_close(replayed, piece.outputs)
    with sw.dispatch.borrowed_outputs():
        assert piece(x) is piece.outputs
