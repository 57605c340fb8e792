"""Training step of a Llama-style model at a few token-count buckets, on one GPU.

``--model toy`` (default): the step is forward (loss inside), backward, AdamW step, zero_grad;
tokens flattened ``[T]``. Contenders, same initial weights and batches:
  eager; torch.compile dynamic=True; torch.compile dynamic=False (recompiles per size);
  shapewise static (one Dynamo trace, one static forward + backward per size and piece,
  split at the attention op).
Attention is the custom op ``bench_training::attention`` (SDPA, causal) with an autograd
formula (it recomputes the SDPA forward, then runs its backward): the same kernels for every
contender; shapewise splits the graph there.

``--model hf-llama``: transformers' ``LlamaForCausalLM`` with random weights and Llama-3.2-1B
shapes (``--layers`` sets num_hidden_layers), ``sdpa`` attention, ids ``[1, T]``; the step is
``model(input_ids=ids, labels=ids).loss``, backward, AdamW step, zero_grad. shapewise:
``sw.compile(model, dynamic_dims={"input_ids": 1, "labels": 1}, sizes=buckets, splitting_ops=["sdpa"])``.
Its fp32 reference repeats the KV heads before SDPA (GQA in fp32 on CUDA takes SDPA's math kernel,
O(T^2) memory) and keeps its gradients in host memory; a size whose reference runs out of device
memory is left unchecked, and the results say so.

Measured per contender and size: the first forward+backward's wall time (the compile,
autotuning and one step: what training pays before its first update at that size), the
median step time over ``--steps`` steps after ``--warmup`` (CUDA: events around each step),
peak memory, and correctness: loss and every gradient at the initial weights against an fp32
eager reference, within max(2 x the bf16 eager error, a floor by dtype). Inductor's and
AOTAutograd's on-disk caches are off unless ``--warm-cache``, so compile times are cold.
Writes results.json and results.md to ``--out`` after each contender.

    PYTHONPATH=. python3 benchmarks/bench_training.py --out /tmp/training
    PYTHONPATH=. python3 benchmarks/bench_training.py --model hf-llama --out /tmp/training-hf
    python3 benchmarks/bench_training.py --device cpu --tiny --out /tmp/training-cpu   # smoke test
    python3 benchmarks/bench_training.py --device cpu --tiny --model hf-llama --out /tmp/training-hf-cpu
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shapewise as sw  # noqa: E402
from shapewise._compat import dynamo_unique_graphs  # noqa: E402

ATTN = "bench_training::attention"
CONTENDERS = ("eager", "dynamic_true", "dynamic_false", "shapewise")
MODELS = ("toy", "hf-llama")
HF_REF_ATTN = "bench_training_sdpa_repeat_kv"  # the fp32 reference's attention (registered with transformers)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Smallest tolerance on relative errors vs the fp32 reference (the bf16 eager error sets the rest).
ERROR_FLOOR = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


# -- attention: a custom op with an autograd formula -----------------------------------------
def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one flattened sequence: [T, H, D] -> [T, H, D]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True)
    return o[0].transpose(0, 1)


@torch.library.custom_op(ATTN, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _sdpa(q, k, v).contiguous()


@attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    # Recompute the SDPA forward, then its backward (saving SDPA's logsumexp would need the
    # device-specific private ops). torch.compile traces this into its backward graph; shapewise
    # runs it eagerly between pieces: the same kernels for every contender.
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
        return torch.autograd.grad(_sdpa(q_, k_, v_), (q_, k_, v_), grad)


attention.register_autograd(_backward, setup_context=_setup)


# -- the model -------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, self.head_dim).unbind(1)
        a = torch.ops.bench_training.attention(rotate(q, cos, sin), rotate(k, cos, sin), v)
        x = x + self.o(a.reshape(t, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    """Token ids and targets ``[T]`` (one packed sequence) -> mean cross-entropy loss."""

    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, layers: int, max_tokens: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        hd = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(max_tokens).float(), inv)
        self.register_buffer("cos", freqs.cos()[:, None, :], persistent=False)
        self.register_buffer("sin", freqs.sin()[:, None, :], persistent=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = ids.shape[0]
        x = self.embed(ids)
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.cross_entropy(self.head(self.norm(x)).float(), targets)


# -- transformers' LlamaForCausalLM ----------------------------------------------------------
def hf_config(tiny: bool, layers: int | None, max_tokens: int) -> Any:
    """Llama-3.2-1B shapes (or a tiny config), rope_theta 500000, tied embeddings, sdpa attention."""
    from transformers import LlamaConfig

    shapes = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=256) if tiny else
              dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=8192, vocab_size=128256))
    if layers:
        shapes["num_hidden_layers"] = layers
    config = LlamaConfig(**shapes, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         tie_word_embeddings=True, max_position_embeddings=max(131072, max_tokens),
                         rms_norm_eps=1e-5, use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def hf_build(config: Any, device: str, dtype: torch.dtype) -> nn.Module:
    """``LlamaForCausalLM(config)`` built in ``dtype`` on ``device``, in training mode. Built under
    that default dtype (as from_pretrained(dtype=...) does), not cast after: the rotary inv_freq
    buffer stays fp32 (a bf16 one would garble the positions of long sequences)."""
    from transformers import LlamaForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.train()


def _ref_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention with the KV heads repeated first (no enable_gqa): the same
    result, but fp32 on CUDA may take the memory-efficient kernel instead of the O(T^2) math one."""
    n = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n, dim=1), value.repeat_interleave(n, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=attention_mask is None and query.shape[2] > 1)
    return out.transpose(1, 2).contiguous(), None


