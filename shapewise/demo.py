"""The main job: the built-in toy transformer through the pipeline, on CPU.

Prints the split, the dispatch table, the compile report and a small timing table
(eager vs torch.compile(dynamic=True) vs shapewise), checking every answer against eager.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import shapewise as sw
from shapewise.ir import text_table
from shapewise.models import ATTENTION_OP, ToyTransformer

__all__ = ["main", "median_us"]


def median_us(fn: Callable[[], Any], warmup: int = 5, repeat: int = 30) -> float:
    """Median wall time of ``fn()`` in microseconds, after ``warmup`` calls (CPU: no sync needed)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="shapewise demo", description=__doc__)
    parser.add_argument("--backend", default="inductor", help="inductor | aot_eager | eager (default inductor)")
    parser.add_argument("--sizes", default="1,2,4,8,16", help="static sizes (default 1,2,4,8,16)")
    parser.add_argument("--range", default="17,256", help="one dynamic range low,high (default 17,256)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-timing", action="store_true", help="skip the timing table")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    lo, hi = (int(s) for s in args.range.split(","))

    torch.manual_seed(0)
    model = ToyTransformer(layers=args.layers, dim=64, heads=4, hidden=128, vocab=256).eval()
    print(f"shapewise {sw.__version__} | torch {torch.__version__} | CPU threads {torch.get_num_threads()}")
    print(f"model: ToyTransformer(layers={args.layers}), attention = {ATTENTION_OP} (the splitting op)\n")

    t0 = time.perf_counter()
    fast = sw.compile(model, sizes=sizes, ranges=[(lo, hi)], splitting_ops=[ATTENTION_OP], backend=args.backend)
    check_sizes = sorted({*sizes, lo, (lo + hi) // 2, hi})
    with torch.no_grad():
        fast(torch.randint(0, 256, (sizes[0],)))
        compile_s = time.perf_counter() - t0
        worst = 0.0
        for n in check_sizes:
            ids = torch.randint(0, 256, (n,))
            err = (fast(ids) - model(ids)).abs().max().item()
            worst = max(worst, err)
            if err > 1e-3:
                raise SystemExit(f"shapewise disagrees with eager at size {n}: max abs error {err:.3g}")
    program = fast.program
    print("== split ==")
    for p in program.pieces:
        ops = sum(1 for n in p.gm.graph.nodes if n.op in ("call_function", "call_method"))
        kind = "splitting op (runs as is)" if p.is_splitting else "compiled"
        print(f"  {p.name}: {ops:3d} ops, {kind}")
    print("\n== dispatch plan ==")
    print(text_table(program.dispatch.rows(), ["kind", "key", "runs"]))
    print(f"\n== compile report ({len(fast.report())} variants, {compile_s:.1f} s wall incl. trace) ==")
    rows = [{**r, "seconds": f"{r['seconds']:.2f}"} for r in fast.report()]
    print(text_table(rows, ["piece", "key", "static", "seconds", "source", "backend"]))
    print(f"\nchecked against eager at sizes {check_sizes}: max abs error {worst:.2e}")
    print(f"Dynamo traces: {fast.traces}")

    if not args.no_timing:
        dyn = torch.compile(model, dynamic=True, backend=args.backend if args.backend != "inductor" else "inductor")
        timing = []
        with torch.no_grad():
            for n in [s for s in (1, 8, 16, (lo + hi) // 2) if s in sizes or lo <= s <= hi]:
                ids = torch.randint(0, 256, (n,))
                ref = model(ids)
                torch.testing.assert_close(dyn(ids), ref, rtol=1e-3, atol=1e-3)
                timing.append({
                    "tokens": n,
                    "variant": "static" if n in sizes else f"range {lo}..{hi}",
                    "eager µs": f"{median_us(lambda: model(ids)):.0f}",
                    "torch.compile dynamic=True µs": f"{median_us(lambda: dyn(ids)):.0f}",
                    "shapewise µs": f"{median_us(lambda: fast(ids)):.0f}",
                })
        print("\n== timing (CPU, median of 30 calls after 5 warm-up) ==")
        print(text_table(timing, list(timing[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
