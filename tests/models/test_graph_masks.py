"""``compile_generate(graph_masks=True)``: with a static cache, an unpadded ``generate()`` hands the
compiled forward no attention mask, so the forward builds its masks inside the graph, not transformers
outside it at every step; a padded call, and a model that builds its own masks for generate, keep
transformers' masks. Tokens equal eager's either way."""

from __future__ import annotations

import logging

import pytest
import torch

import shapewise as sw
from shapewise.errors import ConfigError

transformers = pytest.importorskip("transformers")
from tests.models.configs import DECODERS  # noqa: E402

KW = dict(prompt_sizes=[6], max_length=32, static_cache=True, backend="aot_eager", splitting_ops=())
RUN = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)


def _model(name: str, cls=None):
    config, own = DECODERS[name]
    torch.manual_seed(0)
    return (cls or own)(config()).eval()


def _masks_seen(model) -> list:
    """The attention mask ``generate()`` hands the forward at each step (from its input preparation)."""
    seen = []
    prepare = model.prepare_inputs_for_generation

    def spy(*args, **kwargs):
        out = prepare(*args, **kwargs)
        seen.append(out.get("attention_mask"))
        return out

    model.prepare_inputs_for_generation = spy
    return seen


def _eager(model, ids, **run):
    with torch.no_grad():
        model.generation_config.disable_compile = True
        return model.generate(ids, **RUN, cache_implementation="static", **run)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])  # qwen2's masks are a dict; mistral's slide (8)
def test_unpadded_calls_build_their_masks_in_the_graph_with_eagers_tokens_and_traces(name):
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    # (llama's also without graph_masks: transformers' masks, and as many traces; for the others the
    # counts below, which are those without graph_masks, are not traced again here, for CI time)
    for graph_masks in (False, True) if name == "llama" else (True,):
        model = _model(name)
        want = _eager(model, ids)
        fast = sw.compile_generate(model, graph_masks=graph_masks, **KW)
        seen = _masks_seen(model)
        with torch.no_grad():
            for _ in range(2):  # the second call through the direct calls the first one armed
                assert torch.equal(model.generate(ids, **RUN), want)
        assert all(m is None for m in seen) == graph_masks and len(seen) == 2 * 20
        assert fast.traces == (3 if name == "mistral" else 2), fast.report()  # prefill, decode; the window


def test_a_padded_call_keeps_transformers_masks_for_the_whole_call():
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    model = _model("llama")
    want = _eager(model, ids, attention_mask=mask)
    sw.compile_generate(model, graph_masks=True, **KW)
    seen = _masks_seen(model)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, **RUN)
        assert torch.equal(got, want) and all(m is not None for m in seen)
        seen.clear()  # and the next, unpadded call is decided anew
        assert torch.equal(model.generate(ids, **RUN), _eager(_model("llama"), ids))
    assert all(m is None for m in seen)


def test_a_chunked_prefill_checks_every_chunk_for_padding():
    # prefill_chunk_size=2: the padding (a 0 in the third chunk) is seen at that chunk, and the call keeps
    # transformers' masks from there on
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[1, 1, 1, 1, 0, 1]])
    model = _model("llama")
    want = _eager(model, ids, attention_mask=mask, prefill_chunk_size=2)
    sw.compile_generate(model, graph_masks=True, **{**KW, "prompt_sizes": [2, 6]})
    seen = _masks_seen(model)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, attention_mask=mask, prefill_chunk_size=2, **RUN), want)
    assert [m is None for m in seen[:3]] == [True, True, False] and all(m is not None for m in seen[3:])


def test_a_model_that_builds_its_own_masks_for_generate_keeps_them():
    from transformers import masking_utils

    class OwnMasks(DECODERS["llama"][1]):
        def create_masks_for_generate(self, **kwargs):
            return masking_utils.create_masks_for_generate(**kwargs)

    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    model = _model("llama", OwnMasks)
    want = _eager(model, ids)
    sw.compile_generate(model, graph_masks=True, **KW)
    seen = _masks_seen(model)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **RUN), want)
    # (an unpadded prefill's mask can be None anyway: SDPA's own causal flag serves it)
    assert all(m is not None for m in seen[1:]) and len(seen) == 20


def test_a_forward_that_needs_the_mask_to_compile_warns_once_and_keeps_transformers_masks(caplog):
    # OPT derives its positions from the mask's length: without a mask, the static cache's length is read
    # as a value, which a compile cannot; the call runs again with transformers' masks, as do later ones.
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(4))
    model = _model("opt")
    want = _eager(model, ids)
    sw.compile_generate(model, graph_masks=True, **KW)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="shapewise"):
        assert torch.equal(model.generate(ids, **RUN), want)
        warned = [r.getMessage() for r in caplog.records if "graph_masks" in r.getMessage()]
        assert len(warned) == 1 and "OPTForCausalLM's forward did not compile without an attention mask" in warned[0]
        seen = _masks_seen(model)
        assert torch.equal(model.generate(ids, **RUN), want)
    assert len([r for r in caplog.records if "graph_masks" in r.getMessage()]) == 1
    assert all(m is not None for m in seen[1:]) and len(seen) == 20