def hf_reference_config(config: Any) -> Any:
    from transformers import AttentionInterface

    AttentionInterface.register(HF_REF_ATTN, _ref_attention)
    ref = copy.deepcopy(config)
    ref._attn_implementation = HF_REF_ATTN  # no mask function registered: no mask, is_causal instead
    return ref


def hf_loss(call: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(ids: torch.Tensor) -> torch.Tensor:
        return call(input_ids=ids, labels=ids).loss

    return loss


# -- measurement -----------------------------------------------------------------------------
def dynamo_traces() -> int | None:
    """Dynamo compile ids handed out since the last ``torch._dynamo.reset()``: one per frame traced
    (fullgraph or not; a recompile is one more, a graph break one more per resumed frame). Not
    counters["frames"], which only non-fullgraph compiles (not shapewise's) count."""
    from torch._dynamo import convert_frame

    counter = getattr(convert_frame, "FRAME_COMPILE_COUNTER", None)
    return None if counter is None else sum(counter.values())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def first_call(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def step_times_ms(step: Callable[[], Any], device: str, warmup: int, steps: int) -> list[float]:
    """Per-step times (ms) of ``steps`` steps after ``warmup``: CUDA events on GPU, wall clock on CPU."""
    for _ in range(warmup):
        step()
    sync(device)
    out = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.to(a.device)  # references may be kept in host memory
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def loss_and_grads(model: nn.Module, call: Callable[..., torch.Tensor], batch: tuple,
                   store: str | None = None) -> tuple[torch.Tensor, list]:
    """Loss and a copy of every gradient (on ``store``, default: where they are)."""
    model.zero_grad(set_to_none=True)
    loss = call(*batch)
    loss.backward()
    grads = [p.grad.detach().to(store, copy=True) if store else p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach().float().to(store or loss.device), grads


def errors(loss: torch.Tensor, grads: list, ref: tuple[torch.Tensor, list]) -> tuple[float, float]:
    """(relative loss error, largest relative gradient error over parameters) vs ``ref``."""
    ref_loss, ref_grads = ref
    return rel_err(loss, ref_loss), max(rel_err(g, r) for g, r in zip(grads, ref_grads))


# -- contenders ------------------------------------------------------------------------------
def shapewise_compile(model: nn.Module, sizes: list[int], hf: bool = False) -> Any:
    options: dict[str, Any] = dict(sizes=sizes, splitting_ops=[ATTN], backend="inductor")
    if hf:
        options.update(dynamic_dims={"input_ids": 1, "labels": 1}, splitting_ops=["sdpa"])
    try:  # shapewise's own artifact cache, where this version has one: off, for cold compile times
        return sw.compile(model, cache=False, **options)
    except sw.ConfigError:
        return sw.compile(model, **options)


def wrap(name: str, model: nn.Module, sizes: list[int], hf: bool = False) -> tuple[Callable[..., torch.Tensor], Any]:
    """The contender's loss function of a batch (``hf``: of ``ids``, through ``.loss``), and its
    shapewise module where it has one."""
    loss = hf_loss if hf else (lambda call: call)
    if name == "eager":
        return loss(model), None
    if name == "dynamic_true":
        return loss(torch.compile(model, dynamic=True)), None
    if name == "dynamic_false":
        return loss(torch.compile(model, dynamic=False)), None
    if name == "shapewise":
        fast = shapewise_compile(model, sizes, hf)
        return loss(fast), fast
    raise ValueError(f"unknown contender {name!r}; known: {CONTENDERS}")


def run_contender(name: str, make_model: Callable[[], nn.Module], batches: dict[int, tuple],
                  refs: dict[int, tuple], eager_err: dict[int, tuple[float, float]], args: argparse.Namespace,
                  dtype: torch.dtype) -> dict[str, Any]:
    device = args.device
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = make_model()
    sizes = sorted(batches)
    # Fresh input tensors per contender: Dynamo records dynamism on the tensors it sees
    # (dynamic=True propagates it, mark_dynamic marks them), and a later dynamic=False compile
    # fed the same tensors would treat those dims as dynamic.
    batches = {t: tuple(x.clone() for x in b) for t, b in batches.items()}
    call, fast = wrap(name, model, sizes, hf=args.model == "hf-llama")
    graphs0, traces0 = dynamo_unique_graphs(), dynamo_traces()
    row: dict[str, Any] = {"contender": name, "sizes": {}}
    # Phase 1, at the initial weights: the first forward+backward per size (compiles), checked.
    for t in sizes:
        holder: dict[str, Any] = {}
        seconds = first_call(lambda t=t: holder.update(out=loss_and_grads(model, call, batches[t])), device)
        if t not in refs:  # no fp32 reference at this size (it ran out of memory): not checked
            row["sizes"][t] = {"first_call_s": seconds, "loss_rel_err": None, "grad_rel_err": None,
                               "tolerance": None, "ok": None}
            print(f"  {name:>13} T={t:<6} first fwd+bwd {seconds:8.2f} s   (no reference: not checked)", flush=True)
            continue
        loss_e, grad_e = errors(*holder.pop("out"), refs[t])
        tol = max(2 * max(eager_err[t]), ERROR_FLOOR[dtype])
        row["sizes"][t] = {"first_call_s": seconds, "loss_rel_err": loss_e, "grad_rel_err": grad_e,
                           "tolerance": tol, "ok": loss_e <= tol and grad_e <= tol}
        print(f"  {name:>13} T={t:<6} first fwd+bwd {seconds:8.2f} s   loss err {loss_e:.1e}  "
              f"grad err {grad_e:.1e}  (tol {tol:.1e})", flush=True)
    graphs_compiled, traces1 = dynamo_unique_graphs() - graphs0, dynamo_traces()
    traces_compiled = None if traces0 is None else traces1 - traces0
    # Phase 2: training steps (optimizer included), timed.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    for t in sizes:
        batch = batches[t]

        def step(batch: tuple = batch) -> None:
            loss = call(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times = step_times_ms(step, device, args.warmup, args.steps)
        med = statistics.median(times)
        row["sizes"][t].update(step_ms=med, step_ms_min=min(times), step_ms_max=max(times),
                               tokens_per_s=t / (med * 1e-3))
        print(f"  {name:>13} T={t:<6} step {med:9.3f} ms  ({t / (med * 1e-3):,.0f} tokens/s)", flush=True)
    row["dynamo_graphs"] = graphs_compiled
    row["dynamo_traces"] = traces_compiled
    row["recompiles_while_timing"] = dynamo_unique_graphs() - graphs0 - graphs_compiled
    row["dynamo_traces_while_timing"] = None if traces0 is None else dynamo_traces() - traces1
    row["first_calls_total_s"] = sum(s["first_call_s"] for s in row["sizes"].values())
    if device == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if fast is not None:
        rows = list(fast.report())
        row["shapewise"] = {"traces": fast.traces, "compiled_variants": len(rows),
                            "compile_seconds_in_report": sum(float(r["seconds"]) for r in rows),
                            "pieces": len(fast.program.pieces)}
    return row


# -- output ----------------------------------------------------------------------------------
def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parents[1])
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    env = result["env"]
    m = env["model"]
    if m.get("kind") == "hf-llama":
        model_line = (f"{m['description']} ({m['layers']} layers, hidden {m['dim']}, {m['heads']} heads, "
                      f"{m['kv_heads']} KV heads, MLP {m['hidden']}, vocab {m['vocab']}, rope_theta "
                      f"{m['rope_theta']:g}, tied embeddings, attention sdpa), {m['dtype']}, transformers "
                      f"{env['transformers']}; batch 1 x T tokens; step = model(input_ids=ids, labels=ids).loss + "
                      f"backward + AdamW (foreach) + zero_grad. {env['timing']}")
    else:
        model_line = (f"Llama-style, {m['layers']} layers, hidden {m['dim']}, {m['heads']} heads, MLP {m['hidden']}, "
                      f"vocab {m['vocab']}, {m['params_m']:.0f}M parameters, {m['dtype']}; one packed sequence of T "
                      f"tokens; step = forward (loss inside) + backward + AdamW (foreach) + zero_grad. {env['timing']}")
    lines = [
        "# Training step: shapewise static vs torch.compile",
        "",
        f"{env['device']}; torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}; {env['date']}; "
        f"shapewise {env['shapewise_commit']}.",
        model_line,
    ]
    if env.get("reference"):
        lines += ["", env["reference"]]
    lines += [
        "",
        "| contender | T | step (ms) | tokens/s | vs dynamic=True | first fwd+bwd (s) | loss err | grad err | ok |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    base = {t: s.get("step_ms") for r in result["contenders"] if r["contender"] == "dynamic_true"
            for t, s in r["sizes"].items()}
    for r in result["contenders"]:
        for t, s in r["sizes"].items():
            if "step_ms" not in s:
                continue
            speed = f"{base[t] / s['step_ms']:.2f}x" if base.get(t) else "-"
            ok = "not checked" if s["ok"] is None else "yes" if s["ok"] else "**no**"
            lines.append(f"| {r['contender']} | {t} | {s['step_ms']:.2f} | {s['tokens_per_s']:,.0f} | {speed} | "
                         f"{s['first_call_s']:.1f} | {_fmt(s['loss_rel_err'], '.1e')} | "
                         f"{_fmt(s['grad_rel_err'], '.1e')} | {ok} |")
    lines += ["",
              "Dynamo traces: frames Dynamo traced (compile ids; a recompile is one more, a graph break one more per "
              "resumed frame); Dynamo graphs: the graphs those traces made.",
              "",
              "| contender | Dynamo traces | Dynamo graphs | recompiles while timing | first fwd+bwd, sum (s) | "
              "peak memory (GiB) |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in result["contenders"]:
        mem = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
        traces = "-" if r.get("dynamo_traces") is None else r["dynamo_traces"]
        lines.append(f"| {r['contender']} | {traces} | {r['dynamo_graphs']} | "
                     f"{r['recompiles_while_timing']} | {r['first_calls_total_s']:.1f} | {mem} |")
    for r in result["contenders"]:
        if "shapewise" in r:
            s = r["shapewise"]
            lines += ["", f"shapewise: {s['traces']} trace, {s['pieces']} pieces, {s['compiled_variants']} compiled "
                          f"(piece, size) variants, each a forward and a backward; "
                          f"{s['compile_seconds_in_report']:.1f} s of compiles in its report."]
    for e in result.get("errors", []):
        lines += ["", f"{e['contender']} failed: `{e['error']}`"]
    return "\n".join(lines) + "\n"


def write(out: Path, result: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(result))


# -- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for results.json and results.md")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="toy", choices=MODELS,
                    help="toy: this file's Llama-style model; hf-llama: transformers' LlamaForCausalLM, "
                         "Llama-3.2-1B shapes, random weights")
    ap.add_argument("--tiny", action="store_true", help="a small model and sizes (CPU smoke test)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", default=None, help="comma list of bucket sizes (default 4096,8192,16384; "
                                                   "hf-llama: 2048,4096,8192,16384)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warm-cache", action="store_true", help="keep Inductor's on-disk caches on")
    args = ap.parse_args(argv)
    device = args.device
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    hf = args.model == "hf-llama"
    if hf:
        tokens = [int(t) for t in (args.tokens or ("16,32" if args.tiny else "2048,4096,8192,16384")).split(",")]
    elif args.tiny:
        cfg = dict(vocab=512, dim=64, heads=4, hidden=160, layers=args.layers or 2)
        tokens = [int(t) for t in (args.tokens or "64,128,256").split(",")]
    else:
        cfg = dict(vocab=32000, dim=2048, heads=16, hidden=5632, layers=args.layers or 4)
        tokens = [int(t) for t in (args.tokens or "4096,8192,16384").split(",")]
    names = [c for c in args.contenders.split(",") if c]
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        ap.error(f"unknown contender(s) {sorted(unknown)}; known: {','.join(CONTENDERS)}")
    if not args.warm_cache:
        torch._inductor.config.fx_graph_cache = False
        # standalone_compile warns on each compile that it cannot save an artifact without the cache
        logging.getLogger("torch._inductor.standalone_compile").setLevel(logging.ERROR)
        if hasattr(torch._functorch.config, "enable_autograd_cache"):
            torch._functorch.config.enable_autograd_cache = False
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    if hf:
        import transformers

        config = hf_config(args.tiny, args.layers, max(tokens))
        ref_config = hf_reference_config(config)
        base = hf_build(config, device, dtype)  # transformers' init: normal(0, 0.02) weights, unit norms
        cfg = dict(vocab=config.vocab_size, dim=config.hidden_size, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, hidden=config.intermediate_size,
                   layers=config.num_hidden_layers, rope_theta=config.rope_parameters["rope_theta"])
    else:
        base = Llama(**cfg, max_tokens=max(tokens))
        with torch.no_grad():
            for p in base.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
        base = base.to(device=device, dtype=dtype)
    state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    params = sum(p.numel() for p in base.parameters())
    del base

    def make_model(dt: torch.dtype = dtype, reference: bool = False) -> nn.Module:
        if hf:
            m = hf_build(ref_config if reference else config, device, dt)
        else:
            m = Llama(**cfg, max_tokens=max(tokens)).to(device=device, dtype=dt)
        m.load_state_dict({k: v.to(dt) for k, v in state.items()})
        return m

    gen = torch.Generator().manual_seed(1)
    if hf:
        batches = {t: (torch.randint(0, cfg["vocab"], (1, t), generator=gen).to(device),) for t in tokens}
    else:
        batches = {t: tuple(torch.randint(0, cfg["vocab"], (t,), generator=gen).to(device) for _ in range(2))
                   for t in tokens}
    loss_of = hf_loss if hf else (lambda m: m)
    # References at the initial weights: fp32 eager, and the eager error of the benchmark dtype.
    # hf-llama keeps the fp32 gradients in host memory (the 1B model's are 5 GB a size).
    refs, eager_err, no_ref = {}, {}, []
    ref32 = make_model(torch.float32, reference=True)
    for t in tokens:
        try:
            refs[t] = loss_and_grads(ref32, loss_of(ref32), batches[t], store="cpu" if hf else None)
        except torch.OutOfMemoryError:
            no_ref.append(t)
        if t in no_ref:  # outside the except: its traceback no longer holds the activations
            ref32.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            print(f"fp32 reference at T={t}: out of device memory; T={t} is not checked", flush=True)
    del ref32
    eager = make_model()
    for t in refs:
        eager_err[t] = errors(*loss_and_grads(eager, loss_of(eager), batches[t]), refs[t])
    del eager
    if device == "cuda":
        torch.cuda.empty_cache()

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine()),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "shapewise_commit": _git_commit(),
        "model": {**cfg, "params_m": params / 1e6, "dtype": str(dtype).replace("torch.", "")},
        "tokens": tokens,
        "reference": ("Correctness: loss and every gradient against an fp32 eager reference of the same weights"
                      + (f"; no fp32 reference at T={', '.join(map(str, no_ref))} (out of device memory): "
                         "not checked there" if no_ref else "")
                      + (". The reference's attention repeats the KV heads before SDPA "
                         "(same math; fp32 GQA on CUDA would take the O(T^2) math kernel)" if hf else "") + "."),
        "timing": (f"Median of {args.steps} steps after {args.warmup} warm-up steps "
                   f"({'CUDA events' if device == 'cuda' else 'wall clock'}). First fwd+bwd: wall time of the first "
                   f"forward+backward at that size (compile + autotune + one step), on-disk caches "
                   f"{'on' if args.warm_cache else 'off'}."),
    }
    if hf:
        env["transformers"] = transformers.__version__
        shapes = "tiny shapes" if args.tiny else "Llama-3.2-1B shapes"
        if not args.tiny and config.num_hidden_layers != 16:
            shapes += f" but {config.num_hidden_layers} layers"
        env["model"].update(kind="hf-llama", params=params,
                            description=f"transformers LlamaForCausalLM, {shapes}, {params:,} parameters")
    else:
        env["model"]["kind"] = "toy"
    print(json.dumps(env, indent=1), flush=True)
    result: dict[str, Any] = {"env": env, "eager_error_vs_fp32": {t: e for t, e in eager_err.items()},
                              "contenders": [], "errors": []}
    for name in names:
        print(f"{name}:", flush=True)
        try:
            result["contenders"].append(run_contender(name, make_model, batches, refs, eager_err, args, dtype))
        except Exception as e:  # noqa: BLE001 - record the failure, keep measuring the others
            traceback.print_exc()
            result["errors"].append({"contender": name, "error": f"{type(e).__name__}: {e}"[:2000]})
        write(out, result)
    print(markdown(result))
    ok = all(s["ok"] is not False for r in result["contenders"] for s in r["sizes"].values()) and not result["errors"]
    result["ok"] = ok
    write(out, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
