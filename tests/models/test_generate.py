"""transformers' ``generate()`` through ``sw.compile_generate``: greedy tokens identical to eager
generation, with the default dynamic cache (the KV length a second dynamic size) and with the
static cache, from two traces (prefill, and decode fixed at one token)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import shapewise as sw
from shapewise.errors import ShapewiseError
from tests.helpers import assert_same

transformers = pytest.importorskip("transformers")


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("direct_call", [True, False])
@pytest.mark.parametrize("static_cache", [False, True])
def test_greedy_generate_equals_eager(static_cache, direct_call, caplog):
    model = _llama()
    extra = {"cache_implementation": "static"} if static_cache else {}
    prompts = [torch.randint(0, 128, (1, t), generator=torch.Generator().manual_seed(t)) for t in (12, 7, 12)]
    run = {"max_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    expected = [model.generate(p, **run, **extra) for p in prompts]
    fast = sw.compile_generate(model, prompt_sizes=[12], prompt_ranges=[(2, 11)], max_length=64,
                               static_cache=static_cache, backend="aot_eager", direct_call=direct_call)
    assert model.forward is fast
    decode_steps = 0
    for p, e in zip(prompts, expected):
        got = model.generate(p, **run)
        assert torch.equal(got.sequences, e.sequences)
        assert_same(got.logits, e.logits, "logits per step")  # the tokens alone can agree with a stale cache
        decode_steps += got.sequences.shape[1] - p.shape[1] - 1
    assert fast.traces == 2  # prefill, and decode (the model branches on q_len > 1)
    # A static cache's decode mask is at the cache's length: the trace that marked it dynamic
    # failed and was made again with it fixed, without Dynamo's "Error while creating guard" logs.
    assert not [r for r in caplog.records if r.name.startswith("torch") and r.levelno >= logging.ERROR], \
        [r.getMessage()[:200] for r in caplog.records if r.levelno >= logging.ERROR]
    if direct_call:
        # Prefill initialises the cache's layers (tensors and constants Dynamo's frame sets on them,
        # which the direct call sets too, after checking the layers are as the trace found them).
        # Every call goes past the frame but the one that armed each trace.
        # A static cache's decode mask is 4-d at the cache's length (transformers 5.2x): fixed too.
        assert re.fullmatch(r"trace 1: on; trace 2 \(seq=1(, ctx=\d+)?\): on", fast.direct_info), fast.direct_info
        assert fast.direct_calls == len(prompts) + decode_steps - 2 and decode_steps > 10
        # Decode on a static cache sets nothing on it: its checks of the cache's and layers'
        # attributes are made once per cache (each generate() makes one), then by dict versions.
        # The dynamic cache's layers get new tensors every step: checked in full every call.
        memo = sorted("MEMO[0]" in d.source for d in fast._directs.armed)
        assert memo == ([False, sw._compat.dict_version is not None] if static_cache else [False, False]), memo
    rows = fast.report()
    # the mask's length (ctx) shows where transformers passes one (2-d in 5.17, 4-d for a static cache in 5.2x)
    def no_ctx(text):
        return re.sub(r"\{, ", "{", re.sub(r"(, )?ctx=[\d.]+", "", text)).replace(" ()", "")

    keys = {(no_ctx(r["trace"]), no_ctx(r["key"])) for r in rows}
    decode = "{seq=1}" if static_cache else "{kv=1..64, seq=1}"
    assert keys == {("1", "{seq=12}"), ("1", "{seq=2..11}"), ("2 (seq=1)", decode)}, sorted(keys)


def test_compile_generate_refuses_what_it_chooses_itself():
    model = _llama()
    with pytest.raises(sw.ConfigError, match="chooses \\['sizes'\\] itself"):
        sw.compile_generate(model, prompt_sizes=[8], sizes=[1])
    sw.compile_generate(model, prompt_sizes=[8], backend="eager")
    with pytest.raises(sw.ConfigError, match="compiled already"):
        sw.compile_generate(model, prompt_sizes=[8])


@pytest.mark.gpu
@pytest.mark.parametrize("cudagraphs", ["full", True])
def test_static_cache_decode_in_cuda_graphs_equals_eager(cudagraphs, monkeypatch):
    from shapewise.dispatch import copies

    # The static cache is written in place by the graph: its tensors (marked with
    # mark_static_address by transformers) must be used in place, not copied into static buffers.
    model = _llama().cuda()
    prompt = torch.randint(0, 128, (1, 12), device="cuda")
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False, cache_implementation="static")
    keep = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True,
            "output_hidden_states": True}
    # (disable_compile: with a static cache on a GPU, generate() would compile the forward itself, in
    # CUDA graphs of its own whose outputs the next step overwrites)
    want = model.generate(prompt, **keep, cache_implementation="static", disable_compile=True)
    fast = sw.compile_generate(model, prompt_sizes=[12], max_length=64, static_cache=True, backend="inductor",
                               cudagraphs=cudagraphs)  # keep_cache: on by default in CUDA graphs
    assert model.generate.shapewise_keeps_cache
    decode_steps = 0
    for _ in range(2):  # the second generate() replays the captured graphs
        out = model.generate(prompt, max_new_tokens=16, do_sample=False)
        assert torch.equal(out, expected)
        decode_steps += out.shape[1] - prompt.shape[1] - 1  # random weights may reach EOS early
    assert fast.traces == 2
    assert fast.direct_calls >= decode_steps - 1  # decode past Dynamo's frame into the replays, but the arming call
    # The cache is the one the model keeps (keep_cache), its tensors unmarked: they are used where
    # they are because they stayed there from the warm-up to the capture, and from call to call (no
    # graph captured again; the prefill, its cache initialised before it, captured too). Only the
    # step's fresh inputs (the token, its position, the mask: a few elements each) are copied in,
    # and nothing is written back.
    graphs = fast.runnables[1].runtime.graphs
    pieces = graphs.pieces
    copied = [static for p in pieces for _, static in p.copy_slots] + \
        [static for s in graphs.staged for _, static in s.slots]
    assert pieces and all(p.graph is not None for p in pieces)
    assert not any(p.write_back for p in pieces), [len(p.write_back) for p in pieces]
    assert all(t.numel() <= 64 for t in copied), [tuple(t.shape) for t in copied]
    assert sum(len(p.kept) for p in pieces) >= 4  # the 2 layers' keys and values
    prefill = fast.runnables[0].runtime.graphs.pieces
    assert prefill and all(p.graph is not None and not p.uncaptured for p in prefill), \
        [(p.name, p.uncaptured) for p in prefill]
    assert all(p.recaptures == 0 for p in [*pieces, *prefill]), [(p.name, p.recaptures) for p in pieces]
    # Under full graphs compile_generate splits nothing (a split would only stop Inductor fusing
    # across the attention); piecewise graphs are split at SDPA.
    assert (len(fast.runnables[1].program.pieces) == 1) == (cudagraphs == "full"), \
        [p.name for p in fast.runnables[1].program.pieces]
    # The fresh inputs go in one launch (a foreach copy of their bytes), and generate() borrows the
    # graphs' outputs: no clone of the logits per step.
    copy_ins = [c for c in [p._copy_in for p in pieces] + [s._copy_in for s in graphs.staged] if c is not None]
    assert copy_ins and all(c._bytes is not None for c in copy_ins if len(c.slots) > 1), \
        [[tuple(t.shape) for _, t in c.slots] for c in copy_ins]
    assert getattr(model.generate, "shapewise_borrows", False)
    clones = []
    real_clone = copies.clone_tensors
    monkeypatch.setattr(copies, "clone_tensors", lambda tree: (clones.append(1), real_clone(tree))[1])
    assert torch.equal(model.generate(prompt, max_new_tokens=16, do_sample=False), expected) and not clones
    # A generate() that keeps each step's hidden states gets copies: the same states as eager's.
    got = model.generate(prompt, **keep)
    assert clones
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.hidden_states, want.hidden_states):
        assert_same(step_got, step_want, "hidden states per step")
    assert all(p.recaptures == 0 for p in [*pieces, *prefill])  # (its returned cache a copy of the kept one)


def test_a_static_cache_is_max_length_long_so_every_call_up_to_it_shares_the_traces():
    # transformers sizes a static cache by each call's prompt + new tokens: without compile_generate
    # setting max_cache_len, the first call's short cache was fixed in the traces (the longer prompt
    # size skipped at compile) and a longer call traced twice more.
    model = _llama()
    calls = [(_prompts(4)[0], 4), (_prompts(24)[0], 30), (_prompts(4)[0], 12)]
    run = {"do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    expected = [model.generate(p, max_new_tokens=n, min_new_tokens=n, **run) for p, n in calls]
    fast = sw.compile_generate(model, prompt_sizes=[4, 24], max_length=64, static_cache=True, backend="aot_eager")
    assert model.generation_config.max_cache_len == 64
    for i, ((p, n), e) in enumerate(zip(calls, expected)):
        got = model.generate(p, max_new_tokens=n, min_new_tokens=n, **run)
        assert torch.equal(got.sequences, e.sequences)
        assert_same(got.logits, e.logits, "logits per step")
        if i == 0:  # both prompt sizes compiled by the first call's trace
            assert {r["key"].split(",")[0].strip("{}") for r in fast.report() if r["trace"] == "1"} == \
                {"seq=4", "seq=24"}, fast.report()
    assert fast.traces == 2


def _greedy_equal(model, fast_options, prompts, new_tokens=10):
    """compile_generate's tokens and per-step logits against eager generate() for each prompt;
    returns the compiled forward."""
    run = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
           "return_dict_in_generate": True, "output_logits": True}
    expected = [model.generate(p, **run) for p in prompts]
    fast = sw.compile_generate(model, backend="aot_eager", **fast_options)
    for p, e in zip(prompts, expected):
        got = model.generate(p, **run)
        assert torch.equal(got.sequences, e.sequences)
        assert_same(got.logits, e.logits, "logits per step")
    return fast


def _prompts(*lengths):
    return [torch.randint(3, 128, (1, t), generator=torch.Generator().manual_seed(t)) for t in lengths]


def test_generate_passes_the_compiled_forward_what_it_passes_eager():
    # generate() reads the forward's signature to decide what to pass (position_ids, logits_to_keep,
    # attention_mask): the compiled forward presents the model's own, so it gets the same inputs.
    import inspect

    model = _llama()
    seen = {"eager": [], "compiled": []}
    prepare = model.prepare_inputs_for_generation

    def spy(*args, **kwargs):
        out = prepare(*args, **kwargs)
        seen[which].append(sorted(k for k, v in out.items() if v is not None))
        return out

    model.prepare_inputs_for_generation = spy
    which = "eager"
    signature = inspect.signature(model.forward)
    model.generate(_prompts(12)[0], max_new_tokens=4, do_sample=False)
    fast = sw.compile_generate(model, prompt_sizes=[12], max_length=32, backend="aot_eager")
    assert inspect.signature(fast) == signature
    which = "compiled"
    model.generate(_prompts(12)[0], max_new_tokens=4, do_sample=False)
    assert seen["compiled"] == seen["eager"] and "position_ids" in seen["eager"][0]


@pytest.mark.skipif(sw._compat.TORCH_VERSION < (2, 13), reason="torch 2.11's AOTAutograd fails on the prompt range's "
                    "compile with transformers 5.17's 2-d mask ('u0 possible memo disaster'; seen on the H200)")
@pytest.mark.parametrize("static_cache", [False, True])
def test_sliding_window_decode_is_a_fixed_number_of_traces(static_cache):
    # Sliding-window layers count their tokens in a Python int (cumulative_length): traced as a
    # size, not a constant guarded per value, so decode past the window does not trace per token.
    from tests.models.configs import DECODERS

    factory, cls = DECODERS["mistral"]  # sliding_window=8
    cfg = factory()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    short = _prompts(5)[0]
    run = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    expected = model.generate(short, **run)
    # Prompt ranges either side of the window (the model branches on it).
    options = dict(prompt_sizes=[12], prompt_ranges=[(2, 7), (8, 11)], max_length=40, static_cache=static_cache)
    # Prompts past the window: prefill and decode, two traces whatever the prompt's length (prefill
    # hands decode its window laid out as decode's own steps lay it out, not as a slice of the prompt).
    fast = _greedy_equal(model, options, _prompts(12, 10), new_tokens=6)
    # With a static cache a prompt range's length is fixed per prompt (one prefill trace per length
    # in it): compile_generate leaves the static cache's 4-d mask unmarked (its width is the
    # prompt's or the window's), so its dim 2, the prompt's length, is a constant, and SDPA's
    # broadcast with the keys (Eq(10, s27)) fixes seq to it. Prompt 10 is a trace of its own.
    assert fast.traces == (3 if static_cache else 2), fast.report()
    # A prompt inside the window adds the model's other branches: its prefill, decode while the
    # window fills, and the step that fills it. Never a trace per token.
    assert torch.equal(model.generate(short, **run), expected)
    traces = fast.traces
    for p in _prompts(12, 10, 5):  # (a static cache's prefill traces again at a new length in a range)
        model.generate(p, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert fast.traces == traces <= 5, fast.report()
    # Past Dynamo's frame too: the direct call reads the counters and the window's strided views
    # as the trace did and sets the counter the forward sets (cumulative_length + 1).
    assert "off" not in fast.direct_info, fast.direct_info
    assert fast.direct_calls > 30


def test_hybrid_cache_with_linear_attention_layers():
    # Qwen3-Next: linear-attention layers (convolution and recurrent states, no token dim) beside
    # full-attention layers: decode compiles for the states' own sizes, not for a shared "kv".
    cfg = transformers.Qwen3NextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                       linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                       layer_types=["linear_attention", "full_attention"])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    fast = _greedy_equal(transformers.Qwen3NextForCausalLM(cfg).eval(),
                         dict(prompt_sizes=[12], max_length=32), _prompts(12, 12))
    assert fast.traces == 2


def test_model_without_a_kv_cache_in_generate():
    # OpenAI GPT takes no cache: each step is a prefill one token longer, served by the prefill
    # trace's range past the prompt sizes.
    cfg = transformers.OpenAIGPTConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    fast = _greedy_equal(transformers.OpenAIGPTLMHeadModel(cfg).eval(), dict(prompt_sizes=[12], max_length=32),
                         _prompts(12, 12))
    assert fast.traces == 1


def test_sparse_attention_indexer_cache_is_one_decode_trace():
    # DeepSeek-V3.2 (DSA): each layer's cache also keeps the indexer's keys, [batch, tokens, head
    # dim], growing along dim 1, not 2: marked there, decode is one trace, not one per token.
    if not hasattr(transformers, "DeepseekV32Config"):
        pytest.skip("this transformers has no DeepSeek-V3.2")
    cfg = transformers.DeepseekV32Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        index_n_heads=4, index_head_dim=8, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    fast = _greedy_equal(transformers.DeepseekV32ForCausalLM(cfg).eval(),
                         dict(prompt_sizes=[12], max_length=32), _prompts(12, 12))
    assert fast.traces == 2, fast.direct_info


def _binds_methods_in_forward() -> bool:
    """Whether the installed transformers' RecurrentGemma binds methods to the cache inside its
    forward (``_get_seq_length.__get__(past_key_values)``, transformers 5.17): Dynamo traces no
    ``function.__get__`` (torch 2.11 and 2.13 alike), so no full graph of it exists."""
    import inspect

    try:
        from transformers.models.recurrent_gemma import modeling_recurrent_gemma
    except ImportError:  # no such model here: the test itself fails on the missing class
        return False
    return "__get__(past_key_values)" in inspect.getsource(modeling_recurrent_gemma)


@pytest.mark.xfail(condition=_binds_methods_in_forward(), strict=True, raises=ShapewiseError,
                   reason="this transformers' RecurrentGemma forward binds methods with function.__get__, which "
                          "Dynamo does not trace (shapewise says so); transformers 5.2x does not")
def test_a_recurrent_model_whose_prefill_fixes_the_prompt_length():
    # RecurrentGemma: recurrent blocks (an RG-LRU state and a convolution state, no token dim)
    # beside a windowed attention block; the model's Python fixes the prompt's length in prefill,
    # so the prefill trace is one fixed at the prompt size asked for (the dims the call leaves
    # out, the mask's, follow it), not an error that no dim is dynamic. Decode: 2 traces, as the
    # convolution state (an attribute of the block, not of the cache) comes from prefill in
    # another layout (a slice of the prompt) than decode's steps make.
    cfg = transformers.RecurrentGemmaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=8, lru_width=32,
                                            attention_window_size=8, block_types=["recurrent", "attention"],
                                            pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(cfg).eval()
    fast = _greedy_equal(model, dict(prompt_sizes=[12], max_length=32), [_prompts(12)[0], _prompts(13)[0][:, 1:]],
                         new_tokens=8)
    assert fast.traces == 3, fast.report()  # and not one more for the second prompt


def test_a_model_given_the_whole_sequence_at_each_step_is_refused_with_the_reason():
    # CPM-Ant's generate() passes the whole sequence beside its cache at every step, and the model
    # fixes the length (a Python list over range(seqlen)): each step would be a trace of its own.
    # The first decode step is a DispatchMiss that says so, not a trace per token.
    cfg = transformers.CpmAntConfig(vocab_size=128, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64,
                                    num_hidden_layers=2, prompt_length=4, prompt_types=4, segment_types=4,
                                    position_bias_num_buckets=32, position_bias_max_distance=64)
    torch.manual_seed(0)
    model = transformers.CpmAntForCausalLM(cfg).eval()
    sw.compile_generate(model, prompt_sizes=[12], max_length=32, backend="aot_eager")
    with pytest.raises(sw.DispatchMiss, match=r"this trace fixed seq=13") as info:
        model.generate(_prompts(12)[0], max_new_tokens=3, do_sample=False)
    assert "passes it the whole sequence at every step" in "\n".join(info.value.__notes__)


def test_generate_borrows_the_graphs_outputs_only_where_it_keeps_none():
    from shapewise.dispatch.copies import copy_out, outputs_borrowed
    from shapewise.generate_loop import _keeps_outputs, _shapewise_generate

    model = _llama()
    seen = []

    def generate(inputs=None, generation_config=None, logits_processor=None, **kwargs):  # generate()'s own order
        seen.append(outputs_borrowed())

    model.generate = generate
    model.generate = _shapewise_generate(model)
    ids = torch.zeros(1, 2, dtype=torch.long)
    model.generate(ids, max_new_tokens=3)
    model.generate(ids, do_sample=True, output_logits=True,
                   return_dict_in_generate=True)  # the logits it keeps are its own copies
    model.generate(ids, return_dict_in_generate=True, output_hidden_states=True)
    model.generate(ids, num_beams=2)
    keeps = transformers.GenerationConfig(return_dict_in_generate=True, output_hidden_states=True)
    model.generate(ids, keeps)  # a generation config by position counts as one by name
    model.generate(ids, guidance_scale=1.5)
    model.generate(ids, transformers.GenerationConfig(max_new_tokens=2))
    assert seen == [True, True, False, False, False, False, True] and not outputs_borrowed()
    assert _keeps_outputs(model, {"return_dict_in_generate": True, "output_attentions": True}) == \
        "it returns each step's hidden states or attentions"
    assert _keeps_outputs(model, {"assistant_model": model}) == "assistant_model is set"
    assert _keeps_outputs(model, {"penalty_alpha": 0.6, "top_k": 4}) == "penalty_alpha is set"
    # The generation config counts as the call's own arguments do.
    model.generation_config.return_dict_in_generate = model.generation_config.output_hidden_states = True
    assert _keeps_outputs(model, {}) is not None and _keeps_outputs(model, {"output_hidden_states": False}) is None
    # compile_generate wraps transformers' generate() only: not one the model replaced, nor with a
    # dynamic cache (whose tensors are the forward's outputs), nor without CUDA graphs.
    for static, cudagraphs in ((True, False), (False, "full")):
        m = _llama()
        sw.compile_generate(m, prompt_sizes=[4], static_cache=static, backend="aot_eager", cudagraphs=cudagraphs,
                            fuse_projections=False, grouped_decode=False, combo_kernels=False)
        assert not getattr(m.generate, "shapewise_borrows", False) and "generate" not in vars(m)
    # Outside the context the graphs' outputs are cloned; inside they are the buffers themselves.
    buffer = torch.zeros(3)
    run = copy_out(lambda: {"logits": buffer})
    assert run()["logits"] is not buffer and torch.equal(run()["logits"], buffer)
    with sw.dispatch.borrowed_outputs():
        assert run()["logits"] is buffer
    assert run()["logits"] is not buffer


def _bert_decoder():
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64, is_decoder=True)
    return transformers.BertLMHeadModel(cfg).eval()


def test_a_model_transformers_marks_not_compilable_keeps_its_dynamic_cache(caplog):
    """BERT's decoder builds its mask for the prompt's length, not a static cache's, under a trace
    (``_can_compile_fullgraph = False``): static_cache=True keeps the dynamic cache, with a warning,
    and generate() gives eager's tokens; "force" asks for the static cache anyway."""
    torch.manual_seed(0)
    model = _bert_decoder()
    prompt = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    run = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    expected = model.generate(prompt, **run)
    with caplog.at_level(logging.WARNING, logger="shapewise"):
        fast = sw.compile_generate(model, prompt_sizes=[8], max_length=32, static_cache=True, backend="aot_eager")
    assert fast.static_cache is False
    assert any("_can_compile_fullgraph = False" in r.getMessage() and "static_cache='force'" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert model.generation_config.cache_implementation != "static"
    assert torch.equal(model.generate(prompt, **run), expected)
    assert fast.traces == 2
    forced = sw.compile_generate(_bert_decoder(), prompt_sizes=[8], max_length=32, static_cache="force",
                                 backend="aot_eager")
    assert forced.static_cache is True
    with pytest.raises(sw.ConfigError, match="static_cache must be True, False or 'force', got 'yes'"):
        sw.compile_generate(_bert_decoder(), prompt_sizes=[8], static_cache="yes")


def test_whole_traces_split_the_prompt_trace_and_compile_decode_whole():
    # whole_traces={"seq": 1}: the decode trace (seq fixed at 1) is one piece, the prompt trace is split at
    # SDPA (its pieces deduped across layers); both give eager's tokens and logits.
    model = _llama()
    fast = _greedy_equal(model, dict(prompt_sizes=[4, 24], max_length=64, static_cache=True, splitting_ops=("sdpa",),
                                     whole_traces={"seq": 1}), _prompts(4, 24), new_tokens=6)
    pieces = {}
    for r in fast.report():
        pieces.setdefault(r["trace"].split()[0], set()).add(r["piece"])
    assert len(pieces["2"]) == 1 and len(pieces["1"]) > 1, pieces
    assert fast.traces == 2


@pytest.mark.parametrize("bad", ["seq", {"seq": "1"}, {1: 1}, {"seq": True}])
def test_whole_traces_must_map_dim_names_to_sizes(bad):
    with pytest.raises(sw.ConfigError, match="whole_traces must map dim names to sizes"):
        sw.compile(torch.nn.Linear(4, 4), sizes=[2], whole_traces=bad)


def test_keep_cache_reuses_one_static_cache_and_gives_eagers_tokens():
    # keep_cache=True: generate() uses one static cache the model
    # keeps, reset in place each call, so the tensors a graph reads in place never move; a call that returns its
    # cache returns a copy. Eager's tokens and logits (those calls return their caches), and no third trace.
    model = _llama()
    prompts = _prompts(4, 24)
    plain = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    expected = [model.generate(p, **plain) for p in prompts]
    returned = model.generate(prompts[1], **plain, return_dict_in_generate=True).past_key_values
    fast = _greedy_equal(model, dict(prompt_sizes=[4, 24], max_length=64, static_cache=True, keep_cache=True),
                         prompts, new_tokens=6)
    assert model.generate.shapewise_keeps_cache
    kept = model._prepare_static_cache.shapewise_kept
    (cache,) = kept.values()
    addresses = set()
    for _ in range(2):
        for p, e in zip(prompts, expected):
            assert torch.equal(model.generate(p, **plain), e)
            assert list(kept.values()) == [cache]
            addresses.add(cache.layers[0].keys.data_ptr())
    assert len(addresses) == 1
    # A returned cache is the caller's: a copy, holding what eager's call left in its own, untouched by the next call.
    mine = model.generate(prompts[1], **plain, return_dict_in_generate=True).past_key_values
    assert mine is not cache and list(kept.values()) == [cache]
    model.generate(prompts[0], **plain)
    for a, b in zip(mine.layers, returned.layers):  # (eager's: a dynamic cache of the positions written)
        n = b.keys.shape[-2]
        assert_same((a.keys[..., :n, :], a.values[..., :n, :]), (b.keys, b.values), "the returned cache")
        assert not a.keys[..., n:, :].any()
    assert fast.traces == 2
    with pytest.raises(sw.ConfigError, match="keep_cache must be True, False or None .*, got 'yes'"):
        sw.compile_generate(_llama(), prompt_sizes=[4], keep_cache="yes")


def test_keep_cache_threads_get_caches_of_their_own_and_a_users_error_is_not_blamed_on_it():
    # Calls on several threads at once take the kept cache in turn (one waits while another holds it): eager's
    # tokens, no trace beyond the two. A first call that fails for a reason of its own (a prompt no size
    # serves) raises that, and keep_cache stays on.
    import threading

    model = _llama()
    prompts = _prompts(*range(4, 10))
    run = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    want = [model.generate(p, **run) for p in prompts]
    fast = sw.compile_generate(model, prompt_sizes=list(range(4, 10)), max_length=64, static_cache=True,
                               keep_cache=True, backend="aot_eager")
    with pytest.raises(sw.errors.DispatchMiss):
        model.generate(_prompts(30)[0], **run)
    assert model.generate.shapewise_keeps_cache
    bad = []

    def work(i):
        for _ in range(3):
            if not torch.equal(model.generate(prompts[i], **run), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not bad and fast.traces == 2
