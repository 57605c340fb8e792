"""The decode step, measured the way the bandwidth floor is defined: side by side in one process
on one GPU, contenders interleaved round by round.

Models (random weights, bf16, SDPA, batch 1, a static KV cache for every contender so that a
step can be repeated in place): ``1b``, Llama-3.2-1B shapes (hidden 2048, 16 layers, 32 heads,
8 KV heads, MLP 8192, vocab 128256, tied embeddings); ``8b``, Llama-3.1-8B shapes (hidden 4096,
32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256).

Contenders (each on its own copy of the weights):
  eager        transformers' forward, static cache, no compile (``disable_compile``);
  hf_recipe    transformers' own recipe: the static cache and ``torch.compile(mode="reduce-overhead",
               fullgraph=True)`` of the forward (``generate()``'s ``CompileConfig``);
  sw_full      ``sw.compile_generate(..., static_cache=True, cudagraphs="full")`` with its defaults
               (the forward one piece: compile_generate splits nothing under full graphs; q/k/v and
               gate/up fused, ``FuseProjections``, since 2026-12-03; from fe44f12 (2026-12-03) also
               ``GroupedDecodeAttention`` in shapewise's decode kernel and Inductor's combo kernels;
               from 2026-12-04 also ``BatchInputUpdates``, the layers' cache counters in one add; from
               2026-12-06 also ``DecodeGemv``, each decode linear in shapewise's tuned Triton GEMV
               where it times faster than cuBLAS);
  sw_full_plain   ``sw_full`` with ``grouped_decode=False, combo_kernels=False, batch_updates=False,
               decode_gemv=False`` (the default before fe44f12, 2026-12-03);
  sw_full_nobatch ``sw_full`` with ``batch_updates=False`` (the default before 2026-12-04);
  sw_full_sync    ``sw_full`` with ``defer_stop=False``: ``generate()`` checks for a stop at every
               step, waiting for the GPU (the default before 2026-12-04's evening); its step is
               ``sw_full``'s, only its ``generate()`` differs;
  hf_recipe_deferred  ``hf_recipe`` with its ``generate()`` inside ``sw._compat.deferred_stop_checks()``
               (what transformers' loop gives the recipe if told to check for a stop one step late,
               as compile_generate tells it);
  sw_full_nofuse  ``sw_full_plain`` with ``fuse_projections=False`` (seven matmuls a layer);
  sw_full_split   ``sw_full`` with ``splitting_ops=("sdpa",)``: pieces split at SDPA, so Inductor
               does not fuse across the attention (nor can GroupedDecodeAttention see it;
               compile_generate's default before 2026-12-03);
  sw_full_and_piecewise   ``cudagraphs={"mode": "full_and_piecewise"}`` (split at SDPA; decode, one
               token, is a full graph; prefill piecewise);
  sw_full_nogemv  ``sw_full`` with ``decode_gemv=False``: every decode linear cuBLAS's (the default
               before 2026-12-06; ``sw_full_gemv``, DecodeGemv given by hand, was today's ``sw_full``);
  sw_full_combo   ``sw_full`` with ``grouped_decode=False``: of the two, Inductor's combo kernels only
               (independent small kernels, a layer's rotary, cache writes, counter, in one launch);
  sw_full_gqa     ``sw_full`` with ``combo_kernels=False``: of the two, ``GroupedDecodeAttention`` only
               (the decode step's attention reads the cache's 8 KV heads, not 32 repeated copies of
               them, in ``shapewise::decode_attention``; before fe44f12, SDPA).
  (``sw_full_combo_gqa``, both, is ``sw_full`` from fe44f12.)
  sw_full_pdl     ``sw_full`` with ``pdl=True``: Inductor's kernels and the decode attention kernel
               launched with programmatic dependent launch, each starting while the one ahead ends
               (compile_generate's own DecodeGemv stays tuned against cuBLAS, without PDL; from
               17da557 to ec97974 this contender was ``sw_full_gemv_pdl``);
  sw_full_gemv_pdl ``sw_full_pdl`` with ``graph_passes=[DecodeGemv(pdl=True)]``: the GEMVs too, the
               kernel for every weight, each prefetching its weight into L2 before it waits;
  sw_full_glu     ``sw_full`` with ``graph_passes=[DecodeGemv(glu=True)]``: the down projection's kernel computes
               silu(gate) * up as it loads it, where its timing says that beats the plain product and
               the activation's own kernel (``kernels.gemv.glu_pays``, since 2026-12-07's evening);
  sw_full_norm    ``sw_full`` with ``graph_passes=[DecodeGemv(norm=True)]``: each GEMV's kernel takes the
               RMSNorm before it into its loads and the residual add after it into its store (2026-12-07,
               late): a layer's two norm kernels gone; since 2026-12-07 (night) ``sw_full`` is this too
               (``gemv_norm``, one-row products only: ``DecodeGemv(norm_rows=1)``);
  sw_full_nonorm  ``sw_full`` with ``gemv_norm=False``: the norms and residual adds kernels of their own
               (``sw_full`` until 2026-12-07, late);
  sw_full_masks   ``sw_full`` with ``graph_masks=True``: ``generate()`` hands the forward no mask (no
               padding here), which builds it inside the graph, not transformers eagerly at every step
               outside it (the step is recorded as ``generate()`` calls it: no mask, built in the graph);
  sw_full_checks_all ``sw_full`` checking everything every call, as before 2026-12-05 (evening): the
               direct call every attribute of the cache and its layers (no dict versions) and the
               graph its kept inputs' strides (``checks_all``): the lean host path's baseline.
  sw_full_dtensor ``sw_full`` on DTensor weights: torch.distributed.tensor.parallel's colwise / rowwise
               plan on a mesh of one device (bench_dtensor's world-1 plan, a process group of one:
               NCCL on a GPU, gloo on the CPU), as a tensor-parallel rank holds its weights. Not
               quite ``sw_full``: FuseProjections leaves DTensor weights unpacked (seven matmuls a
               layer), and the plan unties the 1B's tied embedding and head (525 MB more read).

The decode step is the call ``generate()`` makes: its arguments are recorded from
``prepare_inputs_for_generation`` at the last decode step of a warm-up generation (input_ids
[1, 1], position ids, the StaticCache, ...) and the step is called with them again and again
(it writes the same cache slot each time). Per contender:

- host µs per step: the GPU idle, the time a step's call takes to return (it launches, it does not
  wait), median over steps;
- GPU µs per step: CUDA events around ``n`` steps issued while the GPU is held busy by a spin
  kernel first (the host far ahead; ``n`` kept under the launch queue's depth), median of rounds;
- host µs per step with the GPU kept ahead: the time to issue 20 steps back to back behind a spin
  (``n`` for eager, whose kernels are launched one by one), over their number, median of rounds
  (from 2026-12-03: the steady state, where the first measure times single calls, each after a
  synchronize);
- kernels, device copies (memcpys, and kernels that only copy: ``is_copy_kernel``; before 2026-12-03
  every kernel with "copy" in its name was counted, Inductor's fused RMSNorms with their dtype
  casts included) and memsets per step, and each kernel name's count and GPU µs per step, from torch.profiler over
  ``--profile-steps`` steps, with the GPU kernel time they add up to;
- the floor: the weights' bytes (read once per step) over the measured copy bandwidth (a 1 GiB
  device-to-device copy, bytes read plus bytes written), and the fraction of it reached;
- ``generate()`` decode tokens/s: prompt 128, 256 new tokens, median of full generations over the
  time past the first token (from 2026-12-06 after one untimed generation of each length: on the CPU
  the first one-token ``generate()`` took longer than a full one);
- what ``generate()`` runs per decode token outside the forward (``--generate-profile``, from
  2026-12-06): top-level ATen ops on the host, by name, and GPU launches per token against the step's
  call alone (on one H200 host a token took 1.88 ms in ``generate()`` over a 0.92 ms GPU step);
- correctness: each contender's tokens against eager's in fp32 on a 2-layer model of the same
  widths (``--check-layers``), and its bf16 per-step logits against the fp32 model's (relative
  error, over the steps before the first token where the two differ).

    PYTHONPATH=. python3 benchmarks/bench_decode.py --models 1b --out /tmp/decode
    python3 benchmarks/bench_decode.py --device cpu --tiny --out /tmp/decode-cpu     # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shapewise as sw  # noqa: E402
from benchmarks.bench_generate import LLAMA_1B, TINY, llama, sync  # noqa: E402

CONTENDERS = ("eager", "hf_recipe", "sw_full", "sw_full_plain", "sw_full_nofuse", "sw_full_split",
              "sw_full_and_piecewise", "sw_full_nogemv", "sw_full_combo", "sw_full_gqa", "sw_full_dtensor",
              "sw_full_nobatch", "sw_full_sync", "hf_recipe_deferred", "sw_full_checks_all", "sw_full_pdl",
              "sw_full_gemv_pdl", "sw_full_masks", "sw_full_glu", "sw_full_norm",
              "sw_full_nonorm")
SHAPES = {
    "1b": LLAMA_1B,
    "8b": {**LLAMA_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "tie_word_embeddings": False},
    "tiny": TINY,
}


@contextlib.contextmanager
def checks_all(name: str) -> Iterator[None]:
    """For ``sw_full_checks_all``, while its model compiles and captures: direct calls made without
    dict versions and whole-forward graphs that check their kept inputs' strides (as before)."""
    if name != "sw_full_checks_all":
        yield
        return
    import shapewise.dispatch.graphed as graphed

    versions, init = sw._compat.dict_version, graphed.GraphedPiece.__init__

    def init_checking_strides(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.layout_guarded = False

    sw._compat.dict_version, graphed.GraphedPiece.__init__ = None, init_checking_strides
    try:
        yield
    finally:
        sw._compat.dict_version, graphed.GraphedPiece.__init__ = versions, init


def make_model(shape: str, device: str, dtype: torch.dtype, layers: int | None = None):
    return llama(SHAPES[shape], device, dtype, layers)


def prepare(name: str, model, prompt: int, new: int, device: str) -> Any:
    """Set ``model`` up as contender ``name`` (static cache for all); returns the shapewise module or None."""
    model.generation_config.cache_implementation = "static"
    if name == "eager":
        model.generation_config.disable_compile = True
        return None
    if name in ("hf_recipe", "hf_recipe_deferred"):
        from transformers import CompileConfig

        model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        if name == "hf_recipe_deferred":  # transformers' loop told to check for a stop one step late
            generate = model.generate

            def generate_deferred(*args: Any, **kwargs: Any) -> Any:
                with sw._compat.deferred_stop_checks():
                    return generate(*args, **kwargs)

            model.generate = generate_deferred
        return None
    if name == "sw_full_dtensor":
        on_a_mesh_of_one(model, device)
    graphs = {"sw_full_and_piecewise": {"mode": "full_and_piecewise"}}.get(name, "full")
    split = {"sw_full": {}, "sw_full_and_piecewise": {}, "sw_full_dtensor": {}, "sw_full_checks_all": {},
             "sw_full_plain": {"grouped_decode": False, "combo_kernels": False, "batch_updates": False,
                               "decode_gemv": False},
             "sw_full_nofuse": {"grouped_decode": False, "combo_kernels": False, "batch_updates": False,
                                "decode_gemv": False, "fuse_projections": False},
             "sw_full_nobatch": {"batch_updates": False}, "sw_full_sync": {"defer_stop": False},
             "sw_full_split": {"splitting_ops": ("sdpa",)},
             "sw_full_nogemv": {"decode_gemv": False},  # cuBLAS at decode
             "sw_full_masks": {"graph_masks": True},
             "sw_full_pdl": {"pdl": True},
             "sw_full_gemv_pdl": {"pdl": True, "graph_passes": [sw.library.DecodeGemv(pdl=True)]},
             "sw_full_glu": {"graph_passes": [sw.library.DecodeGemv(glu=True)]},
             "sw_full_norm": {"graph_passes": [sw.library.DecodeGemv(norm=True)]},
             "sw_full_nonorm": {"gemv_norm": False},
             "sw_full_combo": {"grouped_decode": False}, "sw_full_gqa": {"combo_kernels": False}}[name]
    return sw.compile_generate(model, prompt_sizes=[prompt], max_length=prompt + new, static_cache=True,
                               backend="inductor", cudagraphs=graphs if device == "cuda" else False,
                               progress=False, **split)


class Step:
    """The first decode step of a warm-up generation, to call again and again: its keyword
    arguments (recorded from ``prepare_inputs_for_generation``) and the cache's token counters as
    they were then. transformers >= 5.2x's static layers write at a counter they advance on the
    device (``cumulative_length``), so the steps advance through the cache as decode does;
    ``rewind()`` (outside every timed region) puts the counters back. Older transformers write at
    ``cache_position``: every call writes the same slot."""

    def __init__(self, name: str, model, ids: torch.Tensor, new: int) -> None:
        seen: list[dict[str, Any]] = []
        counters: list[tuple[torch.Tensor, torch.Tensor]] = []
        prepare_inputs = model.prepare_inputs_for_generation

        def spy(*args: Any, **kwargs: Any) -> Any:
            out = prepare_inputs(*args, **kwargs)
            if out["input_ids"].shape[-1] == 1 and not seen:
                # Copies (generate() advances its position tensors in place after a step), in their
                # own layouts; an expanded tensor (a mask) is kept as it is (nothing writes it).
                seen.append({k: v.clone() if isinstance(v, torch.Tensor) and 0 not in v.stride() else v
                             for k, v in out.items()})
                cache = out.get("cache", out.get("past_key_values"))
                for layer in getattr(cache, "layers", ()):
                    t = getattr(layer, "cumulative_length", None)
                    if isinstance(t, torch.Tensor):
                        counters.append((t, t.clone()))
            return out

        model.prepare_inputs_for_generation = spy
        try:
            with torch.no_grad():
                model.generate(ids, do_sample=False, max_new_tokens=new, min_new_tokens=new)
        finally:
            model.prepare_inputs_for_generation = prepare_inputs
        # generate() calls the forward with the inputs prepared and return_dict=True
        self.kwargs, self.counters, self.room = {**seen[0], "return_dict": True}, counters, new - 2
        if name in ("hf_recipe", "hf_recipe_deferred"):  # the compiled call generate() makes for decode steps
            compiled = model.get_compiled_call(model.generation_config.compile_config)
            self.call = lambda: compiled(**self.kwargs)
        elif getattr(model.generate, "shapewise_borrows", False):
            # As inside generate(), which borrows the graphs' outputs (compile_generate): not cloned.
            # (generate() enters the context once per call; here once per step, ~1 µs more.)
            def call() -> Any:
                with sw.dispatch.borrowed_outputs():
                    return model(**self.kwargs)

            self.call = call
        else:
            self.call = lambda: model(**self.kwargs)

    def rewind(self) -> None:
        for t, was in self.counters:
            t.copy_(was)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read plus write), median of 20."""
    if device != "cuda":
        return float("nan")
    src = torch.randn(2**28, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def host_us(step: Step, device: str, n: int) -> float:
    samples = []
    step.rewind()
    for _ in range(min(n, step.room)):
        sync(device)
        t0 = time.perf_counter()
        step.call()
        samples.append(time.perf_counter() - t0)
    sync(device)
    return 1e6 * statistics.median(samples)


def host_profile(step: Step, device: str, n: int) -> tuple[list[dict[str, Any]], str]:
    """cProfile over ``n`` steps (each on an idle GPU, as ``host_us``): the functions with the most
    own time, in µs per step, and the whole table as text."""
    import cProfile
    import io
    import pstats

    step.rewind()
    n = min(n, step.room)
    prof = cProfile.Profile()
    for _ in range(n):
        sync(device)
        prof.enable()
        step.call()
        prof.disable()
    sync(device)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # (file, line, name): (cc, nc, tottime, ...)
    top = [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": round(nc / n, 1),
            "own_us_per_step": round(1e6 * tt / n, 1)} for (f, line, name), (_, nc, tt, _, _) in rows[:25]]
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    return top, text.getvalue()


def spin_cycles_per_ms() -> float:
    torch.cuda._sleep(1000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    return 10_000_000 / a.elapsed_time(b)


def behind_spin(step: Step, n: int, spin_ms: float, cycles_per_ms: float) -> tuple[float, float]:
    """``n`` steps issued back to back behind a spin of ``spin_ms`` (the GPU kept busy first):
    (host µs per step to issue them, GPU µs per step between CUDA events around them)."""
    step.rewind()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(cycles_per_ms * spin_ms))
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    for _ in range(n):
        step.call()
    host = (time.perf_counter() - t0) * 1e6 / n
    b.record()
    b.synchronize()
    return host, a.elapsed_time(b) * 1e3 / n


def gpu_us(step: Step, n: int, host_step_us: float, cycles_per_ms: float, rounds: int) -> float:
    """GPU µs per step: ``n`` steps behind a spin long enough for the host to issue all of them."""
    n = min(n, step.room)
    return statistics.median(behind_spin(step, n, 2 + 2 * n * host_step_us / 1e3, cycles_per_ms)[1]
                             for _ in range(rounds))


def host_ahead_us(step: Step, n: int, host_step_us: float, cycles_per_ms: float, rounds: int) -> float:
    """Host µs per step to issue ``n`` steps back to back while the GPU is kept ahead (a spin
    queued first, long enough for all of them): the steady state, no call right after a wait."""
    n = min(n, step.room)
    return statistics.median(behind_spin(step, n, 2 + 3 * n * host_step_us / 1e3, cycles_per_ms)[0]
                             for _ in range(rounds))


def profile(step: Step, device: str, steps: int) -> dict[str, Any]:
    """Kernels, copies and memsets per step, and the GPU kernel time they add up to (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if device != "cuda":
        return {}
    steps = min(steps, step.room)
    step.rewind()
    sync(device)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step.call()
        sync(device)
    kernels = copies = memsets = fused_copy_names = 0
    kernel_us = 0.0
    names: Counter[str] = Counter()
    times: Counter[str] = Counter()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        names[e.name] += 1
        if "memset" in name:
            memsets += 1
        elif "memcpy" in name:
            copies += 1
        else:
            kernels += 1
            if is_copy_kernel(name):
                copies += 1
            elif "copy" in name:
                fused_copy_names += 1
        took = e.device_time if hasattr(e, "device_time") else e.cuda_time
        kernel_us += took
        times[e.name] += took
    return {"kernels_per_step": kernels / steps, "copies_per_step": copies / steps,
            "gpu_events_per_step": sum(names.values()) / steps,  # kernels, memcpys and memsets, each once
            "fused_kernels_named_copy_per_step": fused_copy_names / steps,
            "memsets_per_step": memsets / steps, "kernel_us_per_step": round(kernel_us / steps, 1),
            "kernel_names_per_step": {n: round(c / steps, 2) for n, c in names.most_common(60)},
            "kernel_us_by_name_per_step": {n: round(t / steps, 1) for n, t in times.most_common(60)}}


def is_copy_kernel(name: str) -> bool:
    """Whether a GPU kernel (lower-case name) only copies: ATen's copy kernels (``copy_``,
    ``contiguous``, ``cat``, ``_foreach_copy_``) and Inductor kernels made of copies alone (``triton_poi_fused_copy_0``,
    ``..._fused_clone_0``, ``..._fused_index_copy_0``). An Inductor kernel that fuses a copy with
    compute (``triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0``: an RMSNorm, whose dtype cast
    is a ``_to_copy``) is not one; these were counted as copies before 2026-12-03."""
    if "copy_kernel" in name or "catarraybatchedcopy" in name:
        return True
    if "multi_tensor_apply_kernel" in name and "native::copy<" in name:  # ``_foreach_copy_``
        return True
    for prefix in ("triton_poi_fused_", "triton_per_fused_", "triton_red_fused_"):
        if name.startswith(prefix):
            ops = name[len(prefix):].rsplit("_", 1)[0]
            return ops in ("copy", "clone", "index_copy", "_to_copy", "cat", "copy__", "slice_scatter")
    return False


def generate_tokens_per_s(model, ids: torch.Tensor, new: int, device: str, repeats: int) -> float:
    def timed(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)
        sync(device)
        return time.perf_counter() - t0

    timed(1), timed(new)  # warm-up: a one-token generate() may take a path a longer one does not (untimed)
    first = statistics.median(timed(1) for _ in range(repeats))
    full = statistics.median(timed(new) for _ in range(repeats))
    # (a full generation no longer than a one-token one: noise on a tiny model; no rate, never a huge one)
    return round((new - 1) / (full - first), 1) if full > first else float("nan")


def _launches(run: Any, device: str) -> tuple[Counter, int]:
    """The ATen ops ``run()`` calls on the host outside the model's forward (top-level ones, by name:
    the forward's own sit under ``_marked_forward``'s mark, or under Dynamo's "Torch-Compiled Region"
    where the forward is compiled by the caller), and every GPU kernel, copy and memset it launches
    (0 on the CPU), from torch.profiler; a CUDA graph's replay launches each of its kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with torch_profile(activities=activities) as prof:
        run()
        sync(device)
    ops: Counter[str] = Counter()
    gpu = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu += 1
        elif e.cpu_parent is None and e.name.startswith("aten::"):
            ops[e.name] += 1
    return ops, gpu


@contextlib.contextmanager
def _marked_forward(model) -> Iterator[None]:
    """Hooks that wrap each eager call of ``model``'s forward in a ``record_function``, so what runs
    inside it (through a frame shapewise compiled, or past it) is never counted as the host's. Where
    the caller compiles the module's call itself (transformers' recipe compiles ``__call__``, hooks
    and all), Dynamo traces the hooks: there they do nothing (a profiler mark is not traceable, and
    the compiled region has its own)."""
    from torch.profiler import record_function

    marks: list[Any] = []

    def enter(*_: Any) -> None:
        if not torch.compiler.is_compiling():
            marks.append(record_function("bench_decode.forward"))
            marks[-1].__enter__()

    def leave(*_: Any) -> None:
        if not torch.compiler.is_compiling() and marks:
            marks.pop().__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def generate_launches(model, ids: torch.Tensor, tokens: int, device: str) -> dict[str, Any]:
    """What ``generate()`` runs per decode token outside the forward: top-level ATen ops on the host
    (by name) and GPU launches per token (``generate(tokens)`` less ``generate(1)``, over ``tokens -
    1``, as the tokens/s measure), to set beside the step's own (``profile``'s ``gpu_events_per_step``).
    Where a token's host time exceeds the GPU step, this is what keeps the GPU waiting. The hooks go
    on once, and a ``generate(tokens)`` runs with them before either profile: a module whose call is
    compiled recompiles for new hooks, and that compile is not a token's work."""
    def generate(n: int) -> Any:
        with torch.no_grad():
            return model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)

    n = max(2, tokens)
    with _marked_forward(model):
        generate(1), generate(n)  # warm-up (untimed, unprofiled)
        one_ops, one_gpu = _launches(lambda: generate(1), device)
        all_ops, all_gpu = _launches(lambda: generate(n), device)
    per_token = {k: (all_ops[k] - one_ops[k]) / (n - 1) for k in all_ops}
    return {"generate_host_ops_per_token": round(sum(per_token.values()), 1),
            "generate_gpu_launches_per_token": round((all_gpu - one_gpu) / (n - 1), 1),
            "generate_host_ops_by_name": {k: round(v, 2) for k, v in
                                          sorted(per_token.items(), key=lambda kv: -kv[1])[:20] if v >= 0.5}}


