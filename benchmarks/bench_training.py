"""Training step of a Llama-style model at a few token-count buckets, on one GPU.

The step: forward (loss inside), backward, AdamW step, zero_grad; tokens flattened ``[T]``.
Contenders, same initial weights and batches:
  eager; torch.compile dynamic=True; torch.compile dynamic=False (recompiles per size);
  shapewise static (one Dynamo trace, one static forward + backward per size and piece,
  split at the attention op).
Attention is the custom op ``bench_training::attention`` (SDPA, causal) with an autograd
formula (it recomputes the SDPA forward, then runs its backward): the same kernels for every
contender; shapewise splits the graph there.

Measured per contender and size: the first forward+backward's wall time (the compile,
autotuning and one step: what training pays before its first update at that size), the
median step time over ``--steps`` steps after ``--warmup`` (CUDA: events around each step),
peak memory, and correctness: loss and every gradient at the initial weights against an fp32
eager reference, within max(2 x the bf16 eager error, a floor by dtype). Inductor's and
AOTAutograd's on-disk caches are off unless ``--warm-cache``, so compile times are cold.
Writes results.json and results.md to ``--out`` after each contender.

    PYTHONPATH=. python3 benchmarks/bench_training.py --out /tmp/training
    python3 benchmarks/bench_training.py --device cpu --tiny --out /tmp/training-cpu   # smoke test
"""

from __future__ import annotations

import argparse
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


# -- measurement -----------------------------------------------------------------------------
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
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def loss_and_grads(model: nn.Module, call: Callable[..., torch.Tensor], batch: tuple) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    loss = call(*batch)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def errors(loss: torch.Tensor, grads: list, ref: tuple[torch.Tensor, list]) -> tuple[float, float]:
    """(relative loss error, largest relative gradient error over parameters) vs ``ref``."""
    ref_loss, ref_grads = ref
    return rel_err(loss, ref_loss), max(rel_err(g, r) for g, r in zip(grads, ref_grads))


# -- contenders ------------------------------------------------------------------------------
def shapewise_compile(model: nn.Module, sizes: list[int]) -> Any:
    options: dict[str, Any] = dict(sizes=sizes, splitting_ops=[ATTN], backend="inductor")
    try:  # shapewise's own artifact cache, where this version has one: off, for cold compile times
        return sw.compile(model, cache=False, **options)
    except sw.ConfigError:
        return sw.compile(model, **options)


def wrap(name: str, model: nn.Module, sizes: list[int]) -> tuple[Callable[..., torch.Tensor], Any]:
    if name == "eager":
        return model, None
    if name == "dynamic_true":
        return torch.compile(model, dynamic=True), None
    if name == "dynamic_false":
        return torch.compile(model, dynamic=False), None
    if name == "shapewise":
        fast = shapewise_compile(model, sizes)
        return fast, fast
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
    call, fast = wrap(name, model, sizes)
    graphs0 = dynamo_unique_graphs()
    row: dict[str, Any] = {"contender": name, "sizes": {}}
    # Phase 1, at the initial weights: the first forward+backward per size (compiles), checked.
    for t in sizes:
        holder: dict[str, Any] = {}
        seconds = first_call(lambda t=t: holder.update(out=loss_and_grads(model, call, batches[t])), device)
        loss_e, grad_e = errors(*holder["out"], refs[t])
        tol = max(2 * max(eager_err[t]), ERROR_FLOOR[dtype])
        row["sizes"][t] = {"first_call_s": seconds, "loss_rel_err": loss_e, "grad_rel_err": grad_e,
                           "tolerance": tol, "ok": loss_e <= tol and grad_e <= tol}
        print(f"  {name:>13} T={t:<6} first fwd+bwd {seconds:8.2f} s   loss err {loss_e:.1e}  "
              f"grad err {grad_e:.1e}  (tol {tol:.1e})", flush=True)
    graphs_compiled = dynamo_unique_graphs() - graphs0
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
    row["recompiles_while_timing"] = dynamo_unique_graphs() - graphs0 - graphs_compiled
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


def markdown(result: dict[str, Any]) -> str:
    env = result["env"]
    m = env["model"]
    lines = [
        "# Training step: shapewise static vs torch.compile",
        "",
        f"{env['device']}; torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}; {env['date']}; "
        f"shapewise {env['shapewise_commit']}.",
        f"Llama-style, {m['layers']} layers, hidden {m['dim']}, {m['heads']} heads, MLP {m['hidden']}, vocab "
        f"{m['vocab']}, {m['params_m']:.0f}M parameters, {m['dtype']}; one packed sequence of T tokens; step = "
        f"forward (loss inside) + backward + AdamW (foreach) + zero_grad. {env['timing']}",
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
            lines.append(f"| {r['contender']} | {t} | {s['step_ms']:.2f} | {s['tokens_per_s']:,.0f} | {speed} | "
                         f"{s['first_call_s']:.1f} | {s['loss_rel_err']:.1e} | {s['grad_rel_err']:.1e} | "
                         f"{'yes' if s['ok'] else '**no**'} |")
    lines += ["",
              "| contender | Dynamo graphs | recompiles while timing | first fwd+bwd, sum (s) | peak memory (GiB) |",
              "|---|---:|---:|---:|---:|"]
    for r in result["contenders"]:
        mem = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
        lines.append(f"| {r['contender']} | {r['dynamo_graphs']} | {r['recompiles_while_timing']} | "
                     f"{r['first_calls_total_s']:.1f} | {mem} |")
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
    ap.add_argument("--tiny", action="store_true", help="a small model and sizes (CPU smoke test)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", default=None, help="comma list of bucket sizes (default 4096,8192,16384)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warm-cache", action="store_true", help="keep Inductor's on-disk caches on")
    args = ap.parse_args(argv)
    device = args.device
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    if args.tiny:
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
    base = Llama(**cfg, max_tokens=max(tokens))
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    base = base.to(device=device, dtype=dtype)
    state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    params = sum(p.numel() for p in base.parameters())
    del base

    def make_model(dt: torch.dtype = dtype) -> Llama:
        m = Llama(**cfg, max_tokens=max(tokens)).to(device=device, dtype=dt)
        m.load_state_dict({k: v.to(dt) for k, v in state.items()})
        return m

    gen = torch.Generator().manual_seed(1)
    batches = {t: tuple(torch.randint(0, cfg["vocab"], (t,), generator=gen).to(device) for _ in range(2))
               for t in tokens}
    # References at the initial weights: fp32 eager, and the eager error of the benchmark dtype.
    refs, eager_err = {}, {}
    ref32 = make_model(torch.float32)
    for t in tokens:
        refs[t] = loss_and_grads(ref32, ref32, batches[t])
    del ref32
    eager = make_model()
    for t in tokens:
        eager_err[t] = errors(*loss_and_grads(eager, eager, batches[t]), refs[t])
    del eager

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
        "timing": (f"Median of {args.steps} steps after {args.warmup} warm-up steps "
                   f"({'CUDA events' if device == 'cuda' else 'wall clock'}). First fwd+bwd: wall time of the first "
                   f"forward+backward at that size (compile + autotune + one step), on-disk caches "
                   f"{'on' if args.warm_cache else 'off'}."),
    }
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
    ok = all(s["ok"] for r in result["contenders"] for s in r["sizes"].values()) and not result["errors"]
    result["ok"] = ok
    write(out, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
