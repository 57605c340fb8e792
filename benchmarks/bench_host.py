"""Host time per call on a small model, every contender side by side in one run, and where
shapewise's per-call time goes.

The model is bench_llama's Llama-style stack (custom attention op, RMSNorm, rotary, SwiGLU) with
tiny kernels, so the wall time of a call is the Python and launch path around them (on a GPU the
calls are queued back to back and the device is synchronized once per round: the round's wall
time over its calls is the host time while the GPU keeps up). Contenders: eager;
torch.compile(dynamic=False); shapewise static (sw.compile, the same sizes compiled static); on a
GPU also mode="reduce-overhead" and shapewise with CUDA graphs (full and piecewise). Rounds
interleave the contenders; each number is the median (and min) over rounds of the per-call time.

The breakdown times shapewise's layers on the arguments Dynamo hands it: the whole call
(Dynamo's guards + the runnable), the runnable alone (key + lookup + runner), the generated
runner alone, and each compiled piece alone; what the runner adds over its pieces is Python.

    python benchmarks/bench_host.py --device cpu --out benchmarks/results/host_cpu
    PYTHONPATH=. python3 benchmarks/bench_host.py --device cuda --out $OUT/host_h200
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llama import ATTN, Stack  # noqa: E402

import shapewise as sw  # noqa: E402
from shapewise.ir import make_runner  # noqa: E402


def per_call_us(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def capture_runnable_args(fast: sw.compile, x: torch.Tensor) -> tuple[Any, tuple]:
    """The runnable of ``fast`` and the arguments Dynamo passes it for a call at ``x``."""
    runnable = fast.runnable
    seen: list[tuple] = []
    real = runnable.__class__.__call__

    def spy(self, *args):
        seen.append(args)
        return real(self, *args)

    runnable.__class__.__call__ = spy
    try:
        fast(x)
    finally:
        runnable.__class__.__call__ = real
    return runnable, seen[-1]


def breakdown(fast: Any, x: torch.Tensor, calls: int, rounds: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median per-call µs of each layer of a shapewise call (see the module docstring)."""
    runnable, args = capture_runnable_args(fast, x)
    key = runnable._key(args)
    runner = runnable._exact[key]
    program = runnable.program
    binding = next(b for b in program.bindings if b.key == key)
    callables = program.callables(binding)
    piece_args: dict[str, tuple] = {}

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any) -> Any:
            piece_args[name] = a
            return fn(*a)
        return call

    make_runner(program.graph, {n: spy(n, f) for n, f in callables.items()})(*args)
    probes: dict[str, Callable[[], Any]] = {
        "call (Dynamo + runnable)": lambda: fast(x),
        "runnable (key + lookup + runner)": lambda: runnable(*args),
        "runner (generated, pieces in order)": lambda: runner(*args),
        "key (read sizes)": lambda: runnable._key(args),
        "dispatch (key + lookup, no runner)": lambda: runnable._exact.get(runnable._key(args)),
    }
    seq = [(callables[p.name], piece_args[p.name]) for p in program.pieces]

    def pieces_in_order() -> None:
        for f, a in seq:
            f(*a)

    # Each piece alone is cache-hot (the same inputs every call): their sum understates the chain.
    probes["pieces in order, no runner"] = pieces_in_order
    for p in program.pieces:
        probes[f"{p.name}{' (splitting op)' if p.is_splitting else ''} alone"] = \
            (lambda f=callables[p.name], a=piece_args[p.name]: f(*a))
    times: dict[str, list[float]] = {k: [] for k in probes}
    for _ in range(rounds):
        for name, fn in probes.items():
            times[name].append(per_call_us(fn, calls, sync))
    out = {k: statistics.median(v) for k, v in times.items()}
    out["lean pieces"] = sum(1 for p in program.compute_pieces if (v := p.variant_for(binding)) is not None
                             and v.report.get("lean"))
    out["compiled pieces"] = len(program.compute_pieces)
    return out