def check(shape: str, names: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Tokens against eager's in fp32 (a small model of the same widths), bf16 logits against fp32."""
    out: dict[str, dict[str, Any]] = {}
    ref32 = make_model(shape, args.device, torch.float32, args.check_layers)
    ids = torch.randint(0, ref32.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(2))
    ids = ids.to(args.device)
    kw = dict(do_sample=False, max_new_tokens=16, min_new_tokens=16, return_dict_in_generate=True, output_logits=True)

    def run(name: str, dtype: torch.dtype):
        model = copy.deepcopy(ref32).to(dtype)
        prepare(name, model, args.prompt, args.new, args.device)
        torch._dynamo.reset()
        with torch.no_grad():
            model.generate(ids, **kw)  # warm-up: compiles, captures
            return model.generate(ids, **kw)

    eager32 = run("eager", torch.float32)
    for name in names:
        try:
            got32 = run(name, torch.float32)
            same = torch.equal(got32.sequences, eager32.sequences)
            got16 = run(name, torch.bfloat16) if args.device == "cuda" else got32
            agree = int((got16.sequences[0] != eager32.sequences[0]).nonzero()[0, 0]) - args.prompt \
                if not torch.equal(got16.sequences, eager32.sequences) else len(got16.logits)
            errs = [float((a.float() - b).norm() / b.norm()) for a, b in
                    zip(got16.logits[:agree + 1], eager32.logits[:agree + 1])]
            out[name] = {"fp32_same_tokens_as_eager": same, "bf16_logits_rel_err_max": max(errs),
                         "bf16_steps_compared": len(errs)}
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out[name] = {"check_error": f"{type(e).__name__}: {e}"[:300]}
    return out


def on_a_mesh_of_one(model, device: str) -> None:
    """``model``'s weights as DTensors: torch's tensor-parallel plan on a mesh of one device, in a
    process group of one (made on first use)."""
    import torch.distributed as dist

    from tests.distributed.tp_worker import parallelize_one

    if not dist.is_initialized():  # one rank: an in-process store, no port to find
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallelize_one(model, torch.device(device, 0) if device == "cuda" else torch.device(device))


def bench_model(shape: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    names = args.contenders.split(",")
    checks = check(shape, names, args) if args.check_layers else {}
    base = make_model(shape, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in base.parameters()}.values())
    cfg = base.config
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Step] = {}
    models = {}
    for name in names:
        try:
            model = copy.deepcopy(base)
            torch._dynamo.reset()
            t0 = time.perf_counter()
            with checks_all(name):
                fast = prepare(name, model, args.prompt, args.new, device)
                step = Step(name, model, ids, args.new)
            rows[name] = {"contender": name, "first_generate_s": round(time.perf_counter() - t0, 1),
                          **checks.get(name, {})}
            step.rewind()
            with torch.no_grad():
                for _ in range(min(10, step.room)):
                    step.call()
            steps[name], models[name] = step, model
            if fast is not None:
                rows[name].update(traces=fast.traces, direct_info=fast.direct_info,
                                  dict_versions=any("MEMO[0]" in d.source for d in fast._directs.armed))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows[name] = {"contender": name, "error": f"{type(e).__name__}: {e}"[:300]}
    del base
    cycles = spin_cycles_per_ms() if device == "cuda" else 0.0
    samples: dict[str, dict[str, list[float]]] = {n: {"host": [], "gpu": [], "ahead": []} for n in steps}
    with torch.no_grad():
        for name, step in steps.items():
            rows[name].update(profile(step, device, args.profile_steps))
        for _ in range(args.rounds):  # interleaved: each round measures every contender once
            for name, step in steps.items():
                h = host_us(step, device, args.host_steps)
                samples[name]["host"].append(h)
                if device == "cuda":
                    per_step = max(rows[name].get("kernels_per_step", 1) + rows[name].get("copies_per_step", 0), 1)
                    n = max(1, min(args.gpu_steps, int(900 // per_step)))
                    samples[name]["gpu"].append(gpu_us(step, n, h, cycles, 3))
                    # A step that replays CUDA graphs queues a graph launch and a few copies, not its
                    # kernels one by one: 20 of them stay under the launch queue's depth.
                    ahead = 20 if name != "eager" else n
                    samples[name]["ahead"].append(host_ahead_us(step, ahead, h, cycles, 3))
        for name, step in steps.items():
            if args.host_profile and name != "eager":
                top, text = host_profile(step, device, args.host_profile)
                rows[name]["host_profile_top"] = top
                out = Path(args.out)
                (out / f"host_profile_{shape}_{name}.txt").write_text(text)
    floor_us = 1e6 * weight_bytes / bandwidth if device == "cuda" else float("nan")
    for name in steps:
        row = rows[name]
        row["host_us_per_step"] = round(statistics.median(samples[name]["host"]), 1)
        if samples[name]["gpu"]:
            row["gpu_us_per_step"] = round(statistics.median(samples[name]["gpu"]), 1)
            row["host_ahead_us_per_step"] = round(statistics.median(samples[name]["ahead"]), 1)
            row["fraction_of_floor"] = round(floor_us / row["gpu_us_per_step"], 3)
        row["generate_decode_tokens_per_s"] = generate_tokens_per_s(models[name], ids, args.new, device,
                                                                    args.generate_repeats)
        if args.generate_profile:
            row.update(generate_launches(models[name], ids, min(args.generate_profile, args.new), device))
        quiet = ("direct_info", "host_profile_top", "kernel_names_per_step", "kernel_us_by_name_per_step",
                 "generate_host_ops_by_name")
        print({k: v for k, v in row.items() if k not in quiet}, flush=True)
    return {"model": shape, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "weight_bytes": weight_bytes, "floor_us": round(floor_us, 1),
            "kv_cache_bytes": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
            * (args.prompt + args.new) * torch.finfo(dtype).bits // 8,
            "rows": [rows[n] for n in names]}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Decode step: {result['hardware']}", "",
             f"torch {result['torch']}, transformers {result['transformers']}, {result['date']}. Batch 1, bf16, "
             f"static KV cache of {result['prompt'] + result['new']} tokens, the step at position "
             f"{result['prompt'] + result['new'] - 1}. Copy bandwidth {result['copy_bandwidth_tb_s']} TB/s "
             "(1 GiB device-to-device, read + write). Medians of "
             f"{result['rounds']} interleaved rounds.", ""]
    for m in result["models"]:
        lines += [f"## {m['model']}: {m['layers']} layers, hidden {m['hidden']}, weights "
                  f"{m['weight_bytes'] / 1e9:.2f} GB, floor {m['floor_us']} µs", "",
                  "| contender | host µs/step | host µs/step, GPU ahead | GPU µs/step | of the floor | kernels/step | "
                  "copies/step | kernel µs/step | generate() tokens/s | traces | fp32 tokens = eager | "
                  "bf16 logits rel. err. |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for r in m["rows"]:
            if "error" in r:
                lines.append(f"| {r['contender']} | failed: {r['error'][:120]} |" + " |" * 11)
                continue
            err = r.get("bf16_logits_rel_err_max")
            err = f"{err:.1e}" if isinstance(err, float) else r.get("check_error", "-")
            lines.append(
                f"| {r['contender']} | {r['host_us_per_step']} | {r.get('host_ahead_us_per_step', '-')} | "
                f"{r.get('gpu_us_per_step', '-')} | "
                f"{r.get('fraction_of_floor', '-')} | {r.get('kernels_per_step', '-')} | "
                f"{r.get('copies_per_step', '-')} | {r.get('kernel_us_per_step', '-')} | "
                f"{r['generate_decode_tokens_per_s']} | {r.get('traces', '-')} | "
                f"{r.get('fp32_same_tokens_as_eager', '-')} | {err} |")
        lines.append("")
        counted = [r for r in m["rows"] if "generate_host_ops_per_token" in r]
        if counted:
            lines += ["What `generate()` runs per decode token outside the forward (torch.profiler: top-level "
                      "ATen ops on the host; GPU kernels, copies and memsets, against the step's call alone):", "",
                      "| contender | host ops/token outside the forward | GPU launches/token in generate() | "
                      "GPU launches/step, the step alone | the host ops, per token |", "|---|---:|---:|---:|---|"]
            for r in counted:
                by_name = ", ".join(f"{k.removeprefix('aten::')} {v:g}" for k, v in
                                    list(r["generate_host_ops_by_name"].items())[:10])
                lines.append(f"| {r['contender']} | {r['generate_host_ops_per_token']} | "
                             f"{r['generate_gpu_launches_per_token']} | {r.get('gpu_events_per_step', '-')} | "
                             f"{by_name} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--tiny", action="store_true", help="the tiny model only (a smoke test)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--host-steps", type=int, default=50)
    ap.add_argument("--gpu-steps", type=int, default=50)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--generate-repeats", type=int, default=3)
    ap.add_argument("--generate-profile", type=int, default=64,
                    help="count what generate() runs per token outside the forward, over this many tokens (0: not)")
    ap.add_argument("--host-profile", type=int, default=0, help="cProfile this many steps per contender (0: none)")
    ap.add_argument("--check-layers", type=int, default=2, help="layers of the correctness model (0: no check)")
    args = ap.parse_args(argv)
    import transformers

    hardware = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    bandwidth = copy_bandwidth(args.device)
    result: dict[str, Any] = {
        "hardware": hardware, "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "prompt": args.prompt, "new": args.new, "rounds": args.rounds,
        "copy_bandwidth_tb_s": round(bandwidth / 1e12, 2), "models": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for shape in (["tiny"] if args.tiny else args.models.split(",")):
        result["models"].append(bench_model(shape, args, bandwidth))
        from shapewise.library.kernels.gemv import GLU_DECISIONS  # sw_full_glu's timings, per shape
        result["glu_decisions"] = GLU_DECISIONS
        (out / f"results_{'_'.join(args.models.split(','))}.json").write_text(json.dumps(result, indent=1))
        (out / f"results_{'_'.join(args.models.split(','))}.md").write_text(markdown(result))
        torch.cuda.empty_cache() if args.device == "cuda" else None
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
