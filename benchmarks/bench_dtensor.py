"""What DTensor weights cost a compiled model, and transformers' own tensor parallel compiled.

``--world 1`` (one GPU): a transformers Llama with plain weights against the same weights as
DTensors (torch.distributed.tensor.parallel's colwise / rowwise plan on a mesh of one GPU, as a
tensor-parallel rank holds them), both through ``sw.compile`` with direct calls, without and
with CUDA graphs (full up to 16 tokens, piecewise above), and eager. A subclass input would keep
AOTAutograd's runtime wrappers and Dynamo's DTensor guards on every call; replays skip both.
``profile_dtensor_16.txt``: cProfile of the DTensor model without CUDA graphs at 16 tokens.

``--world 2`` (two GPUs, or ``--device cpu`` gloo ranks as a smoke test): the model saved once and
loaded by every rank with ``tp_plan="auto"``; eager, torch.compile(mode="reduce-overhead",
dynamic=False: one static graph per size) and shapewise (direct calls, CUDA graphs) on each rank,
against the unsharded model; rank 0 writes the table.

Answers are checked on fresh random ids at every size (each size called twice: capture, then
replay), then per-forward time: CUDA events around rounds of calls, rounds interleaved over the
contenders (a barrier before each at world > 1), the median.

    PYTHONPATH=. python3 benchmarks/bench_dtensor.py --out $OUT/dtensor_h200
    PYTHONPATH=. python3 benchmarks/bench_dtensor.py --world 2 --out $OUT/tp_hf_h200     # two GPUs
    python benchmarks/bench_dtensor.py --world 2 --device cpu --dim 256 --layers 2 --sizes 1,16 --rounds 3 \\
        --calls 5 --out /tmp/tp_hf_cpu                                                     # smoke
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import datetime
import io
import json
import os
import pstats
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import cpu_name  # noqa: E402

import shapewise as sw  # noqa: E402
from tests.distributed.tp_worker import parallelize_one  # noqa: E402

SIZES = [1, 16, 128, 512]


def build(layers: int, dim: int, device: str = "cuda") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=dim, intermediate_size=dim * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=dim // 128, num_key_value_heads=dim // 128, max_position_embeddings=4096)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(cfg).to(device, dtype).eval()


def measure(contenders: dict[str, Any], reference: Any, args: argparse.Namespace, device: str,
            profile: str | None = None) -> tuple[dict, dict]:
    """Per contender and size: the worst relative error against ``reference`` (fresh ids, each
    size called twice: capture, then replay) and the median per-forward µs over interleaved
    rounds (CUDA events on a GPU, the host clock on the CPU). Every rank of a world calls the
    same contenders in the same order (their collectives meet). ``profile``: the contender
    cProfile'd at 16 tokens."""
    errors: dict[str, dict[int, float]] = {c: {} for c in contenders}
    times: dict[str, dict[int, float]] = {c: {} for c in contenders}
    gen = torch.Generator().manual_seed(0)  # the same ids on every rank
    with torch.no_grad():
        for n in args.sizes:
            for _ in range(2):
                ids = torch.randint(0, 32000, (1, n), generator=gen).to(device)
                ref = reference(input_ids=ids, use_cache=False).logits.float()
                for c, fn in contenders.items():
                    out = fn(input_ids=ids, use_cache=False).logits.float()
                    errors[c][n] = max(errors[c].get(n, 0.0), float((out - ref).norm() / ref.norm()))
            samples: dict[str, list[float]] = {c: [] for c in contenders}
            ids = torch.randint(0, 32000, (1, n), generator=gen).to(device)
            for fn in contenders.values():  # warm-up
                for _ in range(5):
                    fn(input_ids=ids, use_cache=False)
            for _ in range(args.rounds):
                for c, fn in contenders.items():
                    if dist.get_world_size() > 1:
                        dist.barrier()
                    samples[c].append(_round_us(fn, ids, args.calls, device))
            for c in contenders:
                times[c][n] = statistics.median(samples[c])
            if dist.get_rank() == 0:
                print(n, {c: round(t[n], 1) for c, t in times.items()}, flush=True)
            if profile is not None and n == 16:  # where the host time of the DTensor model goes
                prof = cProfile.Profile()
                fn = contenders[profile]
                prof.runcall(lambda fn=fn, ids=ids: [fn(input_ids=ids, use_cache=False) for _ in range(args.calls)])
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                (Path(args.out) / "profile_dtensor_16.txt").write_text(text.getvalue())
    return errors, times


