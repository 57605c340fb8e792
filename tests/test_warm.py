"""Warm starts (``warm_start=True``, ``shapewise.warm``): a second start loads its traces and traces
nothing; what it loads answers as eager does at every size; anything that changed (options, the
model's code, a broken file) is a cold start that still answers right; a call no loaded trace
serves traces again. Structural tests use aot_eager; one fresh-process test uses Inductor and
checks that every variant comes from the artifact cache."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sympy
import torch

import shapewise as sw
from shapewise import _compat
from shapewise.backend import shapewise_backend
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer
from tests.helpers import assert_same

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not _compat.HAS_AOT_COMPILE, reason="this torch has no torch._dynamo.aot_compile")


def toy() -> ToyTransformer:
    torch.manual_seed(0)
    return ToyTransformer(vocab=64, dim=16, heads=2, hidden=32, layers=1).eval()


def compiled(model, cache, **options):
    opts = dict(sizes=[1, 2], ranges=[(3, 16)], splitting_ops=[ATTENTION_OP], backend="aot_eager", progress=False)
    return sw.compile(model, cache=str(cache), warm_start=True, **{**opts, **options})


def check_sizes(fast, model, sizes=(1, 2, 3, 11, 16)) -> None:
    for n in sizes:
        ids = torch.randint(0, 64, (n,))
        assert_same(fast(ids), model(ids), f"n={n}")


def no_tracing(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("a warm start traced with Dynamo")

    monkeypatch.setattr(_compat, "aot_trace", refuse)


def test_a_second_start_loads_its_traces_and_traces_nothing(tmp_path, monkeypatch):
    model = toy()
    first = compiled(model, tmp_path)
    check_sizes(first, model)
    assert first.warm_info.startswith("warm start: 1 trace(s) saved to"), first.warm_info
    no_tracing(monkeypatch)
    again = toy()  # a fresh model object with the same weights, as a new process makes
    second = compiled(again, tmp_path)
    check_sizes(second, again)
    assert second.warm_info.startswith("warm start: 1 trace(s) loaded from"), second.warm_info
    assert second.traces == 1
    assert [r["key"] for r in second.report()] == [r["key"] for r in first.report()]


def test_the_loaded_program_reads_the_models_weights_at_each_call(tmp_path):
    compiled(toy(), tmp_path)(torch.randint(0, 64, (4,)))
    other = toy()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    fast = compiled(other, tmp_path)
    check_sizes(fast, other)
    assert "loaded" in fast.warm_info


def test_changed_options_are_a_cold_start(tmp_path):
    model = toy()
    compiled(model, tmp_path)(torch.randint(0, 64, (2,)))
    fast = compiled(model, tmp_path, sizes=[1, 2, 8], ranges=())
    check_sizes(fast, model, (1, 2, 8))
    assert "saved" in fast.warm_info and "loaded" not in fast.warm_info, fast.warm_info


def test_another_torch_build_is_a_cold_start(tmp_path, monkeypatch):
    model = toy()
    compiled(model, tmp_path)(torch.randint(0, 64, (2,)))
    same = compiled(model, tmp_path)
    check_sizes(same, model, (2,))
    assert "loaded" in same.warm_info, same.warm_info  # the same build loads what it saved
    real = _compat.build_fingerprint
    monkeypatch.setattr(_compat, "build_fingerprint", lambda devices: {**real(devices), "torch": "9.9.9"})
    fast = compiled(model, tmp_path)
    check_sizes(fast, model, (2, 5))
    assert "saved" in fast.warm_info and "loaded" not in fast.warm_info, fast.warm_info


def test_a_broken_file_is_a_cold_start_that_replaces_it(tmp_path, caplog):
    model = toy()
    first = compiled(model, tmp_path)
    first(torch.randint(0, 64, (2,)))
    path = Path(first.warm_info.split(" saved to ", 1)[1])
    path.write_bytes(path.read_bytes()[:200])
    second = compiled(model, tmp_path)
    check_sizes(second, model)
    assert "unusable" in caplog.text and "truncated" in caplog.text
    assert second.warm_info.startswith("warm start: 1 trace(s) saved"), second.warm_info
    third = compiled(model, tmp_path)
    third(torch.randint(0, 64, (2,)))
    assert "loaded" in third.warm_info, third.warm_info


def test_a_model_whose_code_changed_is_traced_again(tmp_path, monkeypatch, caplog):
    src = tmp_path / "warm_model_mod.py"
    code = textwrap.dedent("""
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)
            def forward(self, x):
                return torch.relu(self.lin(x)) * SCALE
    """)
    src.write_text(code.replace("SCALE", "2.0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("warm_model_mod")
    torch.manual_seed(0)
    net = mod.Net()
    opts = dict(sizes=[2, 3], backend="aot_eager", progress=False)
    sw.compile(net, cache=str(tmp_path / "c"), warm_start=True, **opts)(torch.randn(2, 8))
    src.write_text(code.replace("SCALE", "3.0"))
    mod = importlib.reload(mod)
    torch.manual_seed(0)
    net2 = mod.Net()
    fast = sw.compile(net2, cache=str(tmp_path / "c"), warm_start=True, **opts)
    for n in (2, 3):
        x = torch.randn(n, 8)
        assert_same(fast(x), net2(x))
    assert "code changed" in caplog.text and "warm_model_mod" in caplog.text


def test_a_call_no_loaded_trace_serves_traces_again_and_both_are_saved(tmp_path):
    torch.manual_seed(0)
    mlp = MLP(dim=8, hidden=16).eval()
    opts = dict(sizes=[2, 3], backend="aot_eager", progress=False, cache=str(tmp_path), warm_start=True)
    first = sw.compile(mlp, **opts)
    first(torch.randn(2, 8))
    second = sw.compile(mlp, **opts)
    x = torch.randn(3, 8)
    assert_same(second(x), mlp(x))
    assert second.traces == 1 and "loaded" in second.warm_info
    with torch.no_grad():  # grad mode: a guard the loaded trace fails
        y = second(x)
    assert second.traces == 2 and "2 trace(s) saved" in second.warm_info
    assert_same(y, mlp(x))
    third = sw.compile(mlp, **opts)
    third(torch.randn(3, 8))  # (x carries the dynamic marks of the second start's trace: Dynamo guards those)
    assert third.traces == 2 and "2 trace(s) loaded" in third.warm_info


def test_a_trace_made_under_autocast_loads_under_it_and_serves_autocast_calls(tmp_path, monkeypatch):
    # Dynamo's tensor guards expect the dispatch keys their build saw (AutocastCPU under autocast):
    # a trace loaded outside autocast failed every autocast call, so each start traced again and
    # saved one trace more.
    torch.manual_seed(0)
    mlp = MLP(dim=8, hidden=16).eval()
    opts = dict(sizes=[2, 3], backend="aot_eager", progress=False, cache=str(tmp_path), warm_start=True)
    x = torch.randn(3, 8)

    def calls(fast):
        with torch.no_grad():
            plain = fast(x)
            with torch.autocast("cpu", torch.bfloat16):
                cast, want = fast(x), mlp(x)
        assert plain.dtype == torch.float32 and cast.dtype == want.dtype == torch.bfloat16
        assert_same(plain, mlp(x))
        assert_same(cast, want)

    first = sw.compile(mlp, **opts)
    calls(first)
    assert first.traces == 2 and "2 trace(s) saved" in first.warm_info, first.warm_info
    no_tracing(monkeypatch)
    for _ in range(2):  # loaded twice: the file keeps its two traces
        again = sw.compile(mlp, **opts)
        calls(again)
        assert again.traces == 2 and "2 trace(s) loaded" in again.warm_info, again.warm_info


def test_warm_start_off_says_why(tmp_path):
    fast = sw.compile(MLP(dim=8, hidden=16), sizes=[2], backend="aot_eager", cache=False, warm_start=True,
                      progress=False)
    assert "disk cache is off" in fast.warm_info
    x = torch.randn(2, 8)
    assert_same(fast(x), fast.model(x))
    fast = sw.compile(MLP(dim=8, hidden=16), sizes=[2], backend=lambda gm, ex: gm, cache=str(tmp_path),
                      warm_start=True, progress=False)
    assert "live object" in fast.warm_info
    assert "off" in sw.compile(MLP(), sizes=[2]).warm_info
    with pytest.raises(sw.ConfigError, match="warm_start must be True or False"):
        sw.compile(MLP(), sizes=[2], warm_start="yes")


@pytest.mark.parametrize("error", [
    TypeError("Type <class 'f.<locals>.Func'> cannot be saved into torch.compile() package"),  # torch 2.13
    RuntimeError("Missing required external references: ['type']. Please load AOT compiled function with "
                 "`f_globals=<enclosing global scope>`"),  # torch 2.11, seen on the H200 (1B compile_generate)
], ids=["guard", "external-refs"])
def test_a_trace_torch_cannot_package_turns_warm_starts_off_and_the_call_goes_on(tmp_path, monkeypatch, caplog,
                                                                                 error):
    from shapewise._compat import precompile

    real = precompile.aot_compile_fullgraph

    def unpackable(*a, **k):  # torch traced and compiled, then failed to package what it traced
        real(*a, **k)
        raise error

    monkeypatch.setattr(precompile, "aot_compile_fullgraph", unpackable)
    model = toy()
    fast = compiled(model, tmp_path)
    with caplog.at_level("WARNING", logger="shapewise"):
        check_sizes(fast, model)
    want = f"warm start off: torch cannot save this model's trace ({type(error).__name__}: "
    assert fast.warm_info.startswith(want), fast.warm_info
    assert "traced as without warm_start" in caplog.text
    assert fast.traces == 1 and not list(tmp_path.rglob("*.swa"))


def test_a_later_trace_torch_cannot_package_drops_the_saved_ones_so_nothing_traces_twice(tmp_path, monkeypatch):
    from shapewise._compat import precompile

    real, made = precompile.aot_compile_fullgraph, []

    def second_unpackable(*a, **k):  # the first trace packages; the second (no_grad) does not
        out = real(*a, **k)
        made.append(1)
        if len(made) == 2:
            raise RuntimeError("Missing required external references: ['type']")
        return out

    monkeypatch.setattr(precompile, "aot_compile_fullgraph", second_unpackable)
    model = toy()
    fast = compiled(model, tmp_path, direct_call=True)
    check_sizes(fast, model, (2, 5))
    with torch.no_grad():
        check_sizes(fast, model, (2, 5))
    check_sizes(fast, model, (2, 5))
    with torch.no_grad():
        check_sizes(fast, model, (2, 5))
    # Dynamo holds none of the packaged traces: they are dropped and each grad mode traces once more.
    assert fast.traces == 2 and fast.warm_info.startswith("warm start off"), (fast.traces, fast.warm_info)
    assert "warm_start" not in fast.direct_info, fast.direct_info  # direct calls on again, as asked


@dataclasses.dataclass
class _Output:
    y: torch.Tensor


class _ReturnsOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _Output(self.lin(x))  # the trace's bytecode rebuilds it by the name _Output in this module


def test_a_trace_that_rebuilds_an_output_class_loads_with_the_modules_globals(tmp_path, monkeypatch):
    # openai-gpt's forward returns a CausalLMOutput: its saved trace failed to load ("Missing
    # required external references: ['CausalLMOutput']") and every start was cold.
    def start():
        torch.manual_seed(0)
        model = _ReturnsOutput().eval()
        fast = sw.compile(model, sizes=[2, 3], backend="aot_eager", progress=False, cache=str(tmp_path),
                          warm_start=True)
        x = torch.randn(3, 8)
        torch.testing.assert_close(fast(x).y, model(x).y)
        return fast

    assert "1 trace(s) saved" in start().warm_info
    no_tracing(monkeypatch)
    assert "1 trace(s) loaded" in start().warm_info


def _local_config() -> object:
    class Config:  # a class defined inside a function: torch cannot save a guard on its objects
        scale = 2.0

    return Config()


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.cfg = _local_config()

    def forward(self, x):
        return self.lin(x) * self.cfg.scale


def test_torchs_own_package_error_turns_warm_starts_off_and_the_call_goes_on(tmp_path):
    # Unmocked: torch 2.13 raises its PackageError (a Dynamo exception) for the guard on the
    # function-local class; it was taken for a trace error and failed the call.
    model = _Scaled().eval()
    fast = sw.compile(model, sizes=[2, 3], backend="aot_eager", progress=False, cache=str(tmp_path), warm_start=True)
    for n in (2, 3):
        x = torch.randn(n, 8)
        torch.testing.assert_close(fast(x), model(x))
    assert fast.warm_info.startswith("warm start off: torch cannot save this model's trace (PackageError"), \
        fast.warm_info


def test_a_compiled_model_does_not_pickle_and_says_what_to_do():
    with pytest.raises(TypeError, match="warm_start=True"):
        pickle.dumps(sw.compile(MLP(), sizes=[2], backend="aot_eager"))


def test_the_backend_entry_saves_through_torchs_aot_compile(tmp_path):
    model = toy()
    backend = functools.partial(shapewise_backend, options=dict(
        sizes=[2, 4], ranges=[(5, 16)], splitting_ops=[ATTENTION_OP], backend="aot_eager", progress=False))
    ids = torch.randint(0, 64, (8,))
    torch._dynamo.mark_dynamic(ids, 0)
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
    if not hasattr(compiled, "aot_compile"):
        pytest.skip(f"torch {torch.__version__}'s torch.compile(...) has no .aot_compile (torch 2.13 has it)")
    fn = compiled.aot_compile(((ids,), {}))
    fn.save_compiled_function(str(tmp_path / "fn.bin"))
    with open(tmp_path / "fn.bin", "rb") as f:
        loaded = torch.compiler.load_compiled_function(f)
    for n in (2, 4, 5, 16):
        x = torch.randint(0, 64, (n,))
        assert_same(loaded(model, x), model(x), f"n={n}")


def test_compile_generate_warm_start_gives_eagers_tokens_without_tracing(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 96, (1, 6))

    def start():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, disable_compile=True)
        fast = sw.compile_generate(model, prompt_sizes=[4, 6], max_length=16, static_cache=True, backend="aot_eager",
                                   cache=str(tmp_path), warm_start=True, progress=False)
        for _ in range(2):
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
            assert out.tolist() == ref.tolist()
        # Direct calls as after a trace: each trace's built at its first call, armed by it, then every
        # call of it past Dynamo's frame (12 calls: each trace's first goes through Dynamo).
        assert fast.direct_info == "trace 1: on; trace 2 (seq=1): on", fast.direct_info
        assert fast.direct_calls == 10, fast.direct_calls
        return fast

    def keys(fast):
        return sorted({(r["trace"], r["key"]) for r in fast.report()})

    first = start()
    assert first.traces == 2 and "2 trace(s) saved" in first.warm_info, first.warm_info
    # The prefill trace knows its dim as seq (torch's aot_compile hands the backend a graph whose
    # placeholders Dynamo has cleaned of their sources) and compiles every prompt size up front.
    assert keys(first) == [("1", "{seq=4}"), ("1", "{seq=6}"), ("2 (seq=1)", "{seq=1}")], keys(first)
    no_tracing(monkeypatch)
    second = start()
    assert second.traces == 2 and "2 trace(s) loaded" in second.warm_info, second.warm_info
    assert keys(second) == keys(first)


CHILD = """
import json, sys, time, torch
t0 = time.perf_counter()
import shapewise as sw
from shapewise.models import MLP
torch.manual_seed(0)
mlp = MLP(dim=16, hidden=32).eval()
fast = sw.compile(mlp, sizes=[2, 4], ranges=[(5, 32)], cache=sys.argv[1], warm_start=True, progress=False)
ok = all(torch.allclose(fast(x), mlp(x), atol=1e-5) for x in (torch.randn(n, 16) for n in (2, 4, 7, 32)))
print(json.dumps({"ok": ok, "info": fast.warm_info, "sources": [r["source"] for r in fast.report()]}))
"""


@pytest.mark.inductor
def test_inductor_warm_start_in_a_fresh_process_loads_every_variant_from_the_cache(tmp_path):
    def child():
        done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold = child()
    assert cold["ok"] and "saved" in cold["info"] and set(cold["sources"]) == {"compiled"}, cold
    warm = child()
    assert warm["ok"] and "loaded" in warm["info"], warm
    assert warm["sources"] == ["cache"] * len(cold["sources"]), warm


class _WritesThroughAView(torch.nn.Module):
    """Writes its buffer through a view (a cache's slice), then reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 32))

    def forward(self, x):
        self.cache[:, : x.shape[0]].copy_(x.expand(4, -1))
        return self.cache.sum(0) + x.sum()


def test_a_saved_program_keeps_its_facts_and_its_inner_values_come_back_for_a_compile(tmp_path):
    from shapewise.dispatch.saved import program_bytes, program_from_bytes
    from shapewise.ir import effects

    model = _WritesThroughAView()
    fast = sw.compile(model, sizes=[2, 3], ranges=[(5, 16)], backend="aot_eager", progress=False,
                      warm_start=True, cache=str(tmp_path))
    x = torch.randn(3)
    assert_same(fast(x), _WritesThroughAView()(x))
    (runnable,) = fast.runnables
    live = runnable.program
    loaded, _, under = program_from_bytes(program_bytes(runnable))
    # The state its artifacts' keys were made under (grad on, no autocast), which a load compiles under.
    assert under == (True, ()) == runnable.compiled_under
    from shapewise._compat import precompile

    # No code generated at the load for graphs a call does not run: the whole graph, the stitching
    # graph, the compiled pieces (each once, at its first forward, if ever).
    for gm in (loaded.gm, loaded.graph, *(p.gm for p in loaded.pieces if not p.is_splitting)):
        if gm is not None:
            assert type(gm).forward is precompile._forward_on_first_call
    for was, now in [(live.gm, loaded.gm), *((p.gm, q.gm) for p, q in zip(live.pieces, loaded.pieces))]:
        # What the run time reads is what the live graph says, the write through a view included (the
        # saved view is a plain tensor of its layout: recomputed from it, the write would be lost).
        assert effects.mutated_inputs(now) == effects.mutated_inputs(was)
        assert effects.aliased_outputs(now) == effects.aliased_outputs(was)
        assert effects.inputs_aliased_by_outputs(now) == effects.inputs_aliased_by_outputs(was)
    assert effects.mutated_inputs(loaded.gm), "the buffer written through a view is a mutated input"
    # Inputs and outputs keep their values; the nodes between come back from them, as they were.
    gm = loaded.pieces[0].gm
    inner = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    kept = effects._kept(gm)
    assert inner and all(_compat.node_value(n) is None for n in inner if n not in kept)
    assert effects.restore_values(gm) and not effects.restore_values(gm)  # once
    was = {n.name: _compat.node_value(n) for n in live.pieces[0].gm.graph.nodes}
    for n in inner:
        v, w = _compat.node_value(n), was[n.name]
        if isinstance(w, torch.Tensor):
            assert v.dtype == w.dtype and len(v.shape) == len(w.shape), n.name
            for size in (5, 16):  # the same sizes over the range (the loaded sizes may be simplified)
                at = [sympy.sympify(str(d)).subs({s: size for s in sympy.sympify(str(d)).free_symbols})
                      for d in (*v.shape, *w.shape)]
                assert at[:len(v.shape)] == at[len(v.shape):], (n.name, v.shape, w.shape)
    # The live program lent its values for the save and has every one of them back.
    assert all(_compat.node_value(n) is not None for n in live.pieces[0].gm.graph.nodes if n.op != "output")
    assert effects.saved_facts(live.gm) is None


def test_a_loaded_graph_made_lazy_generates_its_code_at_its_first_call_each_its_own():
    from shapewise._compat import precompile

    graphs = [torch.fx.symbolic_trace(f) for f in (lambda x: x * 2 + 1, lambda x: x.sin())]
    loaded = _compat.graph_loads(_compat.graph_dumps(graphs, graphs))
    for gm in loaded:
        _compat.recompile_loaded(gm, lazy=True)
        assert type(gm).forward is precompile._forward_on_first_call
    x = torch.randn(5)
    forward = loaded[1].forward  # bound before its code exists, as a fallback's callable is
    assert_same(forward(x), graphs[1](x))
    assert_same(loaded[0](x), graphs[0](x))
    assert_same(loaded[1](x), graphs[1](x))
    assert all(type(gm).forward is not precompile._forward_on_first_call for gm in loaded)


def test_loaded_graphs_map_their_node_arguments_as_torchs_pytree_does():
    import collections

    from shapewise._compat import precompile

    def f(x, y):
        a = torch.cat([x, y[1:3, ::2].reshape(2, -1)[:, :4]], dim=0)
        b = torch.nn.functional.pad(a, (1, 1), value=0.5).to(torch.float64, memory_format=torch.contiguous_format)
        return {"out": (b.sum(dim=[0]), a.view(torch.Size([-1]))), "n": a.size(0)}

    gm = torch.fx.symbolic_trace(f)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view"]
    node.kwargs = {"unusual": collections.OrderedDict(k=node.args[0])}  # a container pytree knows, we do not
    node.args = (node.args[0], node.args[1])
    gm.recompile()
    seen, mapped = [], precompile._mapped

    def counted(x, mapping, node_type):
        seen.append(x)
        return mapped(x, mapping, node_type)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precompile, "_mapped", counted)
        (loaded,) = _compat.graph_loads(_compat.graph_dumps([gm], [gm]))
    assert str(loaded.graph) == str(gm.graph)
    assert seen, "the direct mapping ran"
    for a, b in zip(loaded.graph.nodes, gm.graph.nodes):
        assert type(a.args) is type(b.args) and [type(v) for v in a.args] == [type(v) for v in b.args], a.name
        assert type(a.kwargs) is type(b.kwargs) and [type(v) for v in a.kwargs.values()] == \
            [type(v) for v in b.kwargs.values()], a.name


