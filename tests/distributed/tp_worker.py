"""One tensor-parallel run: ``world`` processes (torch.multiprocessing, gloo on CPU or NCCL on
GPUs) each compile their shard of ``TPLlama`` with ``sw.compile`` and check it against the
single-process eager model at every size; each rank writes ``rank<r>.json`` (its report rows,
its traces, its largest error) to ``--out``.

    python -m tests.distributed.tp_worker --world 2 --cache /tmp/c --out /tmp/o [--layers 3] [--nccl]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES, RANGES, CHECK = [1, 4, 8], [(9, 32)], (1, 4, 8, 9, 20, 32)


def run(rank: int, args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import shapewise as sw
    from shapewise.models import ATTENTION_OP, TPLlama

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    device = torch.device("cuda", rank) if args.nccl else torch.device("cpu")
    if args.nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.nccl else "gloo", rank=rank, world_size=args.world)
    try:
        torch.manual_seed(0)
        full = TPLlama(layers=args.layers).to(device).eval()
        part = TPLlama.shard(full, rank, args.world).to(device).eval()
        splitting = [ATTENTION_OP] + (["_c10d_functional::all_reduce"] if args.split_collectives else [])
        passes = [sw.passes.OverlapAllReduce(chunks=2, min_tokens=8, align=2, min_slice=2)] if args.overlap else []
        fast = sw.compile(part, sizes=SIZES, ranges=RANGES, splitting_ops=splitting, backend=args.backend,
                          cache=args.cache or False, progress=False, graph_passes=passes)
        worst = 0.0
        with torch.no_grad():
            for n in CHECK:
                ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).to(device)
                out, ref = fast(ids), full(ids)
                worst = max(worst, float((out - ref).norm() / ref.norm()))
        rows = [{k: v for k, v in r.items() if k in ("piece", "key", "source", "artifact", "rank", "passes")}
                for r in fast.report()]
        Path(args.out, f"rank{rank}.json").write_text(json.dumps({"rows": rows, "traces": fast.traces,
                                                                   "max_rel_error": worst,
                                                                   "collective_order": collective_order(fast)}))
        dist.barrier()  # no rank tears its group down while the other may still talk to it
    finally:
        dist.destroy_process_group()


def collective_order(fast) -> dict[str, str]:
    """Per chunked (piece, size): the order of all-reduces (R) and waits for them (W) in the code
    Inductor generated (where the artifact carries its source)."""
    from shapewise.instruments import variant_source

    out = {}
    for piece in fast.program.compute_pieces:
        for v in piece.variants:
            if not any("overlap_all_reduce" in label for label in v.pass_labels):
                continue
            reduced, order = set(), []
            for line in (variant_source(v) or "").splitlines():
                line = line.strip()
                if line.startswith("torch.ops._c10d_functional.all_reduce_.default("):
                    reduced.add(line.split("(")[1].split(",")[0])
                    order.append("R")
                elif line.startswith("torch.ops._c10d_functional.wait_tensor.default("):
                    if line.split("(")[1].split(")")[0] in reduced:
                        order.append("W")
            out[f"{piece.name} {v.binding.key}"] = "".join(order)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--cache", default=None, help="a shared cache folder (default: no disk cache)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--layers", type=int, default=2, help="3 or more: the middle layers' pieces reuse one artifact")
    ap.add_argument("--nccl", action="store_true")
    ap.add_argument("--split-collectives", action="store_true", help="split the graph at the all-reduces too")
    ap.add_argument("--overlap", action="store_true", help="sw.passes.OverlapAllReduce at 8 rows (two slices of 4)")
    args = ap.parse_args(argv)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    mp.spawn(run, args=(args,), nprocs=args.world)


if __name__ == "__main__":
    main()
