"""``sw.library.GroupedDecodeAttention``: one query token's grouped-query attention over the
unrepeated keys and values. Which variants it rewrites (one token; a mask shared by the heads and
rows), answers against eager with and without masks, and transformers' decoders through
``compile_generate``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shapewise as sw
from tests.helpers import assert_same

transformers = pytest.importorskip("transformers")
from tests.library.test_fuse_projections import bf16_decode_against_fp32, decoder  # noqa: E402
from tests.models.configs import VOCAB  # noqa: E402


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' repeat_kv, then SDPA (as its sdpa_attention_forward with a mask)."""
    n = q.shape[1] // k.shape[1]

    def repeat(t: torch.Tensor) -> torch.Tensor:
        b, h, s, d = t.shape
        return t[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask, dropout_p=0.0, scale=0.3)



@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_one_query_token_attends_the_unrepeated_keys_with_the_same_answers(mask, attention):
    torch.manual_seed(0)
    b, heads, groups, s, d = 2, 8, 2, 10, 16
    k, v = torch.randn(b, groups, s, d), torch.randn(b, groups, s, d)

    def masks(tokens: int):
        if mask == "none":
            return None
        keep = torch.rand(b, 1, tokens, s) > 0.3
        keep[..., 0] = True
        return keep if mask == "bool" else torch.zeros(b, 1, tokens, s).masked_fill(~keep, float("-inf"))

    fast = sw.compile(attend, dynamic_dims={"q": 2, "mask": 2}, sizes=[1, 3], backend="aot_eager",
                      graph_passes=[sw.library.GroupedDecodeAttention(attention=attention)], direct_call=False,
                      cache=False)
    for tokens in (1, 3, 1):
        q, m = torch.randn(b, heads, tokens, d), masks(tokens)
        assert_same(fast(q, k, v, m), attend(q, k, v, m), f"tokens={tokens} mask={mask}")
    graphs = {str(var.binding): sum(n.target == "expand" for n in (var.gm or p.gm).graph.nodes)
              for p in fast.runnable.program.compute_pieces for var in p.variants}
    # one token: the repeats are gone; three (each row its own mask row): kept
    assert sorted(graphs.values()) == [0, 2], graphs
    ops = [n.target for p in fast.runnable.program.compute_pieces for var in p.variants
           for n in (var.gm or p.gm).graph.nodes if n.meta.get("shapewise_rewrite")]
    assert ops == [torch.ops.shapewise.decode_attention.default if attention == "kernel"
                   else F.scaled_dot_product_attention], ops


def test_the_attention_option_is_checked():
    with pytest.raises(sw.ConfigError, match="say 'kernel'.*or 'sdpa'"):
        sw.library.GroupedDecodeAttention(attention="flash")


