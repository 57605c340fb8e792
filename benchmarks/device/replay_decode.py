"""Device diagnostic: why one replay of the decode step's CUDA graph costs ~250 µs of host time
(bench_decode's cProfile tables, shapewise and transformers' recipe alike) when a 300-kernel chain
of small matmuls replays in 5 µs (replay_cost.py).

For the Llama-3.2-1B shapes at several layer counts, graphs captured here with
``torch.cuda.CUDAGraph(keep_graph=True)`` so their nodes can be counted by type (CUDA driver
``cuGraphGetNodes`` / ``cuGraphNodeGetType``):
- the eager decode forward on a static cache;
- the Inductor-compiled forward (``torch.compile(fullgraph=True)``, no cudagraphs of its own);
- the decode step's matmuls alone (the layers' weight shapes, cuBLAS);
- the same matmuls on 64x64 weights (replay_cost's case);
and shapewise's own graph (``compile_generate(cudagraphs="full")``). Per graph: host µs of
``replay()`` with the GPU idle before each call (synchronised), and with the GPU busy (a spin kernel
queued first), median of 100.

    PYTHONPATH=. python3 benchmarks/device/replay_decode.py --out $OUT/replay_decode.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import shapewise as sw  # noqa: E402
from benchmarks.bench_decode import Step, make_model  # noqa: E402
from benchmarks.device.host_breakdown import host_us  # noqa: E402

NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child_graph", 5: "empty",
              6: "wait_event", 7: "event_record", 8: "sem_signal", 9: "sem_wait", 10: "mem_alloc",
              11: "mem_free", 12: "batch_mem_op", 13: "conditional"}


def node_types(graph: torch.cuda.CUDAGraph) -> dict[str, int]:
    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    assert cuda.cuGraphGetNodes(handle, None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert cuda.cuGraphGetNodes(handle, nodes, ctypes.byref(n)) == 0
    kinds: Counter[str] = Counter()
    for node in nodes:
        t = ctypes.c_int(0)
        assert cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)) == 0
        kinds[NODE_TYPES.get(t.value, str(t.value))] += 1
    # The edges: a straight line (every node one parent, one child) launches in constant time on
    # CUDA >= 12.6; any other topology costs per node.
    e = ctypes.c_size_t(0)
    v2 = hasattr(cuda, "cuGraphGetEdges_v2")
    get = cuda.cuGraphGetEdges_v2 if v2 else cuda.cuGraphGetEdges
    extra = (None,) if v2 else ()
    assert get(handle, None, None, *extra, ctypes.byref(e)) == 0
    src, dst = (ctypes.c_void_p * e.value)(), (ctypes.c_void_p * e.value)()
    assert get(handle, src, dst, *extra, ctypes.byref(e)) == 0
    outs, ins = Counter(src), Counter(dst)
    kinds["edges"] = e.value
    kinds["forks"] = sum(1 for c in outs.values() if c > 1)
    kinds["joins"] = sum(1 for c in ins.values() if c > 1)
    kinds["roots"] = sum(1 for node in nodes if node not in ins)
    return dict(kinds)


def nothing() -> None:
    pass


def capture(fn, rewind) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            rewind()
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
        fn()
    return g


def graphed(fn, rewind=nothing) -> tuple[torch.cuda.CUDAGraph, object]:
    g = capture(fn, rewind)
    return g, g.replay


def row(name: str, make, rewind=nothing) -> dict:
    """``make()`` gives (graph or None, the call to time)."""
    try:
        graph, replay = make()
    except Exception as e:  # noqa: BLE001 - a diagnostic: say why, go on
        print(name, "failed:", e, flush=True)
        return {"graph": name, "error": f"{type(e).__name__}: {e}"[:500]}
    r = {"graph": name, "idle_us": host_us(replay, rewind, False, "cuda", 100),
         "busy_us": host_us(replay, rewind, True, "cuda", 100)}
    if graph is not None:
        try:
            r["nodes"] = node_types(graph)
        except Exception as e:  # noqa: BLE001 - a diagnostic: say why, go on
            r["nodes"] = f"{type(e).__name__}: {e}"
    print(r, flush=True)
    return r


def matmul_chain(shapes: list[tuple[int, int]], dtype: torch.dtype):
    ws = [torch.randn(k, n, device="cuda", dtype=dtype) / k**0.5 for k, n in shapes]
    xs = {k: torch.randn(1, k, device="cuda", dtype=dtype) for k, _ in shapes}
    return lambda: [xs[w.shape[0]] @ w for w in ws]


def forked_chain(n: int, dtype: torch.dtype):
    """replay_cost's chain of 64x64 matmuls with one kernel forked onto a side stream and joined."""
    ws = [torch.randn(64, 64, device="cuda", dtype=dtype) / 8 for _ in range(n)]
    x = torch.randn(1, 64, device="cuda", dtype=dtype)
    side = torch.cuda.Stream()

    def run():
        y = x
        for i, w in enumerate(ws):
            y = y @ w
            if i == n // 2:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    z = y * 2
                torch.cuda.current_stream().wait_stream(side)
                y = y + z
        return y

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="1,4,16")
    args = ap.parse_args()
    dtype = torch.bfloat16
    rows = []
    rows.append(row("300 matmuls 64x64, straight", lambda: graphed(matmul_chain([(64, 64)] * 300, dtype))))
    rows.append(row("300 matmuls 64x64, one fork", lambda: graphed(forked_chain(300, dtype))))
    for layers in [int(x) for x in args.layers.split(",")]:
        model = make_model("1b", "cuda", dtype, layers)
        ids = torch.randint(0, 1000, (1, 128), device="cuda")
        model.generation_config.cache_implementation = "static"
        model.generation_config.disable_compile = True
        step = Step("eager", model, ids, 16)
        with torch.no_grad():
            back = step.rewind
            rows.append({"layers": layers, **row("eager forward", lambda: graphed(step.call, back), back)})
            compiled = torch.compile(model.forward, fullgraph=True)
            rows.append({"layers": layers, **row("inductor forward",
                                                 lambda: graphed(lambda: compiled(**step.kwargs), back), back)})
        h, m, v = 2048, 8192, 128256
        shapes = [(h, h), (h, 512), (h, 512), (h, h), (h, m), (h, m), (m, h)] * layers + [(h, v)]
        rows.append({"layers": layers, **row(f"{len(shapes)} matmuls, layer shapes",
                                             lambda: graphed(matmul_chain(shapes, dtype)))})
        rows.append({"layers": layers, **row(f"{len(shapes)} matmuls, 64x64",
                                             lambda: graphed(matmul_chain([(64, 64)] * len(shapes), dtype)))})
        torch._dynamo.reset()
        model = make_model("1b", "cuda", dtype, layers)
        fast = sw.compile_generate(model, prompt_sizes=[128], max_length=256, static_cache=True,
                                   backend="inductor", cudagraphs="full", progress=False)
        step = Step("sw_full", model, ids, 16)
        (piece,) = fast.runnables[-1].runtime.graphs.pieces
        back = step.rewind
        rows.append({"layers": layers, **row("shapewise decode graph", lambda: (None, piece.graph.replay), back)})
        rows.append({"layers": layers, **row("shapewise decode step", lambda: (None, step.call), back)})
        model = fast = step = piece = None
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