def test_what_a_warm_trace_sets_in_python_state_saves_as_its_direct_call_reads_it():
    from torch._dynamo.source import AttrSource, LocalSource

    from shapewise import direct_checks, warm

    source = AttrSource(LocalSource("cache"), "layers")
    cache = torch.zeros(2, 3)
    n = sympy.Symbol("s0", integer=True, positive=True)
    effects = [(source, "n", 4, None, object()), (source, "keys", _compat.STORED_TENSOR, cache, object()),
               (source, "pos", _compat.NOT_SET, _compat.NOT_SET, object()),
               (source, "length", _compat.StoredSize(n + 1), 3, object())]
    loaded = warm._loaded_effects(pickle.loads(pickle.dumps(warm._saved_effects(effects))))
    assert [(s.name() if callable(s.name) else s.name, a) for s, a, _, _ in loaded] == \
        [("L['cache'].layers", a) for a in ("n", "keys", "pos", "length")]
    assert type(loaded[3][2]) is _compat.StoredSize and loaded[3][2].expr == n + 1 and loaded[3][3] == 3
    assert loaded[0][2:] == (4, None)
    assert loaded[1][2] is _compat.STORED_TENSOR and loaded[1][3] == direct_checks.before_value(cache)
    assert loaded[2][2] is _compat.NOT_SET and loaded[2][3] is _compat.NOT_SET
    # What does not save says why, and that trace's direct call stays off with it.
    why = warm._saved_effects([(source, "mod", None, torch.nn.Linear(2, 2), object())])
    assert isinstance(why, str) and "was a Linear" in why, why
    assert "not known" in warm._saved_effects(None)
    assert warm._loaded_effects(why) == why


