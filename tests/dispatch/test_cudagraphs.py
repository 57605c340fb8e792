"""Piecewise CUDA graphs: validation (CPU) and replay correctness (GPU, marker ``gpu``)."""

from __future__ import annotations

import pytest
import torch

import shapewise as sw
from shapewise.dispatch.cudagraphs import CudaGraphs, GraphRuntime
from shapewise.dispatch.graphed import GraphPool
from shapewise.dispatch.plan import GraphPlan, GraphSize
from shapewise.ir.effects import mutated_inputs
from shapewise.models import ATTENTION_OP, ATTENTION_OUT_OP, ToyTransformer, attention
from tests.helpers import assert_same, column_major_after, dynamo_graph


def test_capture_sizes_must_be_compiled_or_inside_a_range():
    gm = dynamo_graph(lambda x: x * 2, torch.randn(4, 3))
    program = sw.Pipeline([sw.Concretize(sizes=[1, 2], ranges=[(9, 64)]), sw.Lower(backend="eager"),
                           sw.BuildDispatch()]).run(gm).program
    keys = CudaGraphs(capture_sizes=[2, 16]).capture_keys(program)
    assert [k for k, _ in keys] == [(16,), (2,)]  # largest first
    assert not keys[0][1].is_static  # 16 is served by the range's kernels
    with pytest.raises(sw.ConfigError, match=r"capture size \{s\d+=5\} is not compiled"):
        CudaGraphs(capture_sizes=[5]).capture_keys(program)
    with pytest.raises(sw.ConfigError, match="cudagraphs is off"):
        sw.compile(lambda x: x, sizes=[1], capture_sizes=[1])


@pytest.mark.parametrize("mode", ["lazy", "background"])
def test_capture_refuses_pieces_that_compile_later(mode):
    gm = dynamo_graph(lambda x: x * 2, torch.randn(4, 3))
    pipe = sw.Pipeline([sw.Concretize(sizes=[1, 2]), sw.Lower(backend="eager", compile=mode), CudaGraphs()])
    with pytest.raises(sw.ConfigError, match=f"Lower\\(compile='{mode}'\\) compiles them later"):
        pipe.run(gm)


def _interleave_then_split(x):
    # At n=1 eager's reshape is a stride-0 view (the trace shows a contiguous copy), so the
    # attention output after it and the piece after attention see other layouts than traced.
    y = x.unsqueeze(1).expand(-1, 2, -1).reshape(-1, x.shape[1])
    return (y + torch.ops.shapewise_toy.attention(y.t()[None], y.t()[None], y.t()[None])[0].t()).reshape(1, -1)


def test_static_buffers_take_the_layout_each_variant_was_compiled_for():
    import dataclasses

    from shapewise.dispatch.cudagraphs import buffer_layouts

    gm = dynamo_graph(_interleave_then_split, torch.randn(5, 6))
    program = sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(sizes=[1, 2], ranges=[(3, 8)]),
                           sw.Lower(backend="eager"), sw.BuildDispatch()]).run(gm).program
    keys = CudaGraphs(capture_sizes=[1, 2, 4]).capture_keys(program)
    last = program.pieces[-1]
    cuda_metas = [dataclasses.replace(m, device=torch.device("cuda")) if hasattr(m, "device") else m
                  for m in last.shapes.inputs]  # as if on a GPU: buffers are made for CUDA inputs only
    layouts = buffer_layouts(cuda_metas, program.shapes.symbols, keys, last)
    for i, per_key in enumerate(layouts):
        if per_key is None:
            continue
        for key, binding in keys:
            variant = last.variant_for(binding)
            shape, stride, offset = per_key[key]
            if binding.is_static:  # the layout the variant was compiled for
                arg = variant.example_args[i]
                assert (shape, stride, offset) == (tuple(arg.shape), arg.stride(), arg.storage_offset())
    strides = {key: [per_key[key][1] for per_key in layouts if per_key is not None] for key, _ in keys}
    assert (0, 1) in strides[(1,)]  # eager's stride-0 view at n=1, not the traced contiguous layout
    assert (0, 1) not in strides[(2,)] and (0, 1) not in strides[(4,)]


