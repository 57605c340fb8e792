"""A zoo of transformers architectures (tiny random configs, SDPA attention, float32, eval, no grad)
through ``sw.compile`` and the ``"shapewise"`` torch.compile backend, compared with eager at
every size: causal decoders (sequence length dynamic), encoders (batch and sequence named apart,
padded masks), T5 (source and target lengths named apart) and ViT (batch dynamic)."""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch

import shapewise as sw
from tests.helpers import assert_same

T = pytest.importorskip("transformers")

from tests.models.configs import DECODERS, VOCAB, ZOO  # noqa: E402


@functools.cache
def model_of(name: str) -> torch.nn.Module:
    """The zoo's model ``name``, built once per session (the tests only run it)."""
    factory, cls = ZOO[name]
    config = factory()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _rows(fast) -> list[tuple[str | None, str]]:
    """(trace, key) of the report, each once, in order."""
    return list(dict.fromkeys((r.get("trace"), r["key"]) for r in fast.report()))


# -- decoders: dim 1 of input_ids (the sequence) dynamic ---------------------------------------


def check_decoder(name, fast, seqs, batch=2):
    model = model_of(name)
    for n in seqs:
        ids = torch.randint(0, VOCAB, (batch, n))
        assert_same(fast(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits,
                    f"{name} seq={n}")


@pytest.mark.parametrize("name", DECODERS)
def test_decoder(name):
    fast = sw.compile(model_of(name), dynamic_dims={"input_ids": 1}, sizes=[1, 4, 16], ranges=[(17, 40)],
                      splitting_ops=["sdpa"], backend="aot_eager", direct_call=True)
    check_decoder(name, fast, (4, 1, 16, 30, 1))
    # Past Dynamo's frame once each trace is armed by its first call: 16, 30 and the second 1.
    assert fast.direct_info == "trace 1: on; trace 2 (n=1): on" and fast.direct_calls == 3
    # The trace at 4 serves 4, 16 and the range; it leaves 1 out: every one of these models runs
    # transformers' sdpa_attention_forward, whose `is_causal = q_length > 1 and ...` puts the
    # guard seq > 1 in the trace, so the call at 1 makes a second trace, specialised to 1.
    assert fast.traces == 2
    assert _rows(fast) == [("1", "{n=4}"), ("1", "{n=16}"), ("1", "{n=17..40}"), ("2 (n=1)", "{n=1}")]


def test_decoder_called_by_position():
    # Llama's forward is wrapped in decorators whose wrapper takes (*args, **kwargs), the module
    # itself in args[0]: a positional input_ids is the traced frame's args[1]. It was read as
    # attention_mask's, so the size was not named and 16 was silently left out (a DispatchMiss).
    model = model_of("llama")
    fast = sw.compile(model, dynamic_dims={"input_ids": 1}, sizes=[4, 16], splitting_ops=["sdpa"],
                      backend="aot_eager")
    for n in (4, 16):
        ids = torch.randint(0, VOCAB, (2, n))
        assert_same(fast(ids, use_cache=False).logits, model(ids, use_cache=False).logits, f"seq={n}")
    assert [key for _, key in _rows(fast)] == ["{n=4}", "{n=16}"]


def test_direct_call_on_a_decoder():
    # Past Dynamo's frame (direct_call): the arguments are items of the decorators' *args /
    # **kwargs, the result a CausalLMOutputWithPast rebuilt from the program's outputs.
    model = model_of("llama")
    # Decode (1) is a second trace (seq > 1 in sdpa_attention_forward), with a direct call of its own.
    fast = sw.compile(model, dynamic_dims={"input_ids": 1}, sizes=[1, 4, 16], splitting_ops=["sdpa"],
                      backend="aot_eager", direct_call=True)
    for n in (4, 16, 1, 4, 1, 16):
        ids = torch.randint(0, VOCAB, (2, n))
        out = fast(input_ids=ids, use_cache=False)
        assert type(out).__name__ == "CausalLMOutputWithPast"
        assert_same(out.logits, model(input_ids=ids, use_cache=False).logits, f"seq={n}")
    assert fast.direct_info == "trace 1: on; trace 2 (n=1): on"
    # Each trace's first call armed it; the call that made trace 2 went through Dynamo.
    assert fast.direct_calls == 4 and fast.direct_fallbacks == 1


@pytest.mark.gpu
def test_decoder_full_and_piecewise_graphs_direct_call_on_cuda():
    # What a server runs: full CUDA graphs at decode sizes, piecewise ones (sdpa eager between
    # them) above, captured at start-up, called past Dynamo's frame; each size twice (capture,
    # then replay) against eager on fresh inputs.
    model = copy.deepcopy(model_of("llama")).cuda()
    fast = sw.compile(model, dynamic_dims={"input_ids": 1}, sizes=[1, 2, 8, 16], splitting_ops=["sdpa"],
                      backend="inductor", direct_call=True,
                      cudagraphs={"mode": "full_and_piecewise", "full_up_to": 2, "capture": "startup"})
    for n in (8, 2, 16, 1) * 2:
        ids = torch.randint(0, VOCAB, (2, n), device="cuda")
        assert_same(fast(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits,
                    f"seq={n}")
    assert fast.traces == 2  # seq > 1 in sdpa_attention_forward, as above
    assert fast.direct_info == "trace 1: on; trace 2 (n=1): on" and fast.direct_calls == 6


@pytest.mark.inductor
def test_decoder_inductor():
    fast = sw.compile(model_of("llama"), dynamic_dims={"input_ids": 1}, sizes=[1, 4], splitting_ops=["sdpa"],
                      backend="inductor")
    check_decoder("llama", fast, (4, 1))
    assert fast.traces == 2  # seq > 1 in sdpa_attention_forward, as above
    assert _rows(fast) == [("1", "{n=4}"), ("2 (n=1)", "{n=1}")]


# -- encoders: batch and sequence named apart, a padded mask -----------------------------------

ENC_DIMS = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}


def encoder_inputs(batch, seq):
    ids = torch.randint(3, VOCAB, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2:] = 0  # row 0 padded at the end
    return ids, mask


def check_encoder(name, fast, shapes, by_position=False):
    model = model_of(name)
    for b, s in shapes:
        ids, mask = encoder_inputs(b, s)
        out = fast(ids, mask) if by_position else fast(input_ids=ids, attention_mask=mask)
        assert_same(out.last_hidden_state, model(input_ids=ids, attention_mask=mask).last_hidden_state,
                    f"{name} batch={b} seq={s}")


# RoBERTa is called by position, BERT by keyword. (Mixing the two on one model makes a second
# trace: transformers' forward decorators take *args, and Dynamo guards on `not args`.)
@pytest.mark.parametrize("name, by_position", [("bert", False), ("roberta", True)])
def test_encoder(name, by_position):
    fast = sw.compile(model_of(name), dynamic_dims=ENC_DIMS, sizes={"batch": [1, 2], "seq": [8, 16]},
                      ranges={"seq": [(17, 32)]}, splitting_ops=["sdpa"], backend="aot_eager")
    check_encoder(name, fast, [(2, 8), (1, 8), (2, 16), (1, 16), (2, 24), (1, 32), (3, 20)], by_position)
    assert fast.traces == 1  # nothing branches on batch or seq, 1 included
    assert [key for _, key in _rows(fast)] == [
        "{batch=1, seq=8}", "{batch=1, seq=16}", "{batch=2, seq=8}", "{batch=2, seq=16}", "{batch=1..inf, seq=17..32}"]


@pytest.mark.inductor
def test_encoder_inductor():
    fast = sw.compile(model_of("bert"), dynamic_dims=ENC_DIMS, sizes={"batch": [1, 2], "seq": [8]},
                      splitting_ops=["sdpa"], backend="inductor")
    check_encoder("bert", fast, [(2, 8), (1, 8)])
    _one_trace_or_batch_1_apart(fast, "batch")
    assert sorted(sorted(key.strip("{}").split(", ")) for _, key in _rows(fast)) == [  # (a trace of its own
        ["batch=1", "seq=8"], ["batch=2", "seq=8"]]  # for batch 1 names its sizes in another order)


# -- T5: encoder and decoder lengths named apart -----------------------------------------------


def test_t5_source_and_target_lengths():
    model = model_of("t5")
    fast = sw.compile(model, dynamic_dims={"input_ids": {1: "src"}, "attention_mask": {1: "src"},
                                           "decoder_input_ids": {1: "tgt"}},
                      sizes={"src": [8, 16], "tgt": [1, 4]}, ranges=[{"src": (17, 32)}],
                      splitting_ops=["sdpa"], backend="aot_eager")
    for src, tgt in ((8, 4), (16, 4), (24, 4), (8, 1), (24, 1), (30, 9)):
        ids, mask = encoder_inputs(2, src)
        kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.randint(0, VOCAB, (2, tgt)),
                      use_cache=False)
        assert_same(fast(**kwargs).logits, model(**kwargs).logits, f"src={src} tgt={tgt}")
    # The decoder's causal mask (_ignore_causal_mask_sdpa: q_length == 1) and its self-attention
    # (sdpa_attention_forward: q_length > 1) put tgt > 1 in the trace: the call at tgt=1 makes a
    # second trace, specialised to it, serving the src sizes and range.
    assert fast.traces == 2
    assert _rows(fast)[:3] == [("1", "{src=8, tgt=4}"), ("1", "{src=16, tgt=4}"), ("1", "{src=17..32, tgt=2..inf}")]
    assert {r for r in _rows(fast) if r[0] != "1"} == {
        ("2 (tgt=1)", "{src=8, tgt=1}"), ("2 (tgt=1)", "{src=16, tgt=1}"), ("2 (tgt=1)", "{src=17..32, tgt=1}")}


