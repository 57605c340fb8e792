"""Device diagnostic: the host cost of one CUDA-graph replay of a ~300-kernel graph, captured as
shapewise captures (``torch.cuda.graph(g, pool=...)``) and as Inductor's cudagraph trees do
(``torch.compile(mode="reduce-overhead")``), to tell why bench_decode's host profile shows
``CUDAGraph.replay`` at 280 µs own time a step for shapewise against 140 µs for transformers'
recipe. Host µs per call with the GPU idle before each (synchronised), median of 200.

    PYTHONPATH=. python3 benchmarks/device/replay_cost.py --out $OUT/replay.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def host_us(fn, n: int = 200) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return round(1e6 * statistics.median(samples), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", type=int, default=300)
    args = ap.parse_args()
    ws = [torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) / 8 for _ in range(args.kernels)]
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        for w in ws:
            x = x @ w  # an extern mm each: no fusion
        return x

    rows = {"eager": host_us(lambda: chain(x))}
    compiled = torch.compile(chain)
    compiled(x)
    for mode in ("global", "thread_local", "relaxed"):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            compiled(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle(), capture_error_mode=mode):
            compiled(x)
        rows[f"replay_{mode}"] = host_us(g.replay)
        side = torch.cuda.Stream()
        def on_side():
            with torch.cuda.stream(side):
                g.replay()
        rows[f"replay_{mode}_side_stream"] = host_us(on_side)
    torch._dynamo.reset()
    trees = torch.compile(chain, mode="reduce-overhead")
    for _ in range(3):
        trees(x)
    rows["reduce_overhead_call"] = host_us(lambda: trees(x))
    import cProfile
    import pstats
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
        compiled(x)
    prof = cProfile.Profile()
    for _ in range(100):
        torch.cuda.synchronize()
        prof.enable()
        g.replay()
        prof.disable()
    st = pstats.Stats(prof)
    own = sum(v[2] for k, v in st.stats.items() if k[2] == "replay")
    rows["replay_own_us_under_cprofile"] = round(1e6 * own / 100, 1)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": args.kernels, "host_us": rows}
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
