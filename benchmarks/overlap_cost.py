"""What OverlapAllReduce's row slices cost where there is nothing to overlap: one GPU, a one-rank
NCCL group (its all-reduces are local), TPLlama built with world=2 (one rank's shapes of the
Llama-7B stack: the model bench_tp runs at TP=2). shapewise full CUDA graphs with and without the
pass, per-forward time (CUDA events around graph replays, median), and the answers against eager.

    PYTHONPATH=. python benchmarks/overlap_cost.py --out benchmarks/results/overlap_h200

On two GPUs the same slices buy the overlap; this measures only their price (more, smaller
kernels and matmuls, the cats at the piece's end)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import cuda_median_us  # noqa: E402

import shapewise as sw  # noqa: E402
from shapewise.models import ATTENTION_OP, TPLlama  # noqa: E402


def time_forward(fn, x, rounds: int = 5, iters: int = 20) -> float:
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()

    def forwards() -> None:
        for _ in range(iters):
            fn(x)

    return cuda_median_us(forwards, rounds, iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="512,1024,2048,4096")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunks", default="4", help="comma list: one sliced contender per value")
    ap.add_argument("--profile", action="store_true", help="print each contender's top kernels at the largest size")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(),
                            device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    with torch.device("cuda"):
        model = TPLlama(args.layers, 4096, 32, 11008, 32000, world=2).to(torch.bfloat16).eval()
    ids = {n: torch.randint(0, 16000, (n,), device="cuda") for n in tokens}
    refs = {n: model(x) for n, x in ids.items()}
    rows = {}
    contenders = [("plain", [])] + [(f"sliced{c}", [sw.library.OverlapAllReduce(chunks=int(c), min_tokens=min(tokens))])
                                    for c in args.chunks.split(",")]
    for label, passes in contenders:
        torch._dynamo.reset()
        fast = sw.compile(model, sizes=tokens, splitting_ops=[ATTENTION_OP], cudagraphs="full", progress=False,
                          graph_passes=passes)
        for n, x in ids.items():
            y = fast(x)
            err = float((y.float() - refs[n].float()).norm() / refs[n].float().norm())
            us = time_forward(fast, x)
            rows.setdefault(n, {})[label] = {"us": us, "rel_err_vs_eager": err}
            print(f"{label:8s} T={n:5d} {us:9.1f} us  rel err {err:.1e}", flush=True)
        if args.profile:
            x = ids[max(tokens)]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fast(x)
                torch.cuda.synchronize()
            print(f"--- {label} at {max(tokens)} tokens, 5 forwards")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        del fast
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
              "chunks": args.chunks.split(","),
              "model": "TPLlama(dim 4096, hidden 11008, 32 heads, vocab 32000, world=2 shapes)",
              "timing": "CUDA events around 20 graph replays x 5 rounds after 5 warm-up calls; median",
              "per_tokens": rows}
    (out / "cost.json").write_text(json.dumps(result, indent=1))
    names = [label for label, _ in contenders]
    lines = [f"# OverlapAllReduce's cost on one {result['gpu']} (one-rank NCCL group: nothing to overlap)", "",
             "µs per forward (ratio to plain); worst relative error against eager over the contenders.", "",
             "| tokens | " + " | ".join(names) + " | rel err |", "|---" * (len(names) + 2) + "|"]
    for n, r in rows.items():
        cells = [f"{r[k]['us']:.0f} ({r[k]['us'] / r['plain']['us']:.3f})" for k in names]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {max(r[k]['rel_err_vs_eager'] for k in names):.1e} |")
    (out / "cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