# -- ViT: the batch of pixel_values dynamic ----------------------------------------------------


def check_vit(fast, batches):
    model = model_of("vit")
    for b in batches:
        x = torch.randn(b, 3, 32, 32)
        out, expected = fast(pixel_values=x), model(pixel_values=x)
        assert_same((out.last_hidden_state, out.pooler_output), (expected.last_hidden_state, expected.pooler_output),
                    f"vit batch={b}")


def test_vit():
    fast = sw.compile(model_of("vit"), dynamic_dims={"pixel_values": 0}, sizes=[1, 2, 4], ranges=[(5, 8)],
                      splitting_ops=["sdpa"], backend="aot_eager")
    check_vit(fast, (2, 1, 4, 7))
    assert fast.traces == 1  # nothing branches on the batch
    assert _rows(fast) == [(None, "{n=1}"), (None, "{n=2}"), (None, "{n=4}"), (None, "{n=5..8}")]


@pytest.mark.inductor
def test_vit_inductor():
    fast = sw.compile(model_of("vit"), dynamic_dims={"pixel_values": 0}, sizes=[1, 2], splitting_ops=["sdpa"],
                      backend="inductor")
    check_vit(fast, (2, 1))
    _one_trace_or_batch_1_apart(fast, "n")


def _one_trace_or_batch_1_apart(fast, dim):
    """One trace; or, where Dynamo's SDPA guards batch != 1 (torch 2.11 with transformers 5.17, the
    GPU machine: "skipping {batch=1}: contradicts the trace's guard Ne(batch, 1)"), a second one
    for batch 1, serving only it."""
    if fast.traces != 1:
        assert fast.traces == 2 and {t for t, _ in _rows(fast)} == {"1", f"2 ({dim}=1)"}, _rows(fast)
        assert all(f"{dim}=1" in key for t, key in _rows(fast) if t != "1"), _rows(fast)


