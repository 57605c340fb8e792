"""transformers' ``generate()`` through ``sw.compile_generate``: greedy tokens identical to eager
generation, with the default dynamic cache (the KV length a second dynamic size) and with the
static cache, from two traces (prefill, and decode fixed at one token)."""

from __future__ import annotations

import pytest
import torch

import shapewise as sw
from tests.helpers import assert_same

transformers = pytest.importorskip("transformers")


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("direct_call", [True, False])
@pytest.mark.parametrize("static_cache", [False, True])
def test_greedy_generate_equals_eager(static_cache, direct_call):
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
    if direct_call:
        # Prefill initialises the cache's layers (tensors and constants Dynamo's frame sets on them,
        # which the direct call sets too, after checking the layers are as the trace found them).
        # Every call goes past the frame but the one that armed each trace.
        assert fast.direct_info == "trace 1: on; trace 2 (seq=1): on"
        assert fast.direct_calls == len(prompts) + decode_steps - 2 and decode_steps > 10
    rows = fast.report()
    keys = {(r["trace"], r["key"]) for r in rows}
    decode = "{seq=1}" if static_cache else "{kv=1..64, seq=1}"
    assert keys == {("1", "{seq=12}"), ("1", "{seq=2..11}"), ("2 (seq=1)", decode)}


def test_compile_generate_refuses_what_it_chooses_itself():
    model = _llama()
    with pytest.raises(sw.ConfigError, match="chooses \\['sizes'\\] itself"):
        sw.compile_generate(model, prompt_sizes=[8], sizes=[1])
    sw.compile_generate(model, prompt_sizes=[8], backend="eager")
    with pytest.raises(sw.ConfigError, match="compiled already"):
        sw.compile_generate(model, prompt_sizes=[8])


@pytest.mark.gpu
@pytest.mark.parametrize("cudagraphs", ["full", True])
def test_static_cache_decode_in_cuda_graphs_equals_eager(cudagraphs):
    # The static cache is written in place by the graph: its tensors (marked with
    # mark_static_address by transformers) must be used in place, not copied into static buffers.
    model = _llama().cuda()
    prompt = torch.randint(0, 128, (1, 12), device="cuda")
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False, cache_implementation="static")
    fast = sw.compile_generate(model, prompt_sizes=[12], max_length=64, static_cache=True, backend="inductor",
                               cudagraphs=cudagraphs)
    decode_steps = 0
    for _ in range(2):  # the second generate() replays the captured graphs
        out = model.generate(prompt, max_new_tokens=16, do_sample=False)
        assert torch.equal(out, expected)
        decode_steps += out.shape[1] - prompt.shape[1] - 1  # random weights may reach EOS early
    assert fast.traces == 2
    assert fast.direct_calls >= decode_steps - 1  # decode past Dynamo's frame into the replays, but the arming call