def test_the_decode_kernels_plan_fills_the_gpu_with_slices_of_whole_tiles():
    from shapewise.library.kernels.decode_attention import BLOCK_S, decode_attention_plan

    for batch, heads, tokens, sms in [(1, 8, 384, 132), (1, 8, 4096, 132), (1, 1, 100_000, 132), (64, 8, 384, 132),
                                      (2, 2, 1, 8), (1, 4, 65, 16), (3, 5, 1000, 7)]:
        parts, chunk = decode_attention_plan(batch, heads, tokens, sms)
        assert chunk % BLOCK_S == 0 and 1 <= parts <= 64
        assert (parts - 1) * chunk < tokens <= parts * chunk  # every slice has tokens; together all of them
        want = min(64, -(-sms // (batch * heads)))  # about one program per multiprocessor, not more
        tiles, per = -(-tokens // BLOCK_S), chunk // BLOCK_S
        assert parts <= want and (per == 1 or -(-tiles // (per - 1)) > want)  # slices no longer than that needs


def test_values_with_their_own_head_dim():
    # MLA-style attention: the values' head dim (12) is not the query's and keys' (16).
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 12)
    fast = sw.compile(attend, dynamic_dims={"k": 2, "v": 2}, sizes=[6], backend="aot_eager",
                      graph_passes=[sw.library.GroupedDecodeAttention()], direct_call=False, cache=False)
    assert_same(fast(q, k, v, None), attend(q, k, v, None), "value head dim 12")
    (piece,) = fast.runnable.program.compute_pieces
    (variant,) = piece.variants
    assert variant.gm is not None and not any(n.target == "expand" for n in variant.gm.graph.nodes)


def test_a_mask_per_head_or_more_query_tokens_are_left_alone():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    per_head = torch.rand(1, 4, 1, 6) > 0.2
    per_head[..., 0] = True
    fast = sw.compile(attend, dynamic_dims={"k": 2, "v": 2}, sizes=[6], backend="aot_eager",
                      graph_passes=[sw.library.GroupedDecodeAttention()], direct_call=False, cache=False)
    assert_same(fast(q, k, v, per_head), attend(q, k, v, per_head), "a mask per head")
    (piece,) = fast.runnable.program.compute_pieces
    (variant,) = piece.variants
    assert sum(n.target == "expand" for n in (variant.gm or piece.gm).graph.nodes) == 2


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_transformers_decoders_decode_on_the_unrepeated_cache(name):
    # Unsplit (splitting_ops=(): SDPA inside the compute piece, as under cudagraphs="full"), a
    # static cache: the decode trace's attention reads the cache's KV heads as they are.
    model, reference = decoder(name), decoder(name)
    fast = sw.compile_generate(model, prompt_sizes=[6], max_length=32, static_cache=True, backend="aot_eager",
                               splitting_ops=(), graph_passes=[sw.library.GroupedDecodeAttention()])
    ids = torch.randint(0, VOCAB, (1, 6))
    run = dict(do_sample=False, max_new_tokens=6, min_new_tokens=6, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        got, want = model.generate(ids, **run), reference.generate(ids, **run)
    assert torch.equal(got.sequences, want.sequences)
    assert_same(got.logits, want.logits, "logits per step")
    decode = fast.runnables[-1].program.compute_pieces
    nodes = [n for p in decode for var in p.variants for n in (var.gm or p.gm).graph.nodes]
    assert sum(n.target is torch.ops.shapewise.decode_attention.default for n in nodes) == \
        model.config.num_hidden_layers
    assert not any("scaled_dot_product" in str(n.target) for n in nodes)
    assert not any(n.target == "expand" for n in nodes), "a repeat of the cache is left in the decode graph"
    marked = [n for n in nodes if n.meta.get("shapewise_rewrite") == "grouped_decode_attention"]
    assert len(marked) == model.config.num_hidden_layers  # each rewritten SDPA says which pass made it


def test_a_dynamic_cache_decode_with_padding_is_rewritten_over_its_range_of_lengths():
    # The default cache: decode is a range variant over the cache's length; the query's sizes are
    # fixed, so its attention is rewritten there too. Left padding: a mask per sequence, shared by
    # the heads. The prefill (six query tokens) keeps its repeats.
    model, reference = decoder("llama"), decoder("llama")
    fast = sw.compile_generate(model, prompt_sizes=[6], max_length=32, backend="aot_eager", splitting_ops=(),
                               graph_passes=[sw.library.GroupedDecodeAttention()])
    ids, mask = torch.randint(0, VOCAB, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    run = dict(do_sample=False, max_new_tokens=6, min_new_tokens=6, return_dict_in_generate=True, output_logits=True,
               attention_mask=mask)
    with torch.no_grad():
        got, want = model.generate(ids, **run), reference.generate(ids, **run)
    assert torch.equal(got.sequences, want.sequences)
    assert_same(got.logits, want.logits, "logits per step")
    prefill, decode = ([n for p in r.program.compute_pieces for var in p.variants for n in (var.gm or p.gm).graph.nodes]
                       for r in fast.runnables)
    repeats = model.config.num_hidden_layers * 2  # keys and values
    assert sum(n.target == "expand" for n in prefill) >= repeats
    assert sum(n.target == "expand" for n in decode) <= sum(n.target == "expand" for n in prefill) - repeats


def test_compile_generate_runs_the_pass_once_where_asked():
    model, reference = decoder("llama"), decoder("llama")
    mine = sw.library.GroupedDecodeAttention(attention="sdpa")
    fast = sw.compile_generate(model, prompt_sizes=[6], max_length=32, static_cache=True, backend="aot_eager",
                               splitting_ops=(), grouped_decode=True, graph_passes=[mine])
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        got, want = model.generate(ids, max_new_tokens=4, do_sample=False), reference.generate(ids, max_new_tokens=4,
                                                                                                 do_sample=False)
    assert torch.equal(got, want)
    nodes = [n for p in fast.runnables[-1].program.compute_pieces for var in p.variants
             for n in (var.gm or p.gm).graph.nodes]
    # the user's own instance (SDPA on the grouped rows), not a second one with the kernel
    assert sum(n.meta.get("shapewise_rewrite") == "grouped_decode_attention" for n in nodes) == 2
    assert not any(n.target is torch.ops.shapewise.decode_attention.default for n in nodes)
    # On the CPU (no CUDA graphs) compile_generate turns neither on by itself.
    plain = sw.compile_generate(decoder("llama"), prompt_sizes=[6], max_length=32, static_cache=True,
                                backend="aot_eager", splitting_ops=())
    options = plain._options
    assert not options.get("graph_passes") and "combo_kernels" not in (options.get("static_options") or {})


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fp32_decode_by_default_in_full_cuda_graphs_gives_eagers_tokens(name):
    # compile_generate's default under full graphs on a GPU runs the pass (and combo kernels). In
    # fp32 the op runs SDPA itself: its output must be laid out as its fake says.
    model, reference = decoder(name).cuda(), decoder(name).cuda()
    fast = sw.compile_generate(model, prompt_sizes=[8], max_length=40, static_cache=True, cudagraphs="full")
    ids = torch.randint(0, VOCAB, (1, 8), device="cuda")
    run = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12, cache_implementation="static",
               disable_compile=True)
    with torch.no_grad():
        want = reference.generate(ids, **run)
        for _ in range(2):  # the second generate replays the captured graphs
            assert torch.equal(model.generate(ids, **run), want)
    nodes = [n for p in fast.runnables[-1].program.compute_pieces for var in p.variants
             for n in (var.gm or p.gm).graph.nodes]
    assert sum(n.target is torch.ops.shapewise.decode_attention.default for n in nodes) == \
        model.config.num_hidden_layers
    # and by default the decode step is one piece (one graph), the prompt split at SDPA (whole_traces={"seq": 1})
    rows = list(fast.report())
    assert len({r["piece"] for r in rows if r["key"] == "{seq=1}"}) == 1, rows
    assert len({r["piece"] for r in rows if r["key"] == "{seq=8}"}) > 1, rows


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_bf16_decode_in_full_cuda_graphs_on_the_unrepeated_cache_against_fp32(name):
    # Inductor and full CUDA graphs (nothing split: the pass sees the attention): bf16 logits
    # against an fp32 eager reference, within what bf16 itself costs, as FuseProjections' GPU test.
    fast, model = bf16_decode_against_fp32(name, graph_passes=[sw.library.GroupedDecodeAttention()])
    nodes = [n for p in fast.runnables[-1].program.compute_pieces for var in p.variants
             for n in (var.gm or p.gm).graph.nodes]
    # Each layer's decode SDPA is the pass's. (Not "no expand left": transformers 5.17's rotary
    # embedding expands its frequencies.)
    marked = [n for n in nodes if n.meta.get("shapewise_rewrite") == "grouped_decode_attention"]
    assert len(marked) == model.config.num_hidden_layers


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_decode_kernel_against_fp32_sdpa(dtype):
    # The Triton kernel itself, one slice of S or many (and the combine), masks of each kind, a
    # mask shared by the batch, head dims that are not powers of two, values with their own.
    from shapewise.library.kernels.decode_attention import _fast_path

    torch.manual_seed(0)
    for b, h, n, s, d, dv, mask in [(1, 8, 4, 384, 64, 64, "bool"), (1, 8, 4, 7, 64, 64, None),
                                    (2, 2, 3, 130, 32, 16, "float"), (2, 2, 1, 65, 80, 48, "bool, batch 1"),
                                    (1, 1, 8, 4096, 128, 128, "bool"), (4, 8, 16, 33, 256, 256, None),
                                    (1, 8, 4, 1, 64, 64, "bool")]:
        q, k, v = (torch.randn(*shape, device="cuda", dtype=dtype) for shape in
                   ((b, h, n, d), (b, h, s, d), (b, h, s, dv)))
        m = None
        if mask is not None:
            keep = torch.rand(1 if "batch 1" in mask else b, 1, 1, s, device="cuda") > 0.3
            keep[..., 0] = True
            m = keep if mask.startswith("bool") else torch.zeros(keep.shape, device="cuda", dtype=dtype).masked_fill(
                ~keep, float("-inf"))
        assert _fast_path(q, k, v, m), (b, h, n, s, d, dv, mask)
        got = torch.ops.shapewise.decode_attention(q, k, v, m, 0.125)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.125,
                                              attn_mask=m if m is None or m.dtype == torch.bool else m.float())
        ref16 = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.125).float()
        # within twice what SDPA's own kernels in this dtype are off by, and a floor of the dtype's rounding
        bound = max(2 * (ref16 - want).abs().max().item(), 4 * torch.finfo(dtype).eps)
        assert (got.float() - want).abs().max().item() <= bound, (b, h, n, s, d, dv, mask)


def test_the_kernels_offsets_are_bounded_by_each_tensors_span():
    # The fast path refuses a tensor whose elements reach 2^31 from its pointer (32-bit offsets);
    # the span counts the strides as they are (a slice, an expand, a transpose).
    from shapewise.library.kernels.decode_attention import _span

    t = torch.zeros(2, 3, 4)
    assert _span(t) == 24 and _span(t[:, :1]) == 16 and _span(t[:1, :, None].expand(1, 3, 5, 4)) == 12
    assert _span(t.transpose(0, 2)) == 24 and _span(torch.zeros(0, 4)) == 0


@pytest.mark.gpu
def test_the_last_program_of_a_head_combines_in_cuda_graphs_and_leaves_its_counters_at_zero():
    # One launch a call: the program that finishes a head last combines its slices (no second
    # kernel), right on every call and on every replay of a captured call with new inputs, and it
    # sets the head's counter back to 0 each time.
    from shapewise.library.kernels.decode_attention import _COUNTERS, _launch, decode_attention_plan

    torch.manual_seed(0)
    b, h, n, s, d = 1, 8, 4, 384, 64
    assert decode_attention_plan(b, h, s, torch.cuda.get_device_properties(0).multi_processor_count)[0] > 1
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in ((b, h, n, d), (b, h, s, d),
                                                                                        (b, h, s, d)))
    mask = torch.rand(1, 1, 1, s, device="cuda") > 0.3

    def check(got):
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125)
        ref16 = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125).float()
        assert (got.float() - want).abs().max().item() <= max(2 * (ref16 - want).abs().max().item(), 1e-2)

    op = torch.ops.shapewise.decode_attention
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            check(op(q, k, v, mask, 0.125))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("attend_slices" in x for x in names) == 3 and not any("combine_slices" in x for x in names), names
    check(_launch(q, k, v, mask, 0.125, torch.cuda.get_device_properties(0).multi_processor_count,
                  last_combines=False))  # the second kernel's combine, where no counters are free
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(q, k, v, mask, 0.125)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(q, k, v, mask, 0.125)
    for _ in range(4):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        check(out)
    pool, used = _COUNTERS._captured[q.device]
    assert used >= b * h and not pool[:used].any().item()
    assert not any(c.any().item() for c in _COUNTERS._streams.values())