# -- the "shapewise" torch.compile backend (dynamic=True: plain sizes bind dim 0, the batch) ---


def backend_compile(name, **options):
    return torch.compile(model_of(name), backend="shapewise", dynamic=True,
                         options={"splitting_ops": ["sdpa"], "backend": "aot_eager", **options})


def test_torch_compile_backend_takes_unspecialised_floats_as_traced(caplog):
    # torch.compile(dynamic=True) leaves floats unspecialised (Dropout.p, LayerNorm's eps arrive as
    # 0-d tensor inputs read with .item(), unguarded): shapewise compiles them as the constants they
    # were at the trace, with no Dynamo config set; a call after one changed runs as traced, eagerly.
    def f(x, w, scale):
        return torch.tanh(x @ w) * scale

    fast = torch.compile(f, backend="shapewise", dynamic=True, options={"backend": "aot_eager", "sizes": [2, 4]})
    w = torch.randn(8, 8)
    for b, scale in ((2, 0.5), (4, 0.5), (2, 0.25), (4, 3.0)):
        x = torch.randn(b, 8)
        assert_same(fast(x, w, scale), f(x, w, scale), f"batch={b} scale={scale}")
    assert re.search(r"scale'\] was 0\.5 when this graph was traced and is 0\.25 now", caplog.text)
    check_vit(backend_compile("vit", sizes=[2, 4]), (2, 4))


def test_torch_compile_backend_vit():
    # Dynamo specialises batch 1 (dynamic=True): the trace at 2 leaves it out, and the call at
    # 1 is served by the trace Dynamo makes then.
    check_vit(backend_compile("vit", sizes=[1, 2, 4], ranges=[(5, 8)]), (2, 4, 7, 1))


def test_torch_compile_backend_bert():
    # The sequence stays at its traced length here (only the batch is bound).
    check_encoder("bert", backend_compile("bert", sizes=[2, 4], ranges=[(5, 8)]), [(2, 8), (4, 8), (6, 8)])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_torch_compile_backend_decoders(name):
    # torch.compile's own defaults (dynamic=True, floats unspecialised), no Dynamo config set:
    # the batch bound by plain sizes, the sequence left symbolic by Dynamo (a range variant).
    model, fast = model_of(name), backend_compile(name, sizes=[2, 4], ranges=[(5, 8)])
    for b, t in ((2, 8), (4, 8), (6, 8)):
        ids = torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(b * t))
        assert_same(fast(input_ids=ids).logits, model(input_ids=ids).logits, f"{name} batch={b} seq={t}")
