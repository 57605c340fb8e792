"""A call that fails every trace's guards is traced once, not twice: ``_compat.no_new_trace`` refuses
Dynamo's unmarked trace before it runs (before 2026-12-07, night, the backend refused it after a whole
trace: 2.3 s of a 16-layer Llama's cold start on this project's CPU, benchmarks/results/trace_cost_cpu)."""

from __future__ import annotations

import pytest
import torch

import shapewise as sw
from shapewise import _compat


@pytest.fixture
def dynamo_runs(monkeypatch):
    """The names of the frames Dynamo symbolically runs (each a whole trace), in order."""
    sc = pytest.importorskip("torch._dynamo.symbolic_convert")
    if not hasattr(sc.InstructionTranslator, "run"):
        pytest.skip("this torch's InstructionTranslator has no run()")
    runs: list[str] = []
    run = sc.InstructionTranslator.run

    def counted(self, *args, **kwargs):
        runs.append(self.f_code.co_name)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(sc.InstructionTranslator, "run", counted)
    return runs


def test_a_trace_of_its_frame_that_starts_inside_is_refused_before_it_runs_and_another_frame_traces(dynamo_runs):
    torch._dynamo.reset()
    handed, frames = [], set()

    def backend(gm, example_inputs):
        handed.append(gm)
        frames.add(_compat.current_frame_id())
        return gm.forward

    f = torch.compile(lambda x: x.sin() + 1, backend=backend, fullgraph=True, dynamic=False)
    g = torch.compile(lambda x: x.cos() * 2, backend=backend, fullgraph=True, dynamic=False)
    f(torch.randn(3))
    assert len(frames) == 1 and None not in frames
    with _compat.no_new_trace(set(frames)) as refusal, pytest.raises(Exception, match="TraceRefused|refuses"):
        f(torch.randn(4))  # a new size: Dynamo would trace f again
    assert refusal.refused and len(dynamo_runs) == 1 and len(handed) == 1
    with _compat.no_new_trace(set(frames)) as refusal:
        f(torch.randn(3))  # served by the trace there is: nothing refused
        g(torch.randn(3))  # another frame (a compiled function the model calls as it runs): traced
    assert not refusal.refused and len(handed) == 2
    with _compat.no_new_trace(set()) as refusal:
        f(torch.randn(5))  # no frames: nothing refused
    assert not refusal.refused and len(handed) == 3
    assert f(torch.randn(4)).shape == (4,) and len(handed) == 4  # outside the block Dynamo traces as always


def test_compile_generate_traces_decode_once(dynamo_runs):
    # (after torch._dynamo.reset(), which clears Dynamo's callbacks: no_new_trace registers its own again)
    torch._dynamo.reset()
    pytest.importorskip("transformers")
    from tests.models.configs import DECODERS

    config, cls = DECODERS["llama"]
    torch.manual_seed(0)
    model = cls(config()).eval()
    ids = torch.randint(3, 100, (1, 4))
    plain = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, **plain, cache_implementation="static")
    fast = sw.compile_generate(model, prompt_sizes=[4], max_length=16, static_cache=True, backend="aot_eager",
                               cache=False)
    with torch.no_grad():
        got = model.generate(ids, **plain)
    assert torch.equal(got, want)
    # the prompt's trace and the decode step's: two Dynamo runs (three before, the decode step's first refused
    # after it was traced whole)
    assert fast.traces == 2 and len(dynamo_runs) == 2, dynamo_runs