def test_static_buffer_inside_a_range_takes_the_range_variants_layout():
    import dataclasses

    from shapewise.dispatch.cudagraphs import buffer_layouts

    gm = dynamo_graph(column_major_after, torch.randn(7, 5))
    program = sw.Pipeline([sw.Split(ops=[ATTENTION_OP]), sw.Concretize(ranges=[(3, 7)]),
                           sw.Lower(backend="eager"), sw.BuildDispatch()]).run(gm).program
    keys = CudaGraphs(capture_sizes=[5]).capture_keys(program)
    last = program.pieces[-1]
    cuda_metas = [dataclasses.replace(m, device=torch.device("cuda")) if hasattr(m, "device") else m
                  for m in last.shapes.inputs]
    layouts = [per_key[(5,)] for per_key in buffer_layouts(cuda_metas, program.shapes.symbols, keys, last) if per_key]
    x = torch.randn(5, 5)
    z = x.t().contiguous().t()[::3] * 2  # column-major at 5, as the range variant before it makes it
    assert (tuple(z.shape), z.stride(), 0) in layouts


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["inductor", "eager"])
def test_replay_at_a_size_where_eager_lays_out_otherwise(backend):
    graphed = sw.compile(_interleave_then_split, sizes=[1, 2], ranges=[(3, 8)], splitting_ops=[ATTENTION_OP],
                         backend=backend, cudagraphs=True, capture_sizes=[1, 2, 4])
    for n in (1, 2, 4, 1, 4):
        x = torch.randn(n, 6, device="cuda")
        assert_same(graphed(x), _interleave_then_split(x), f"n={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend, mode", [("inductor", True), ("eager", True), ("inductor", "full")])
def test_replay_matches_uncaptured_and_never_goes_stale(backend, mode):
    torch.manual_seed(0)
    model = ToyTransformer(layers=2, dim=64, heads=4, hidden=128, vocab=128).cuda()
    kwargs = dict(sizes=[1, 2, 8], ranges=[(9, 64)], splitting_ops=[ATTENTION_OP], backend=backend)
    plain = sw.compile(model, **kwargs)
    graphed = sw.compile(model, cudagraphs=mode, capture_sizes=[1, 2, 8, 24], **kwargs)
    with torch.no_grad():
        # each captured size twice (the first call at a size warms up, the second captures)
        for n in (8, 1, 2, 24, 8, 24, 1, 2, 30):  # 30: a range size that is not captured
            ids = torch.randint(0, 128, (n,), device="cuda")
            expected = plain(ids)
            got = graphed(ids)
            assert_same(got, expected, f"n={n}")
            assert_same(got, model(ids), f"n={n} vs eager")
        # Outputs are the caller's: a later call does not overwrite an earlier result.
        a_ids, b_ids = (torch.randint(0, 128, (8,), device="cuda") for _ in range(2))
        a = graphed(a_ids)
        a_copy = a.clone()
        graphed(b_ids)
        assert torch.equal(a, a_copy)
    pieces = graphed.runnable.runtime.graphs.pieces
    assert {p.key for p in pieces} == {(1,), (2,), (8,), (24,)}
    assert all(p.graph is not None and p.fallbacks == 0 for p in pieces)


@pytest.mark.gpu
def test_moved_parameter_falls_back_instead_of_reading_stale_memory():
    model = ToyTransformer(layers=1, dim=32, heads=2, hidden=64, vocab=64).cuda()
    graphed = sw.compile(model, sizes=[4], splitting_ops=[ATTENTION_OP], backend="eager", cudagraphs=True)
    ids = torch.randint(0, 64, (4,), device="cuda")
    with torch.no_grad():
        graphed(ids)
        graphed(ids)  # captured
        model.head.weight = torch.nn.Parameter(model.head.weight.detach() * 2)  # a new tensor
        assert_same(graphed(ids), model(ids))
    assert any(p.fallbacks for p in graphed.runnable.runtime.graphs.pieces)


def _accumulate(x, total):
    total.add_(x.sum(0))  # writes an input in place, as a KV cache update does
    return x * 2


@pytest.mark.gpu
@pytest.mark.parametrize("backend, mode", [("inductor", True), ("aot_eager", "full")])
def test_an_input_the_graph_writes_is_written_once_per_call_and_reaches_the_caller(backend, mode):
    graphed = sw.compile(_accumulate, dynamic_dims={"x": 0}, sizes=[4], backend=backend, cudagraphs=mode)
    total, expected = torch.zeros(3, device="cuda"), torch.zeros(3, device="cuda")
    for _ in range(4):  # warm-up, capture + replay, replay, replay
        x = torch.randn(4, 3, device="cuda")
        assert_same(graphed(x, total), x * 2)
        expected += x.sum(0)
        assert_same(total, expected)