def host_us(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    """Host µs per call: the clock stops before the device is waited for (a graph replay's
    launch, not the kernels it queues)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / calls * 1e6


def piecewise_breakdown(fast: Any, x: torch.Tensor, calls: int, rounds: int,
                        sync: Callable[[], None]) -> dict[str, float]:
    """Where a piecewise-CUDA-graph call's host time goes (median host µs per call): the whole
    call, the runner, then per piece its graphed call, and the floor under it: the graph's
    replay alone, the copies into its static inputs alone, each splitting op's call alone. What
    the pieces' sum leaves of the runner, and the runner of the call, is shapewise's Python."""
    from shapewise.dispatch.copies import clone_tensors
    from shapewise.dispatch.graphed import GraphedPiece

    runnable, args = capture_runnable_args(fast, x)
    key = runnable._key(args)
    graphs = runnable.runtime.graphs
    (staged,) = [s for s in graphs.staged if s.key == key]  # the caller's tensors copied in once
    runner = staged.run
    statics = dict(staged.slots or ())
    runner_args = tuple(statics.get(i, a) for i, a in enumerate(args))
    program = runnable.program
    pieces = dict(graphs.callables[key])
    piece_args: dict[str, tuple] = {}

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        # A splitting op's output a graph reads in place is kept as a copy: held, it would take
        # the memory the next splitting op of the call reuses (its output would move).
        adopted = {i for i, *_ in getattr(fn, "adopted", ())}

        def call(*a: Any) -> Any:
            piece_args[name] = tuple(t.clone() if i in adopted else t for i, t in enumerate(a))
            return fn(*a)
        return call

    def timed(probes: dict[str, Callable[[], Any]]) -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in probes}
        for _ in range(rounds):
            for name, fn in probes.items():
                times[name].append(host_us(fn, calls, sync))
        return {k: statistics.median(v) for k, v in times.items()}

    # Whole calls first: the pieces' probes below hold a call's splitting-op outputs, whose
    # memory a whole call would then not get back (it would capture its size again, with copies).
    res = timed({"call (direct or Dynamo, runnable, runner, output clone)": lambda: fast(x),
                 "runnable (key + lookup + runner + output clone)": lambda: runnable(*args),
                 "runner (generated, pieces in order)": lambda: runner(*runner_args)})
    out = make_runner(program.graph, {n: spy(n, f) for n, f in pieces.items()})(*runner_args)
    probes: dict[str, Callable[[], Any]] = {"output clone": lambda: clone_tensors(out)}
    floor = ["output clone"]
    if statics:
        inputs = [(static, args[i]) for i, static in statics.items()]
        probes[f"{len(statics)} caller's tensors copied in, alone"] = \
            lambda: [static.copy_(a) for static, a in inputs]
        floor.append(f"{len(statics)} caller's tensors copied in, alone")
    for p in program.pieces:
        f, a = pieces[p.name], piece_args[p.name]
        if isinstance(f, GraphedPiece) and f.graph is not None:
            if not f.adopted:  # (a kept copy is not where the graph reads: its call would capture again)
                probes[f"{p.name}: graphed call"] = lambda f=f, a=a: f(*a)
            replay = f"{p.name}: replay alone" + (f" ({len(f.adopted)} input read in place)" if f.adopted else "")
            probes[replay] = f.graph.replay
            floor.append(replay)
            if f.copy_slots:
                probes[f"{p.name}: {len(f.copy_slots)} static-input copies alone"] = \
                    lambda f=f, a=a: [s.copy_(a[i]) for i, s in f.copy_slots]
                floor.append(f"{p.name}: {len(f.copy_slots)} static-input copies alone")
        else:
            probes[f"{p.name}: {'splitting op' if p.is_splitting else 'uncaptured piece'} alone"] = \
                lambda f=f, a=a: f(*a)
            floor.append(f"{p.name}: {'splitting op' if p.is_splitting else 'uncaptured piece'} alone")
    res.update(timed(probes))
    res["floor: copies, replays, splitting ops, output clone"] = sum(res[k] for k in floor)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--calls", type=int, default=200, help="calls per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-lean", action="store_true", help="also time shapewise with lean=False (the wrapped calls)")
    args = ap.parse_args(argv)
    device = args.device
    tokens = [int(t) for t in args.tokens.split(",")]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Stack(args.layers, args.dim, heads=max(1, args.dim // 64), hidden=args.dim * 2, max_tokens=64)
    model = model.to(device=device, dtype=dtype).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    inputs = {t: torch.randn(t, args.dim, device=device, dtype=dtype) for t in tokens}

    def compiled(**kw: Any) -> Callable[[torch.Tensor], Any]:
        torch._dynamo.reset()
        fns = {t: torch.compile(model, dynamic=False, **kw) for t in tokens}
        return lambda x: fns[x.shape[0]](x)

    def shapewise(**kw: Any) -> Any:
        return sw.compile(model, sizes=tokens, splitting_ops=[ATTN], dynamic_dims={"x": 0}, progress=False,
                          cache=False, **kw)

    contenders: dict[str, Callable[[torch.Tensor], Any]] = {"eager": model}
    contenders["torch.compile dynamic=False"] = compiled()
    fast = shapewise()
    contenders["shapewise static"] = fast
    contenders["shapewise static, direct_call"] = shapewise(direct_call=True)
    if args.no_lean:
        contenders["shapewise static, lean=False"] = shapewise(lean=False)
    if device == "cuda":
        contenders["torch.compile reduce-overhead"] = compiled(mode="reduce-overhead")
        contenders["shapewise cudagraphs=full"] = shapewise(cudagraphs="full")
        contenders["shapewise cudagraphs=piecewise"] = shapewise(cudagraphs="piecewise")
        contenders["shapewise cudagraphs=full, direct_call"] = shapewise(cudagraphs="full", direct_call=True)
        contenders["shapewise cudagraphs=piecewise, direct_call"] = shapewise(cudagraphs="piecewise",
                                                                            direct_call=True)
        # The same, with the attention outputs copied into static buffers (split_pools=False).
        contenders["shapewise piecewise, copies, direct_call"] = shapewise(
            cudagraphs={"mode": "piecewise", "split_pools": False}, direct_call=True)
        # The same weights, attention writing into a buffer the graph before it allocates (no copy
        # of its output into the next graph's static input).
        out_model = Stack(args.layers, args.dim, heads=max(1, args.dim // 64), hidden=args.dim * 2, max_tokens=64,
                          out_variant=True).to(device=device, dtype=dtype).eval()
        out_model.load_state_dict(model.state_dict())
        for suffix, direct in (("", False), (", direct_call", True)):
            contenders["shapewise piecewise, attention with output" + suffix] = sw.compile(
                out_model, sizes=tokens, splitting_ops=[ATTN + "_out"], dynamic_dims={"x": 0}, progress=False,
                cache=False, cudagraphs="piecewise", direct_call=direct)
    errors: dict[str, float] = {}
    with torch.no_grad():
        for name, fn in contenders.items():  # warm-up: compiles, CUDA-graph captures, checks
            for t, x in inputs.items():
                ref = model(x).float()
                for _ in range(3):
                    out = fn(x)
                errors[f"{name} @ {t}"] = float((out.float() - ref).norm() / ref.norm())
        times: dict[str, dict[int, list[float]]] = {n: {t: [] for t in tokens} for n in contenders}
        for _ in range(args.rounds):
            for t, x in inputs.items():
                for name, fn in contenders.items():
                    times[name][t].append(per_call_us(lambda fn=fn, x=x: fn(x), args.calls, sync))
        parts = {t: breakdown(fast, x, args.calls, args.rounds, sync) for t, x in inputs.items()}
        pw_name = "shapewise cudagraphs=piecewise, direct_call"
        pw_parts = ({t: piecewise_breakdown(contenders[pw_name], x, args.calls, args.rounds, sync)
                     for t, x in inputs.items()} if pw_name in contenders else {})
    copies = {}  # per CUDA-graph contender and size: inputs copied into static buffers per call
    for name, fn in contenders.items():
        runnable = getattr(fn, "runnable", None)
        graphs = runnable.runtime.graphs if runnable is not None else None
        if graphs is not None:
            pieces = graphs.pieces
            copies[name] = {t: sum(len(p.copy_slots) for p in pieces if p.key == (t,))
                            + sum(len(s.slots or ()) for s in graphs.staged if s.key == (t,))
                            for t in tokens}
            groups = {id(p.group): p.group for p in pieces if p.group is not None}
            copies[name]["recaptures"] = sum(g.recaptures for g in groups.values())
    direct = {name: {"info": fn.direct_info, "direct_calls": fn.direct_calls, "fell_back": fn.direct_fallbacks}
              for name, fn in contenders.items() if "direct_call" in name}
    base = "torch.compile dynamic=False"
    results = {n: {t: {"median_us": statistics.median(v), "min_us": min(v),
                       "vs_dynamic_false": statistics.median(v) / statistics.median(times[base][t])}
                   for t, v in per.items()} for n, per in times.items()}
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
           "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": f"bench_llama Stack, {args.layers} layers, dim {args.dim}, {dtype}".replace("torch.", ""),
           "calls_per_round": args.calls, "rounds": args.rounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"env": env, "results": results, "breakdown": parts,
                                                  "piecewise_breakdown": pw_parts,
                                                  "copies_per_call": copies, "rel_errors": errors,
                                                  "direct_call": direct},
                                                 indent=2, default=str))
    lines = [f"# Host time per call: {env['model']} on {env['device']} ({device}, torch {env['torch']})", "",
             f"Median (min) µs per call over {args.rounds} interleaved rounds of {args.calls} calls; "
             "ratio = median / torch.compile(dynamic=False)'s.", "",
             "| contender | " + " | ".join(f"{t} token{'s' if t > 1 else ''}" for t in tokens) + " |",
             "|---|" + "---|" * len(tokens)]
    for name, per in results.items():
        cells = [f"{r['median_us']:.0f} ({r['min_us']:.0f}) {r['vs_dynamic_false']:.2f}x" for r in per.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Where a shapewise static call goes (median µs per call; the last two rows count pieces):", "",
              "| layer | " + " | ".join(str(t) for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
    for k in parts[tokens[0]]:
        lines.append(f"| {k} | " + " | ".join(f"{parts[t][k]:.1f}" for t in tokens) + " |")
    if pw_parts:
        lines += ["", f"Where a call of {pw_name} goes (median host µs per call, the clock stopped before the "
                  "device is waited for; the floor is what no wrapper can take away):", "",
                  "| part | " + " | ".join(str(t) for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
        for k in pw_parts[tokens[0]]:
            lines.append(f"| {k} | " + " | ".join(f"{pw_parts[t][k]:.1f}" for t in tokens) + " |")
    if copies:
        lines += ["", "Inputs copied into CUDA graphs' static buffers per call (the caller's input, splitting-op "
                  "outputs), and sizes captured again because a splitting op's output moved (after the breakdown):", ""]
        lines += [f"- {name}: " + ", ".join(f"{c} at {t}" if t != "recaptures" else f"sizes captured again: {c}"
                                             for t, c in per.items()) for name, per in copies.items()]
    if direct:
        lines += ["", "direct_call contenders (calls served past Dynamo's frame, calls that fell back to it):", ""]
        lines += [f"- {name}: {d['info']}, {d['direct_calls']} direct, {d['fell_back']} fell back"
                  for name, d in direct.items()]
    piecewise = [("shapewise cudagraphs=piecewise", "shapewise cudagraphs=full"),
                 ("shapewise cudagraphs=piecewise, direct_call", "shapewise cudagraphs=full, direct_call"),
                 ("shapewise piecewise, copies, direct_call", "shapewise cudagraphs=full, direct_call"),
                 ("shapewise piecewise, attention with output", "shapewise cudagraphs=full"),
                 ("shapewise piecewise, attention with output, direct_call", "shapewise cudagraphs=full, direct_call")]
    if all(a in results and b in results for a, b in piecewise):
        lines += ["", "Piecewise over full graph host time (median): " + "; ".join(
            f"{a.removeprefix('shapewise ').removeprefix('cudagraphs=')}: " + ", ".join(
                f"{results[a][t]['median_us'] / results[b][t]['median_us']:.2f}x at {t}" for t in tokens)
            for a, b in piecewise)]
    worst = max(errors.values())
    lines += ["", f"Largest relative error against eager over all contenders and sizes: {worst:.2e}."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