def test_the_fallback_runs_a_sampled_call_again_from_its_random_state_and_never_a_streamed_one():
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(6))
    sample = dict(max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=0)
    model = _model("opt")
    sw.compile_generate(model, graph_masks=True, **KW)
    with torch.no_grad():
        torch.manual_seed(7)
        first = model.generate(ids, **sample)  # fails without a mask after its prefill's sample, runs again
        torch.manual_seed(7)
        assert torch.equal(model.generate(ids, **sample), first)  # (with transformers' masks from the start)

    class Streamer:
        def __init__(self):
            self.got = []

        def put(self, value):
            self.got.append(value)

        def end(self):
            pass

    model = _model("opt")
    sw.compile_generate(model, graph_masks=True, **KW)
    streamer = Streamer()
    with torch.no_grad(), pytest.raises(sw.errors.CompileError, match=r"given \['streamer'\].*call generate\(\) again"):
        model.generate(ids, streamer=streamer, **RUN)
    assert streamer.got  # (it had the prompt: hence no second run)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **RUN), _eager(_model("opt"), ids))


def test_graph_masks_must_be_a_bool():
    with pytest.raises(ConfigError, match="graph_masks must be True or False, got 'yes'"):
        sw.compile_generate(_model("llama"), graph_masks="yes", **KW)


@pytest.mark.parametrize("name", ["opt", "falcon"])
def test_keep_cache_a_forward_that_does_not_compile_with_it_warns_once_and_runs_without_it(name, caplog):
    # keep_cache's cache is initialised before the prefill: OPT's forward then reads the cache's length as a
    # value there, and Falcon's heads are not the ones transformers' init shape says; neither compiles. The
    # first call says so, turns it off for the model and runs again with transformers' cache: eager's tokens,
    # two traces. With graph_masks too (both off: OPT fails with either).
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    model = _keep_model(name)
    want = _eager(model, ids)
    fast = sw.compile_generate(model, keep_cache=True, graph_masks=name == "opt", **KW)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="shapewise"):
        for _ in range(2):
            assert torch.equal(model.generate(ids, **RUN), want)
    warned = [r.getMessage() for r in caplog.records if "keep_cache=True" in r.getMessage()]
    assert len(warned) == 1 and "with its static cache initialised before the prefill" in warned[0], warned
    assert not model.generate.shapewise_keeps_cache and fast.traces == 2
    assert model.generate.shapewise_graph_masks is False
    # and a call given state it may have used (a streamer) raises, saying to call again
    model = _keep_model(name)
    sw.compile_generate(model, keep_cache=True, **KW)

    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

    with torch.no_grad(), pytest.raises(sw.errors.CompileError, match=r"given \['streamer'\].*call generate\(\) again"):
        model.generate(ids, streamer=Streamer(), **RUN)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **RUN), want)


def _keep_model(name: str):
    if name != "falcon":
        return _model(name)
    torch.manual_seed(0)
    config = transformers.FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    # (multi-query: one KV head, whatever num_key_value_heads says, which transformers' init shape reads; the
    # architecture sweep's tiny configs set it to 2)
    config.num_key_value_heads = 2
    return transformers.FalconForCausalLM(config).eval()


@pytest.mark.parametrize("name", ["opt", "llama"])
def test_keep_cache_by_default_spares_calls_given_state_until_it_has_run_and_falls_back_quietly(name, caplog):
    # keep_cache on by default (compile_generate's choice with a static cache in CUDA graphs, which this CPU
    # machine has not: the wrapper is made as compile_generate makes it there). A call given state a failed
    # compile would spoil (a streamer) runs without it until a call has run with it; OPT's forward does not
    # compile with it: the first plain call turns it off, says so at info level (not a warning: the user did
    # not ask for it), and runs again. Eager's tokens throughout. A call that took no kept cache (a dynamic one)
    # does not count as having run with it.
    from shapewise.generate_loop import _shapewise_generate

    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    model = _keep_model(name)
    want = _eager(model, ids)
    sw.compile_generate(model, keep_cache=False, **KW)
    model.generate = _shapewise_generate(model, borrow=False, keep_cache=True, keep_asked=False)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="shapewise"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="dynamic")  # keeps no cache
        assert torch.equal(model.generate(ids, streamer=Streamer(), **RUN), want)
        assert model.generate.shapewise_keeps_cache and not model.generate.shapewise_kept_once
        assert not getattr(model._prepare_static_cache, "shapewise_kept", None)  # no kept cache made
        assert torch.equal(model.generate(ids, **RUN), want)
        assert torch.equal(model.generate(ids, streamer=Streamer(), **RUN), want)
    said = [r for r in caplog.records if "keep_cache=True, the default here" in r.getMessage()]
    if name == "opt":
        assert [r.levelno for r in said] == [logging.INFO] and not model.generate.shapewise_keeps_cache
    else:
        assert not said and model.generate.shapewise_kept_once and model.generate.shapewise_keeps_cache
        assert len(model._prepare_static_cache.shapewise_kept) == 1