def _round_us(fn: Any, ids: torch.Tensor, calls: int, device: str) -> float:
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(input_ids=ids, use_cache=False)
        return (time.perf_counter() - t0) * 1e6 / calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn(input_ids=ids, use_cache=False)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def write(args: argparse.Namespace, title: str, note: str, contenders: dict, errors: dict, times: dict,
          device: str) -> None:
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (CPU)"
    env = dict(gpu=gpu, cpu=cpu_name(), torch=torch.__version__, world_size=args.world,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               model=f"transformers Llama, {args.layers} layers, dim {args.dim}, "
                     f"{'bf16' if device == 'cuda' else 'float32'}, batch 1")
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(dict(env=env, sizes=args.sizes, us_per_forward=times,
                                                      max_rel_error=errors), indent=1))
    lines = [f"# {title} ({env['gpu']}, world size {args.world}, torch {env['torch']}, {env['date']})", "",
             f"{env['model']}; µs per forward (median of {args.rounds} interleaved rounds of {args.calls} calls, "
             f"{'CUDA events' if device == 'cuda' else 'host clock'}); in brackets, {note}.", "",
             "| contender | " + " | ".join(f"{n} tok" for n in args.sizes) + " |",
             "|---" * (len(args.sizes) + 1) + "|"]
    for c in contenders:
        lines.append(f"| {c} | " + " | ".join(f"{times[c][n]:.0f} ({errors[c][n]:.0e})" for n in args.sizes) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def one_gpu(args: argparse.Namespace) -> None:
    """Plain weights against DTensor weights (torch's plan on a mesh of one GPU)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    plain = build(args.layers, args.dim)
    dtensor = copy.deepcopy(plain)
    parallelize_one(dtensor, torch.device("cuda", 0))
    opts = dict(dynamic_dims={"input_ids": 1}, sizes=args.sizes, splitting_ops=["sdpa"], cache=False, progress=False,
                direct_call=True)  # calls past Dynamo's guards (which check every DTensor's spec), as a server runs
    graphs = dict(cudagraphs={"mode": "full_and_piecewise", "full_up_to": 16, "capture": "startup"})
    contenders: dict[str, Any] = {"eager": plain}
    for name, model in (("plain", plain), ("dtensor", dtensor)):
        contenders[f"shapewise {name}"] = sw.compile(model, **opts)
        contenders[f"shapewise {name} + graphs"] = sw.compile(model, **opts, **graphs)
    errors, times = measure(contenders, plain, args, "cuda", profile="shapewise dtensor")
    write(args, "DTensor weights against plain weights", "relative error against eager (plain weights) at that size",
          contenders, errors, times, "cuda")
    dist.destroy_process_group()


def tp_rank(rank: int, args: argparse.Namespace) -> None:
    """One rank of transformers' own tensor parallel (``tp_plan="auto"``, DTensor weights):
    eager, torch.compile(mode="reduce-overhead", dynamic=False) and shapewise with CUDA graphs
    (on the CPU: plain torch.compile, and shapewise without graphs), against the unsharded model."""
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.world))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world)
    device = f"cuda:{rank}" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    part = AutoModelForCausalLM.from_pretrained(args.checkpoint, tp_plan="auto", dtype=dtype).eval()
    full = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(device).eval()
    opts = dict(dynamic_dims={"input_ids": 1}, sizes=args.sizes, splitting_ops=["sdpa"], cache=False, progress=False,
                direct_call=True)
    if cuda:
        opts["cudagraphs"] = {"mode": "full_and_piecewise", "full_up_to": 16, "capture": "startup"}
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(args.sizes))
    contenders = {"eager": part,
                  "torch.compile " + ("reduce-overhead" if cuda else "default"):
                      torch.compile(part, mode="reduce-overhead" if cuda else None, dynamic=False),
                  "shapewise" + (" + graphs" if cuda else ""): sw.compile(part, **opts)}
    errors, times = measure(contenders, full, args, device)
    if rank == 0:
        write(args, "transformers' tensor parallel (tp_plan, DTensor weights)",
              "relative error against the unsharded model at that size", contenders, errors, times, device)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--world", type=int, default=1, help="1: plain against DTensor weights on one GPU; 2 or more: "
                                                           "transformers' tp_plan on that many GPUs (or CPU ranks)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo ranks (a smoke test)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help=f"token counts (default {SIZES})")
    args = ap.parse_args(argv)
    args.sizes = [int(n) for n in args.sizes.split(",")]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    if args.world == 1:
        one_gpu(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(args.layers, args.dim, "cpu").save_pretrained(tmp)  # one checkpoint every rank loads its shard of
        args.checkpoint = tmp
        mp.spawn(tp_rank, args=(args,), nprocs=args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