def test_pad_runner_pads_inputs_and_slices_outputs():
    from shapewise.dispatch.padding import pad_runner

    seen = []

    def run(n, x, w):
        seen.append((n, tuple(x.shape)))
        return (x.cumsum(0) @ w, w.sum())

    padded = pad_runner(run, 3, 8, in_dims=[None, (0,), None], int_args=[0], out_dims=[(0,), ()])
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    out, total = padded(3, x, w)
    assert seen == [(8, (8, 4))]
    assert_same(out, x.cumsum(0) @ w)
    assert_same(total, w.sum())


@pytest.mark.gpu
def test_padding_to_the_next_captured_size():
    model = ToyTransformer(layers=1, dim=32, heads=2, hidden=64, vocab=64).cuda()
    graphed = sw.compile(model, sizes=[4, 16], splitting_ops=[ATTENTION_OP], backend="inductor",
                         cudagraphs={"mode": "piecewise", "pad": True})
    with torch.no_grad():
        for n in (4, 3, 9, 16, 1):
            ids = torch.randint(0, 64, (n,), device="cuda")
            assert_same(graphed(ids), model(ids), f"n={n}")
        with pytest.raises(sw.DispatchMiss):
            graphed(torch.randint(0, 64, (17,), device="cuda"))


def test_mode_capture_and_full_up_to_are_checked_and_full_and_piecewise_splits_by_size():
    for bad, match in ((dict(mode="fullish"), "must be one of"), (dict(capture="later"), "'first_call' or 'startup'"),
                       (dict(full_up_to=0), "positive int")):
        with pytest.raises(sw.ConfigError, match=match):
            CudaGraphs(**bad)
    both = CudaGraphs(mode="full_and_piecewise", full_up_to=8)
    assert [both.is_full(k) for k in ((1,), (8,), (9,), (4, 16))] == [True, True, False, False]
    assert CudaGraphs(mode="full").is_full((4096,)) and not CudaGraphs().is_full((1,))


def test_dummy_inputs_take_each_sizes_layout_and_keep_fixed_inputs_as_passed():
    from shapewise.dispatch.capture import dummy_inputs

    weight = torch.nn.Parameter(torch.randn(6, 6))
    gm = dynamo_graph(lambda x, w: x @ w, torch.randn(6, 5).t(), weight)  # x: a column-major [5, 6] view
    program = sw.Pipeline([sw.Concretize(sizes=[2, 8]), sw.Lower(backend="eager"), sw.BuildDispatch()]).run(gm).program
    n, x, w = dummy_inputs(program, (8,), [5, torch.randn(6, 5).t(), weight])  # the graph's inputs: s, x, w
    assert n == 8
    assert w is weight  # a fixed-size input is the caller's own
    assert x.shape == (8, 6) and x.stride() == (1, 8) and not x.any()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["inductor", "eager"])
def test_full_and_piecewise_at_startup_captures_every_size_on_the_first_call(backend):
    torch.manual_seed(0)
    model = ToyTransformer(layers=2, dim=64, heads=4, hidden=128, vocab=128).cuda()
    graphed = sw.compile(model, sizes=[1, 2, 8, 32], splitting_ops=[ATTENTION_OP], backend=backend,
                         cudagraphs={"mode": "full_and_piecewise", "full_up_to": 2, "capture": "startup"})
    with torch.no_grad():
        for n in (8, 1, 32, 2, 8, 1):
            ids = torch.randint(0, 128, (n,), device="cuda")
            assert_same(graphed(ids), model(ids), f"n={n}")
            pieces = graphed.runnable.runtime.graphs.pieces
            assert all(p.graph is not None for p in pieces)  # all captured before the first answer
    runnable = graphed.runnable
    assert runnable.capture_info["sizes"] == ["{n=1}", "{n=2}", "{n=8}", "{n=32}"]
    assert runnable.capture_info["pool_bytes"] > 0 and runnable.capture_info["buffers_bytes"] > 0
    assert runnable.capture_info["split_pools_bytes"] > 0  # the attention outputs of sizes 8 and 32
    whole = {p.key for p in pieces if p.name == "forward"}
    assert whole == {(1,), (2,)}  # full graphs up to full_up_to, piecewise above
    assert {p.key for p in pieces if p.name != "forward"} == {(8,), (32,)}
    assert all(p.fallbacks == 0 for p in pieces)