class _Branches(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[0] > 4 else x * 3  # a guard on the size: on_miss='eager' serves past it


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_a_warm_trace_keeps_direct_calls_off_where_a_traced_one_does(tmp_path, start):
    if start == "warm":  # a first start saves the trace; the second loads it
        sw.compile(_Branches(), sizes=[8, 16], on_miss="eager", direct_call=True, warm_start=True,
                   backend="aot_eager", cache=str(tmp_path), progress=False)(torch.ones(8))
    fast = sw.compile(_Branches(), sizes=[8, 16], on_miss="eager", direct_call=True, warm_start=True,
                      backend="aot_eager", cache=str(tmp_path), progress=False)
    for n in (8, 8, 16, 2, 2):
        x = torch.randn(n)
        assert_same(fast(x), _Branches()(x), f"n={n}")
    assert fast.direct_calls == 0 and "on_miss='eager'" in fast.direct_info, fast.direct_info
    assert ("loaded" in fast.warm_info) == (start == "warm"), fast.warm_info


def test_values_left_out_keep_the_facts_while_the_values_are_out_and_restore_keeps_the_inputs_own():
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from shapewise.ir import effects

    def writes(cache, x):
        cache[:, :2].copy_(x)
        return cache.sum(0) + x.sum()

    gm = torch.fx.symbolic_trace(writes)
    FakeTensorProp(gm).propagate(torch.zeros(4, 8), torch.randn(4, 2))
    want = effects.mutated_inputs(gm)
    assert want == {0}  # the cache, written through a view
    with effects.values_left_out([gm, gm]):  # (a graph listed twice is thinned once, its facts from its values)
        assert effects.mutated_inputs(gm) == want
        assert all(_compat.node_value(n) is None for n in gm.graph.nodes if n not in effects._kept(gm))
    assert effects.saved_facts(gm) is None and all(_compat.node_value(n) is not None for n in gm.graph.nodes
                                                   if n.op != "output")


def test_a_loaded_graph_whose_values_cannot_be_made_again_compiles_without_and_keeps_its_inputs(monkeypatch, caplog):
    from torch.fx.passes import fake_tensor_prop

    from shapewise.ir import effects

    def f(x, y):
        return (x @ y).relu() + 1

    gm = torch.fx.symbolic_trace(f)
    fake_tensor_prop.FakeTensorProp(gm).propagate(torch.randn(2, 3), torch.randn(3, 4))
    with effects.values_left_out([gm]):
        (loaded,) = _compat.graph_loads(_compat.graph_dumps([gm], [gm]))
    inputs = {n.name: _compat.node_value(n) for n in loaded.graph.nodes if n.op == "placeholder"}
    good = _compat.graph_loads(_compat.graph_dumps([loaded], [loaded]))[0]
    own = {n.name: _compat.node_value(n) for n in good.graph.nodes if n.op == "placeholder"}
    assert effects.restore_values(good)  # made again; the inputs' own values kept (not detached copies)
    assert all(_compat.node_value(n) is not None for n in good.graph.nodes if n.op != "output")
    assert all(_compat.node_value(n) is own[n.name] for n in good.graph.nodes if n.op == "placeholder")

    def broken(self, *args):
        raise RuntimeError("no meta kernel")

    monkeypatch.setattr(fake_tensor_prop.FakeTensorProp, "propagate_dont_convert_inputs", broken)
    assert not effects.restore_values(loaded) and not effects.restore_values(loaded)  # tried once, said once
    assert "cannot be made again" in caplog.text and caplog.text.count("cannot be made again") == 1
    assert {n.name: _compat.node_value(n) for n in loaded.graph.nodes if n.op == "placeholder"} == inputs


@pytest.mark.gpu
def test_warm_started_generate_in_full_cuda_graphs_goes_direct_with_the_cache_in_place(tmp_path):
    """On a GPU: the second start loads both traces, builds their direct calls at their first calls, and
    decodes past Dynamo's frame into CUDA-graph replays that use the static cache where it is, with eager's
    tokens (the warm start's host path as a cold start's)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    prompt = torch.randint(0, 128, (1, 12), device="cuda")

    def start():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval().cuda()
        want = model.generate(prompt, max_new_tokens=16, do_sample=False, cache_implementation="static",
                              disable_compile=True)
        fast = sw.compile_generate(model, prompt_sizes=[12], max_length=64, static_cache=True, cudagraphs="full",
                                   warm_start=True, cache=str(tmp_path), progress=False)
        steps = 0
        for _ in range(2):
            out = model.generate(prompt, max_new_tokens=16, do_sample=False)
            assert torch.equal(out, want)
            steps += out.shape[1] - prompt.shape[1] - 1
        return fast, steps

    first, _ = start()
    assert "2 trace(s) saved" in first.warm_info, first.warm_info
    torch._dynamo.reset()
    fast, steps = start()
    assert "2 trace(s) loaded" in fast.warm_info, fast.warm_info
    assert fast.direct_info == "trace 1: on; trace 2 (seq=1): on", fast.direct_info
    assert fast.direct_calls >= steps - 1, (fast.direct_calls, steps)
    pieces = fast.runnables[1].runtime.graphs.pieces
    assert pieces and not any(p.write_back for p in pieces) and sum(len(p.kept) for p in pieces) >= 4


def test_direct_info_names_every_loaded_trace_before_its_first_call():
    from shapewise.direct import DirectCalls

    directs = DirectCalls(True)
    assert directs.info(str, 0) == "not traced yet"
    assert directs.info(str, 2) == "trace 0: waiting for the trace's first call; trace 1: waiting for the trace's " \
                                   "first call"
    directs.add_trace(1, "a reason", print)  # the second loaded trace called first
    assert directs.info(str, 2) == "trace 0: waiting for the trace's first call; trace 1: off: a reason"
