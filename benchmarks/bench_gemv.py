"""Decode GEMV on one GPU: cuBLAS (``F.linear``) against ``shapewise::gemv`` (the Triton kernel
``sw.library.DecodeGemv`` puts in graphs), with and without programmatic dependent launch
(``pdl=True``: each call starts while the one ahead ends, prefetching its weight), at 1-16 rows,
on the weight shapes of a 7B Llama
(``--shapes 1b,8b``: the fused shapes of Llama-3.2-1B and Llama-3.1-8B; ``--all-configs``: every tiling
timed in the graphs too, to check the tuner's choice; ``--chain 16``: also a chain of that many layers of the
shapes, each call reading the one before's output, as in a decode step).

Per (weight [N, K], rows M): both contenders are checked against a float64 reference on fresh
random inputs, then timed as CUDA-graph replays of one call per weight copy, over enough copies
that the weights never sit in L2 (each call reads its weight from HBM, as a decode step does).
µs per call: the replay time over the calls in it, median of ``--repeats`` rounds. Bandwidth:
the bytes each call must move (weight + x + y) over that time, against the measured copy
bandwidth (a 1 GiB device-to-device copy, bytes read + written).

    PYTHONPATH=. python3 benchmarks/bench_gemv.py --out /tmp/gemv
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import cuda_median_us  # noqa: E402

from shapewise.library.kernels.gemv import _launch, gemv_config, gemv_configs, row_tile  # noqa: E402

# [N, K] per model, a layer's order: fused qkv, o, fused gate_up, down (issue 28's fused shapes for 1b and 8b)
SHAPES = {"7b": [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)],
          "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
          "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]}


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def time_calls(fn, xs, ws, repeats: int, replays: int = 20) -> float:
    """µs per call: a CUDA graph of one call per weight copy, replayed; median over rounds."""
    for x, w in zip(xs, ws):
        fn(x, w)  # warm-up: tuning and compilation stay out of the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(xs, ws):
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()

    def replay_round() -> None:
        for _ in range(replays):
            graph.replay()

    return cuda_median_us(replay_round, repeats, replays * len(ws))


def time_chain(shapes, layers: int, rows: int, repeats: int, bw: float) -> list[dict]:
    """A decode step's GEMVs: ``layers`` layers of ``shapes`` (qkv, o, gate_up, down order: each
    call's input is the leading K columns of the output ahead, a strided view, as a fused
    projection's split gives), distinct weights (past L2), in one CUDA graph. Contenders: cuBLAS,
    the kernel at each weight's tuned config (``gemv_config(linear=False)``), the same with PDL
    (the weight's first part prefetched while the call ahead runs). µs per layer, of the floor."""
    dtype = torch.bfloat16
    order = shapes
    ws = [[torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for n, k in order] for _ in range(layers)]
    x0 = torch.randn(rows, order[0][1], device="cuda", dtype=dtype)
    cfgs = [gemv_config(torch.randn(rows, k, device="cuda", dtype=dtype), w, linear=False)
            for (n, k), w in zip(order, ws[0])]
    per_layer = sum((n * k + rows * (n + k)) * 2 for n, k in order)

    def step(call):
        y = x0
        for layer in ws:
            for (_, k), w, cfg in zip(order, layer, cfgs):
                y = call(y[:, :k], w, cfg)
        return y

    contenders = {"cublas": lambda x, w, cfg: F.linear(x, w),
                  "kernel": lambda x, w, cfg: _launch(x, w, None, cfg),
                  "kernel_pdl": lambda x, w, cfg: _launch(x, w, None, cfg, pdl=True)}
    ref = step(lambda x, w, cfg: F.linear(x.float(), w.float()).to(dtype))
    out = []
    for name, call in contenders.items():
        got = step(call)
        err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(call)
        graph.replay()
        torch.cuda.synchronize()
        us = cuda_median_us(lambda: [graph.replay() for _ in range(5)], repeats, 5 * layers)
        row = {"chain": name, "rows": rows, "layers": layers, "us_per_layer": us, "bytes_per_layer": per_layer,
               "of_floor": per_layer / (us * 1e-6) / bw, "rel_err_vs_fp32": err,
               "configs": [str(c) for c in cfgs]}
        print(f"[chain {rows} row(s), {layers} layers of {order}] {name}: {us:.2f} us/layer "
              f"({row['of_floor']:.0%} of the floor), err {err:.1e}", flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default="7b", help="weight shapes: " + ", ".join(SHAPES) + " (comma-separated)")
    ap.add_argument("--all-configs", action="store_true",
                    help="also time every kernel config in the graphs (the best one, against the tuner's choice)")
    ap.add_argument("--chain", type=int, default=0, help="also time a chain of this many layers of the shapes")
    ap.add_argument("--chain-rows", default="1", help="rows of the chain (comma-separated)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [int(r) for r in args.rows.split(",")]
    dtype = torch.bfloat16
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    import triton

    env = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "l2_bytes": props.L2_cache_size,
           "sms": props.multi_processor_count, "copy_bytes_per_s": bw, "dtype": str(dtype),
           "timing": f"CUDA-graph replays of one call per weight copy (weights > 4x L2), median of {args.repeats}"}
    print(json.dumps(env), flush=True)
    results = []
    torch.manual_seed(0)
    gemv = torch.ops.shapewise.gemv.default
    shapes = [shape for name in args.shapes.split(",") for shape in SHAPES[name]]
    chains = []
    for name in args.shapes.split(",") if args.chain else ():
        for r in (int(r) for r in args.chain_rows.split(",")):
            chains += [{"model": name, **row} for row in time_chain(SHAPES[name], args.chain, r, args.repeats, bw)]
            torch.cuda.empty_cache()
            (out / "results.json").write_text(json.dumps({"env": env, "chains": chains, "results": results}, indent=1))
    for n, k in shapes:
        copies = max(2, -(-4 * props.L2_cache_size // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
        for m in rows:
            xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(copies)]
            ref = F.linear(xs[0].double(), ws[0].double())
            nbytes = (n * k + m * k + m * n) * 2
            row = {"N": n, "K": k, "M": m, "bytes": nbytes, "weight_copies": copies}
            for name, fn in (("cublas", lambda x, w: F.linear(x, w)), ("shapewise_gemv", lambda x, w: gemv(x, w)),
                             ("shapewise_gemv_pdl", lambda x, w: gemv(x, w, None, True))):
                fresh = fn(xs[0], ws[0])
                row[f"{name}_err"] = ((fresh.double() - ref).norm() / ref.norm()).item()
                us = time_calls(fn, xs, ws, args.repeats)
                row[f"{name}_us"] = us
                row[f"{name}_bw_frac"] = nbytes / (us * 1e-6) / bw
            cfg = gemv_config(xs[0], ws[0])
            row["config"] = str(cfg) if cfg is not None else "F.linear (faster at tuning)"
            if args.all_configs:
                timed = {}
                for c in gemv_configs(n, k, props.multi_processor_count, row_tile(m)):
                    try:
                        timed[str(c)] = time_calls(lambda x, w, c=c: _launch(x, w, None, c), xs, ws, args.repeats)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
                        print(f"  {c}: {type(e).__name__}: {e}", flush=True)
                best = min(timed, key=timed.get)
                row.update(best_in_graph_config=best, best_in_graph_us=timed[best], configs_in_graph_us=timed)
                print(f"  best config in the graphs: {best} {timed[best]:.2f} us", flush=True)
            results.append(row)
            print(f"[{n}x{k}] M={m:2d}  cuBLAS {row['cublas_us']:7.2f} us ({row['cublas_bw_frac']:.0%})  "
                  f"gemv {row['shapewise_gemv_us']:7.2f} us ({row['shapewise_gemv_bw_frac']:.0%}) "
                  f"gemv+pdl {row['shapewise_gemv_pdl_us']:7.2f} us ({row['shapewise_gemv_pdl_bw_frac']:.0%}) "
                  f"err {row['shapewise_gemv_err']:.1e} cfg {row['config']}", flush=True)
            (out / "results.json").write_text(json.dumps({"env": env, "chains": chains, "results": results}, indent=1))
        del ws
        torch.cuda.empty_cache()
    lines = [f"# Decode GEMV, bf16, on {env['device']}", "",
             f"torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}, {env['date']}. {env['timing']}.",
             f"Measured copy bandwidth {bw / 1e12:.2f} TB/s (read + write). % = bytes moved / time / copy bandwidth.",
             "", "| weight N x K | rows | cuBLAS µs | cuBLAS % | shapewise gemv µs | gemv % | speed-up "
             "| gemv+PDL µs | gemv+PDL % | gemv rel. err | config | best config in graphs | its µs |",
             "|---" * 13 + "|"]
    for r in results:
        best = f"{r['best_in_graph_config']} | {r['best_in_graph_us']:.2f}" if "best_in_graph_us" in r else "- | -"
        lines.append(f"| {r['N']}x{r['K']} | {r['M']} | {r['cublas_us']:.2f} | {r['cublas_bw_frac']:.0%} | "
                     f"{r['shapewise_gemv_us']:.2f} | {r['shapewise_gemv_bw_frac']:.0%} | "
                     f"{r['cublas_us'] / r['shapewise_gemv_us']:.2f}x | {r['shapewise_gemv_pdl_us']:.2f} | "
                     f"{r['shapewise_gemv_pdl_bw_frac']:.0%} | {r['shapewise_gemv_err']:.1e} | "
                     f"{r['config']} | {best} |")
    if chains:
        lines += ["", "Chains: a decode step's GEMVs (qkv, o, gate_up, down a layer, each reading the output ahead), "
                  "one CUDA graph; the kernel at each weight's tuned config.", "",
                  "| model | rows | layers | contender | µs/layer | of the floor | rel. err vs fp32 | configs |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {c['model']} | {c['rows']} | {c['layers']} | {c['chain']} | {c['us_per_layer']:.2f} | "
                  f"{c['of_floor']:.0%} | {c['rel_err_vs_fp32']:.1e} | {', '.join(c['configs'])} |" for c in chains]
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