def test_captured_launches_past_the_counters_pool_fall_back_and_say_so(monkeypatch, caplog):
    # A capture takes counters of its own from the device's pool, never given back; past its
    # end a captured launch gets none (the second kernel combines) and the log says so, once.
    import logging

    from shapewise.library.kernels.decode_attention import _Counters

    counters, device = _Counters(), torch.device("cuda", 0)
    counters._captured[device] = [torch.zeros(8, dtype=torch.int32), 0]  # a small pool (on the CPU)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.INFO, logger="shapewise"):
        first, second = counters.take(device, 4), counters.take(device, 4)
        assert first.numel() == 4 and second.numel() == 4 and first.data_ptr() != second.data_ptr()
        assert counters.take(device, 4) is None and counters.take(device, 1) is None
    said = [r.getMessage() for r in caplog.records if "used up" in r.getMessage()]
    assert len(said) == 1 and "second kernel" in said[0], said


@pytest.mark.gpu
def test_pdl_attention_in_a_cuda_graph_reads_the_query_and_cache_the_kernels_ahead_wrote():
    # Launched with PDL, the kernel starts while the kernel ahead (here the writes of q and the
    # cache, plain kernels, and the GEMV's with PDL) may still run: it must wait before it reads.
    from shapewise.library.kernels.gemv import GemvConfig, _launch
    from shapewise.library.kernels.pdl import pdl_supported

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0 and Triton's gdc ops")
    torch.manual_seed(0)
    b, h, n, s, d = 1, 8, 4, 384, 64
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(b * h * n * d, 2048, device="cuda", dtype=torch.bfloat16) / 2048**0.5
    k_src, v_src = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = torch.empty_like(k_src), torch.empty_like(v_src)
    mask = torch.rand(1, 1, 1, s, device="cuda") > 0.3
    op = torch.ops.shapewise.decode_attention

    def step(pdl):
        k.copy_(k_src)
        v.copy_(v_src)
        q = _launch(x, w, None, GemvConfig(16, 256), pdl=pdl).view(b, h, n, d)
        return op(q, k, v, mask, 0.125, pdl), q

    step(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, q = step(True)
    for _ in range(4):
        for t in (x, k_src, v_src):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        want = F.scaled_dot_product_attention(q.float(), k_src.float(), v_src.float(), attn_mask=mask, scale=0.125)
        ref16 = F.scaled_dot_product_attention(q, k_src, v_src, attn_mask=mask, scale=0.125).float()
        assert (out.float() - want).abs().max().item() <= max(2 * (ref16 - want).abs().max().item(), 1e-2)
        q_want = F.linear(x.float(), w.float()).view(q.shape)
        assert ((q.float() - q_want).norm() / q_want.norm()).item() < 1e-2
