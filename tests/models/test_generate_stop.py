"""``generate()`` deciding to stop one step late (``compile_generate(defer_stop=...)``,
``_compat.deferred_stop_checks``): the host never waits for a step's stop check, and the tokens
are the ones a check at every step gives, whether an EOS token or the length stops it."""

from __future__ import annotations

import pytest
import torch

import shapewise as sw
from tests.models.test_generate import _llama

transformers = pytest.importorskip("transformers")
generation = pytest.importorskip("transformers.generation.utils")
if not hasattr(generation, "DeferredStopCheck"):
    pytest.skip("this transformers has no DeferredStopCheck", allow_module_level=True)


class _HostEvent:
    """A device event on the CPU, where every op has finished when it returns (torch has no CPU
    events): what ``DeferredStopCheck`` records and waits on."""

    def __init__(self, device=None, blocking=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def deferred(monkeypatch):
    """The steps each DeferredStopCheck undid, one entry per generate() that deferred."""
    monkeypatch.setattr(torch, "Event", _HostEvent)
    undone = []
    finish = generation.DeferredStopCheck.finish
    monkeypatch.setattr(generation.DeferredStopCheck, "finish",
                        lambda self: undone.append(finish(self)) or undone[-1])
    return undone


def test_a_stop_checked_one_step_late_gives_the_tokens_of_a_check_at_every_step(deferred):
    model = _llama()
    torch.manual_seed(0)
    prompts = torch.randint(0, 128, (2, 6))
    greedy = {"do_sample": False, "max_new_tokens": 12, "pad_token_id": 0}
    free = model.generate(prompts, **greedy, eos_token_id=None)
    # An EOS that the first row says at its 3rd new token: alone, it stops there; beside the
    # second row, it pads from there while the other runs on (to the length or its own EOS).
    eos = int(free[0, 6 + 2])
    want = model.generate(prompts, **greedy, eos_token_id=eos)
    want_one = model.generate(prompts[:1], **greedy, eos_token_id=eos)
    assert want_one.shape[1] == 6 + 3 < free.shape[1]
    fast = sw.compile_generate(model, prompt_sizes=[6], max_length=32, static_cache=True, backend="aot_eager",
                               defer_stop=True)
    assert model.generate.shapewise_defers_stop and not model.generate.shapewise_borrows
    # On the CPU compile_generate's generate() checks at every step (deferring needs CUDA's events).
    assert torch.equal(model.generate(prompts, **greedy, eos_token_id=eos), want) and not deferred
    with sw._compat.deferred_stop_checks(devices=("cpu",)) as on:
        assert on
        got = model.generate(prompts, **greedy, eos_token_id=eos)
        got_one = model.generate(prompts[:1], **greedy, eos_token_id=eos)
        free_got = model.generate(prompts, **greedy, eos_token_id=None)
        # A returned cache is not deferred (transformers would crop it back at every step).
        kept = model.generate(prompts, **greedy, eos_token_id=eos, return_dict_in_generate=True)
    assert torch.equal(got, want) and torch.equal(got_one, want_one) and torch.equal(free_got, free)
    assert torch.equal(kept.sequences, want)
    # An EOS stop is seen one step late and its extra step undone; a stop at the length is on time.
    assert deferred == [1 if want.shape[1] < free.shape[1] else 0, 1, 0], deferred
    assert fast.traces == 4  # prefill and decode, for each batch size (1 and 2)
    # Outside the context transformers decides as before (MPS only).
    assert not generation.DeferredStopCheck.is_supported(torch.device("cuda"), None, False, is_assistant=False)
    with sw._compat.deferred_stop_checks():
        assert generation.DeferredStopCheck.is_supported(torch.device("cuda"), None, False, is_assistant=False)
        assert not generation.DeferredStopCheck.is_supported(torch.device("cuda"), None, False, is_assistant=True)
        assert not generation.DeferredStopCheck.is_supported(torch.device("cpu"), None, False, is_assistant=False)


def test_defer_stop_is_on_by_default_for_a_model_on_a_gpu_only():
    model = _llama()
    sw.compile_generate(model, prompt_sizes=[4], backend="aot_eager")
    assert "generate" not in vars(model)  # a CPU model: nothing to overlap
    model = _llama()
    sw.compile_generate(model, prompt_sizes=[4], backend="aot_eager", defer_stop=True)
    assert model.generate.shapewise_defers_stop


@pytest.mark.gpu
def test_generate_on_a_gpu_stops_one_step_late_with_eager_tokens(monkeypatch):
    undone = []  # the steps each generate() undid
    finish = generation.DeferredStopCheck.finish
    monkeypatch.setattr(generation.DeferredStopCheck, "finish",
                        lambda self: undone.append(finish(self)) or undone[-1])
    model = _llama().cuda()
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (1, 6), device="cuda")
    greedy = {"do_sample": False, "max_new_tokens": 12, "pad_token_id": 0}
    free = model.generate(prompt, **greedy, eos_token_id=None, cache_implementation="static")
    eos = int(free[0, 6 + 2])
    want = model.generate(prompt, **greedy, eos_token_id=eos, cache_implementation="static")
    sw.compile_generate(model, prompt_sizes=[6], max_length=32, static_cache=True, backend="inductor",
                        cudagraphs="full")
    assert model.generate.shapewise_defers_stop and model.generate.shapewise_borrows
    for _ in range(2):  # the second call replays the captured graphs
        assert torch.equal(model.generate(prompt, **greedy, eos_token_id=eos), want)
        assert torch.equal(model.generate(prompt, **greedy, eos_token_id=None), free)
    assert undone == [1, 0, 1, 0], undone