@pytest.mark.gpu
def test_an_attention_that_writes_its_output_costs_no_copy_between_graphs():
    """vLLM's attention-with-output form: the graph before the op allocates the output, the op
    fills it, the graph after reads it where it is; only the caller's input is copied per call."""
    torch.manual_seed(0)
    model = ToyTransformer(layers=2, dim=64, heads=4, hidden=128, vocab=128, out_variant=True).cuda()
    graphed = sw.compile(model, sizes=[4], splitting_ops=[ATTENTION_OUT_OP], backend="inductor", cudagraphs=True)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, 128, (4,), device="cuda")
            assert_same(graphed(ids), model(ids))
    pieces = graphed.runnable.runtime.graphs.pieces
    assert len(pieces) == 3 and all(p.graph is not None for p in pieces)
    assert sum(len(p.copy_slots) for p in pieces) == 0
    assert [len(s.slots) for s in graphed.runnable.runtime.graphs.staged] == [1]  # the ids, copied in once


class Residual(torch.nn.Module):
    """The caller's x is read by the graph before the attention op and by the one after it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], 3, 2, 16).unbind(1)
        return x + self.o(attention(q, k, v).reshape(x.shape[0], 32))


@pytest.mark.gpu
@pytest.mark.parametrize("split_pools", [True, False])
def test_the_callers_input_is_copied_in_once_for_every_graph_that_reads_it(split_pools):
    torch.manual_seed(0)
    model = Residual().cuda()
    graphed = sw.compile(model, sizes=[4, 8], splitting_ops=[ATTENTION_OP], backend="inductor",
                         cudagraphs={"split_pools": split_pools})
    with torch.no_grad():
        for i, n in enumerate((4, 8, 4, 8, 4, 8, 4, 8)):
            x = torch.randn(n, 32, device="cuda")
            assert_same(graphed(x), model(x), f"n={n}")
            if i >= 4:  # after the warm-up and capture calls, which see fresh tensors (one passed on
                # both would be read in place, as a buffer the caller keeps)
                x.mul_(-1)  # the caller writes its tensor between calls: the next call reads the new values
                assert_same(graphed(x), model(x), f"n={n}, written")
    pieces = graphed.runnable.runtime.graphs.pieces
    assert all(p.graph is not None and p.fallbacks == 0 for p in pieces)
    for key in ((4,), (8,)):
        # The attention's output: read where the op put it (its private pool), or copied in.
        assert sum(len(p.adopted) for p in pieces if p.key == key) == int(split_pools)
        assert sum(len(p.copy_slots) for p in pieces if p.key == key) == int(not split_pools)
        assert [len(s.slots) for s in graphed.runnable.runtime.graphs.staged if s.key == key] == [1]  # x, once
    assert all(p.group.recaptures == 0 for p in pieces)


_HOLD: list = []


@torch.library.custom_op("shapewise_test::doubles", mutates_args=())
def doubles(x: torch.Tensor) -> torch.Tensor:
    if _HOLD:  # allocate first and keep it: the output lands elsewhere in the op's pool
        _HOLD.append(torch.empty(4096, device=x.device))
    return x * 2 + 1


@doubles.register_fake
def _(x):
    return torch.empty_like(x)


class AroundAnOp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(doubles(self.a(x)))


@pytest.mark.gpu
def test_a_splitting_output_that_moves_makes_its_size_capture_again_with_a_copy():
    torch.manual_seed(0)
    model = AroundAnOp().cuda()
    graphed = sw.compile(model, sizes=[4], splitting_ops=["shapewise_test::doubles"], backend="inductor",
                         cudagraphs=True)
    _HOLD.clear()
    try:
        with torch.no_grad():
            for call in range(8):
                if call == 4:
                    _HOLD.append("shift")  # from now on the op's output is not where the capture found it
                x = torch.randn(4, 16, device="cuda")
                assert_same(graphed(x), model(x), f"call {call}")
                if call == 3:  # warmed up, captured, replayed: the op's output read in place
                    (second,) = [p for p in graphed.runnable.runtime.graphs.pieces if p.adopted]
                    assert not second.copy_slots and second.group.adopt
    finally:
        _HOLD.clear()
    pieces = graphed.runnable.runtime.graphs.pieces
    assert all(p.graph is not None for p in pieces)  # captured again: call 4 moved, 5 warmed up, 6 captured
    assert second.group.recaptures == 1 and not second.group.adopt
    assert not second.adopted and len(second.copy_slots) == 1  # now copied in, every call


def _accumulate_static(x, total, cache):
    total.add_(x.sum(0))  # an input the graph writes, copied into graphs
    cache.add_(1)  # a static-address input the graph writes (a KV cache's stand-in)
    return x * 2


def _accumulate_program():
    cache = torch.zeros(3)
    torch._dynamo.mark_static_address(cache)
    gm = dynamo_graph(_accumulate_static, torch.randn(4, 3), torch.zeros(3), cache)
    program = sw.Pipeline([sw.Concretize(sizes=[2]), sw.Lower(backend="eager"), sw.BuildDispatch()]).run(gm).program
    total = torch.full((3,), 7.0)
    by_name = {"L_x_": torch.randn(4, 3), "L_total_": total, "L_cache_": cache}
    example = [by_name.get(str(n.target), 4) for n in gm.graph.nodes if n.op == "placeholder"]  # Dynamo's order
    return program, example, total, cache


def test_dummy_inputs_use_what_the_graph_writes_where_it_is():
    # A start-up capture runs on dummies, but the inputs the graph writes (a KV cache, marked or
    # not) are the caller's own, so the graphs use them in place as the real calls will pass them.
    from shapewise.dispatch.capture import dummy_inputs
    from shapewise.ir.effects import mutated_inputs

    program, example, total, cache = _accumulate_program()
    written = mutated_inputs(program.gm)
    args = dummy_inputs(program, (2,), example, written)
    (i_total,) = [i for i, e in enumerate(example) if e is total]
    (i_cache,) = [i for i, e in enumerate(example) if e is cache]
    assert {i_total, i_cache} <= written
    assert args[i_total] is total and args[i_cache] is cache
    (i_x,) = [i for i, e in enumerate(example) if isinstance(e, torch.Tensor) and e.shape == (4, 3)]
    assert args[i_x].shape == (2, 3) and args[i_x] is not example[i_x]  # zeros at the size captured


def _planned_graphs(program, keys):
    """``program`` with CUDA graphs planned at ``keys`` (whole-forward), for the CPU tests of
    start-up capture: a runtime built with ``_no_graphs`` runs its plain runners there."""
    plan = program.dispatch
    sizes = tuple(GraphSize(k, next(b for b in plan.exact if b.key == k), True) for k in keys)
    graphs = GraphPlan(sizes, {}, written=frozenset(mutated_inputs(program.gm)), at_startup=True)
    return program.replace(dispatch=plan.replace(graphs=graphs))


def _no_graphs(program, plan):
    return GraphRuntime(GraphPool(), {}, [], [])


def test_startup_capture_leaves_what_the_graph_writes_as_it_was(monkeypatch):
    # capture_now's two dummy calls write the caller's cache and accumulator: restored afterwards.
    from shapewise.dispatch import capture, runtime

    program, example, total, cache = _accumulate_program()
    program = _planned_graphs(program, [(2,)])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # an eager program on the CPU
    monkeypatch.setattr(runtime, "build_graphs", _no_graphs)
    monkeypatch.setattr(capture, "graph_memory", lambda g: {"pool_bytes": 0, "buffers_bytes": 0,
                                                            "split_pools_bytes": 0})
    before = cache.clone()  # (the trace ran the function once)
    capture.capture_now(program, runtime.build_runtime(program), example, progress=False)
    assert torch.equal(total, torch.full((3,), 7.0)) and torch.equal(cache, before)


def test_a_failed_startup_capture_is_reported_and_the_calls_go_on(caplog, monkeypatch):
    from shapewise.dispatch import runtime

    gm = dynamo_graph(lambda x: x * 2, torch.randn(4, 3))
    runnable = sw.Pipeline([sw.Concretize(sizes=[2, 4]), sw.Lower(backend="eager"), sw.BuildDispatch()]).run(gm)
    program = _planned_graphs(runnable.program, [(2,), (4,)])
    monkeypatch.setattr(runtime, "build_graphs", _no_graphs)
    if torch.cuda.is_available():
        pytest.skip("the failure this test provokes is the missing GPU")
    broken = type(runnable)(program)  # capture_now fails here: no CUDA to synchronise
    x = torch.randn(2, 3)
    args = [2, x] if len(program.shapes.inputs) == 2 else [x]
    assert_same(broken(*args), (x * 2,))
    assert "error" in broken.capture_info
    assert "start-up CUDA-graph capture failed" in caplog.text
    assert_same(broken(*args), (x * 2,))  # and no second attempt
