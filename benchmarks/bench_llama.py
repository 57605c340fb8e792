"""Llama-style decoder stack on one GPU: every contender at every token count, in one run.

Contenders (same weights, same inputs, each checked against eager):
  eager; torch.compile dynamic=True; dynamic=False (recompiles per size);
  mode="reduce-overhead"; mode="max-autotune-no-cudagraphs" + dynamic=False;
  mark_dynamic(specialize_on=...) (its failure recorded if it fails);
  shapewise static; shapewise static + max_autotune per size; shapewise static + CUDA graphs;
  full graphs with DecodeGemv and with programmatic dependent launch (PDL).

Timing: triton.testing.do_bench (CUDA events, warm-up, L2 flushed), median of its medians over
``--repeats`` rounds. Roofline: the stack's bytes over the measured copy bandwidth and its FLOPs
over the measured bf16 matmul rate. Writes results.json, results.md (and a plot if matplotlib is
there) to ``--out``.

    PYTHONPATH=. python3 benchmarks/bench_llama.py --out /tmp/llama
    python3 benchmarks/bench_llama.py --device cpu --tiny --out /tmp/llama-cpu   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
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

ATTN = "bench_llama::attention"


@torch.library.custom_op(ATTN, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one flattened sequence: [T, H, D] -> [T, H, D] via SDPA on 4-D inputs."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True)
    return o[0].transpose(0, 1).contiguous()


@attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


@torch.library.custom_op(ATTN + "_out", mutates_args=("out",))
def attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """``attention`` writing into ``out`` (vLLM's attention-with-output form): with piecewise CUDA
    graphs ``out`` is allocated by the graph before the op, so the graph after reads it in place."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True)
    out.copy_(o[0].transpose(0, 1))


@attention_out.register_fake
def _(q, k, v, out):
    return None


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
    def __init__(self, dim: int, heads: int, hidden: int, out_variant: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.out_variant = heads, dim // heads, out_variant
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, self.head_dim).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.out_variant:
            a = torch.empty_like(q)
            torch.ops.bench_llama.attention_out(q, k, v, a)
        else:
            a = torch.ops.bench_llama.attention(q, k, v)
        x = x + self.o(a.reshape(t, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Stack(nn.Module):
    """Llama-style layers over flattened tokens: hidden states [T, dim] -> [T, dim]."""

    def __init__(self, layers: int, dim: int, heads: int, hidden: int, max_tokens: int,
                 out_variant: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim, heads, hidden, out_variant) for _ in range(layers))
        hd = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(max_tokens).float(), inv)
        self.register_buffer("cos", freqs.cos()[:, None, :], persistent=False)
        self.register_buffer("sin", freqs.sin()[:, None, :], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def bench(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median over ``repeats`` rounds of do_bench's median (µs); CPU: wall clock medians."""
    if device == "cuda":
        from triton.testing import do_bench

        return statistics.median(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
                                 for _ in range(repeats))
    for _ in range(3):
        fn()
    times = []
    for _ in range(10 * repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def kernel_profile(fn: Callable[[], Any], calls: int = 10) -> dict[str, Any]:
    """Kernels per call of ``fn`` and the GPU µs of each kernel name per call (torch.profiler over
    ``calls`` calls; the L2 is not flushed between them, unlike ``bench``'s timing)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: Counter[str] = Counter()
    count = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count += 1
            times[e.name] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    return {"kernels_per_call": count / calls, "kernel_us_per_call": round(sum(times.values()) / calls, 1),
            "us_by_name_per_call": {n[:120]: round(t / calls, 1) for n, t in times.most_common(25)}}


def measure_ceilings(device: str) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, measured here."""
    if device != "cuda":
        return {"copy_bytes_per_s": float("nan"), "matmul_flops_per_s": float("nan")}
    from triton.testing import do_bench

    src = torch.randn(2**28, device=device, dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    bw = 2 * src.numel() * src.element_size() / (ms * 1e-3)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": 2 * 8192**3 / (ms * 1e-3)}


def roofline_us(model: Stack, tokens: int, dim: int, ceilings: dict[str, float]) -> float:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    act = 4 * tokens * dim * 2 * len(model.layers) * 2  # a few [T, dim] reads/writes per layer
    params = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    flops = 2 * tokens * params + len(model.layers) * 2 * tokens * tokens * dim  # + causal attention
    return max((weights + act) / ceilings["copy_bytes_per_s"], flops / ceilings["matmul_flops_per_s"]) * 1e6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small model and sizes (a CPU smoke test)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--autotune-tokens", default=None,
                    help="token counts for the max-autotune contenders (default: all)")
    ap.add_argument("--contenders", default="all", help="comma list to run a subset")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help="also profile each contender at each size (torch.profiler over 10 forwards): kernels per "
                         "forward and each kernel name's GPU µs per forward, into results.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dim, heads, hidden = (4096, 32, 11008) if not args.tiny else (64, 4, 128)
    tokens = [int(t) for t in args.tokens.split(",")] if not args.tiny else [1, 2, 4, 8, 16]
    at_tokens = [int(t) for t in args.autotune_tokens.split(",")] if args.autotune_tokens else tokens
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    torch.manual_seed(0)
    model = Stack(args.layers, dim, heads, hidden, max(tokens)).to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    inputs = {t: torch.randn(t, dim, device=device, dtype=dtype) for t in tokens}
    ceilings = measure_ceilings(device)
    env = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "model": {"layers": args.layers, "dim": dim, "heads": heads, "mlp": hidden, "dtype": str(dtype)},
        "ceilings": ceilings,
        "timing": f"triton do_bench median (warmup 25 ms, rep 100 ms), median of {args.repeats} rounds",
    }
    print(json.dumps(env, indent=1), flush=True)

    with torch.no_grad():
        refs = {t: model(x) for t, x in inputs.items()}
    results: dict[str, dict[str, Any]] = {}
    wanted = None if args.contenders == "all" else set(args.contenders.split(","))

    def run(name: str, make: Callable[[], Callable[[torch.Tensor], torch.Tensor]], sizes: list[int]) -> None:
        if wanted is not None and name not in wanted:
            return
        row: dict[str, Any] = {"us": {}, "err": {}, "compile_s": 0.0}
        results[name] = row
        try:
            t0 = time.perf_counter()
            fn = make()
            row["compile_s"] += time.perf_counter() - t0
            for t in sizes:
                x = inputs[t]
                with torch.no_grad():
                    t0 = time.perf_counter()
                    y = fn(x)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    row["compile_s"] += time.perf_counter() - t0  # first call at a size: trace/compile/capture
                    row["err"][t] = rel_err(y, refs[t])
                    row["us"][t] = bench(lambda: fn(x), device, args.repeats)
                    if args.profile and device == "cuda":
                        try:
                            row.setdefault("profile", {})[t] = kernel_profile(lambda: fn(x))
                        except Exception as e:  # noqa: BLE001 - the timing stands without it
                            row["profile"][t] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(f"{name:28s} T={t:5d} {row['us'][t]:10.1f} us  err {row['err'][t]:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a contender's failure is a result, recorded
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(f"{name}: FAILED {row['error']}", flush=True)
            traceback.print_exc(limit=3)
        torch._dynamo.reset()
        from shapewise.library.kernels.gemv import GLU_DECISIONS  # DecodeGemv(glu=True)'s timings, per shape
        env["glu_decisions"] = GLU_DECISIONS
        # Written after every contender, so a run cut short still leaves its results.
        (out / "results.json").write_text(json.dumps({"env": env, "tokens": tokens, "results": results}, indent=1))

    def nograd(f):
        def g(x):
            with torch.no_grad():
                return f(x)
        return g

    run("eager", lambda: nograd(model), tokens)
    run("compile dynamic=True", lambda: nograd(torch.compile(model, dynamic=True)), tokens)
    run("compile dynamic=False", lambda: nograd(torch.compile(model, dynamic=False)), tokens)
    if device == "cuda":
        run("reduce-overhead", lambda: nograd(torch.compile(model, mode="reduce-overhead")), tokens)
    run("max-autotune-no-cudagraphs", lambda: nograd(torch.compile(model, mode="max-autotune-no-cudagraphs",
                                                                   dynamic=False)), at_tokens)

    def specialize_on():
        compiled = torch.compile(model, dynamic=False)

        def f(x):
            torch._dynamo.mark_dynamic(x, 0, specialize_on=[lambda s, t=t: s == t for t in tokens])
            with torch.no_grad():
                return compiled(x)
        return f

    run("mark_dynamic specialize_on", specialize_on, tokens)

    def shapewise(**kw):
        def make():
            return nograd(sw.compile(model, sizes=sorted(set(kw.pop("sizes", tokens))), splitting_ops=[ATTN],
                                     backend="inductor", **kw))
        return make

    run("shapewise static", shapewise(), tokens)
    run("shapewise static+max_autotune", shapewise(sizes=at_tokens, static_options={"max_autotune": True}), at_tokens)
    if device == "cuda":
        run("shapewise static+cudagraphs", shapewise(cudagraphs=True), tokens)
        run("shapewise static+full cudagraph", shapewise(cudagraphs="full"), tokens)
        run("shapewise full_and_piecewise (startup capture)",
            shapewise(cudagraphs={"mode": "full_and_piecewise", "capture": "startup"}), tokens)
        gemv = [sw.library.DecodeGemv(max_tokens=16)]
        run("shapewise full cudagraph+DecodeGemv", shapewise(cudagraphs="full", graph_passes=gemv), tokens)
        run("shapewise full_and_piecewise+DecodeGemv",
            shapewise(cudagraphs={"mode": "full_and_piecewise", "capture": "startup"}, graph_passes=gemv), tokens)
        # Programmatic dependent launch: Inductor's kernels, and the GEMVs (up to 64 rows) prefetching their weights
        pdl = {"triton.enable_pdl": True}
        run("shapewise full cudagraph+PDL", shapewise(cudagraphs="full", static_options=pdl), tokens)
        run("shapewise full cudagraph+DecodeGemv64+PDL",
            shapewise(cudagraphs="full", static_options=pdl,
                      graph_passes=[sw.library.DecodeGemv(max_tokens=64, pdl=True)]), tokens)
        run("shapewise full cudagraph+DecodeGemv64",
            shapewise(cudagraphs="full", graph_passes=[sw.library.DecodeGemv(max_tokens=64)]), tokens)
        # the RMSNorm before and the residual add after each GEMV in its kernel (DecodeGemv(norm=True)), at every
        # row count up to 64 (norm_rows=64; the default, 1, fuses at one token only: at 16 and 64 this was
        # slower on an H100, benchmarks/results/norm_h100_20261207, run before norm_rows existed)
        run("shapewise full cudagraph+DecodeGemv64+norm",
            shapewise(cudagraphs="full",
                      graph_passes=[sw.library.DecodeGemv(max_tokens=64, norm=True, norm_rows=64)]), tokens)
        run("shapewise full cudagraph+DecodeGemv+GLU",
            shapewise(cudagraphs="full", graph_passes=[sw.library.DecodeGemv(max_tokens=16, glu=True)]), tokens)
        run("shapewise full cudagraph+DecodeGemv64+GLU",
            shapewise(cudagraphs="full", graph_passes=[sw.library.DecodeGemv(max_tokens=64, glu=True)]), tokens)
        run("shapewise static+max_autotune+cudagraphs",
            shapewise(sizes=at_tokens, static_options={"max_autotune": True}, cudagraphs=True), at_tokens)

    for row in results.values():
        row["roofline_us"] = {t: roofline_us(model, t, dim, ceilings) for t in tokens} if device == "cuda" else {}
    (out / "results.json").write_text(json.dumps({"env": env, "tokens": tokens, "results": results}, indent=1))
    table = markdown(env, tokens, results, model, dim, ceilings, device)
    (out / "results.md").write_text(table)
    print(table)
    return 0


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def markdown(env, tokens, results, model, dim, ceilings, device) -> str:
    names = list(results)
    lines = [f"# Llama-style stack: {env['model']} on {env['device']}",
             f"torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}, {env['date']}. {env['timing']}.",
             "", "Median µs per forward of the whole stack (per layer: divide by "
             f"{env['model']['layers']}); relative error vs eager in results.json.", ""]
    head = ["tokens", *names] + (["roofline floor"] if device == "cuda" else [])
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for t in tokens:
        cells = [str(t)]
        for n in names:
            r = results[n]
            cells.append(f"{r['us'][t]:.0f}" if t in r["us"] else ("failed" if "error" in r else "—"))
        if device == "cuda":
            cells.append(f"{roofline_us(model, t, dim, ceilings):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| contender | compile + first-call seconds (all sizes) | max rel. error | error |",
              "|---|---|---|---|"]
    for n in names:
        r = results[n]
        worst = max(r["err"].values()) if r["err"] else math.nan
        lines.append(f"| {n} | {r['compile_s']:.1f} | {worst:.1e} | {r.get('error', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(min(16, os.cpu_count() or 1)))
    raise SystemExit(main())
