"""What DTensor weights cost a compiled model: a transformers Llama with plain weights against the
same weights as DTensors (torch.distributed.tensor.parallel's colwise / rowwise plan on a mesh of
one GPU, as a tensor-parallel rank holds them), both through ``sw.compile``, side by side.

A subclass input keeps AOTAutograd's runtime wrappers (they flatten a DTensor to its local
tensor; shapewise's lean call skips them only for plain inputs), and DTensor's own ops (the
embedding's masking, the head's redistribute) stay in the graph, so without CUDA graphs the
DTensor model may pay per call on the host; under CUDA graphs replays should cost the same.
Contenders: eager (plain weights), shapewise without CUDA graphs, shapewise with full graphs up
to 16 tokens and piecewise above; each with plain and with DTensor weights, and direct calls
(past Dynamo's guards). ``profile_dtensor_16.txt``: cProfile of the DTensor model without CUDA
graphs at 16 tokens. Answers are checked
against the plain eager model on fresh random ids at every size, then per-forward time (CUDA
events around rounds of calls, rounds interleaved over the contenders, the median).

    PYTHONPATH=. python3 benchmarks/bench_dtensor.py --out $OUT/dtensor_h200
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
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import cpu_name  # noqa: E402

import shapewise as sw  # noqa: E402
from tests.distributed.tp_worker import parallelize_one  # noqa: E402

SIZES = [1, 16, 128, 512]


def build(layers: int, dim: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=dim, intermediate_size=dim * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=dim // 128, num_key_value_heads=dim // 128, max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    plain = build(args.layers, args.dim)
    dtensor = copy.deepcopy(plain)
    parallelize_one(dtensor, torch.device("cuda", 0))
    opts = dict(dynamic_dims={"input_ids": 1}, sizes=SIZES, splitting_ops=["sdpa"], cache=False, progress=False,
                direct_call=True)  # calls past Dynamo's guards (which check every DTensor's spec), as a server runs
    graphs = dict(cudagraphs={"mode": "full_and_piecewise", "full_up_to": 16, "capture": "startup"})
    contenders = {"eager": plain}
    for name, model in (("plain", plain), ("dtensor", dtensor)):
        contenders[f"shapewise {name}"] = sw.compile(model, **opts)
        contenders[f"shapewise {name} + graphs"] = sw.compile(model, **opts, **graphs)
    errors: dict[str, dict[int, float]] = {c: {} for c in contenders}
    times: dict[str, dict[int, float]] = {c: {} for c in contenders}
    with torch.no_grad():
        for n in SIZES:
            for _ in range(2):  # capture, then replay: both checked
                ids = torch.randint(0, 32000, (1, n), device="cuda")
                ref = plain(input_ids=ids, use_cache=False).logits.float()
                for c, fn in contenders.items():
                    out = fn(input_ids=ids, use_cache=False).logits.float()
                    errors[c][n] = max(errors[c].get(n, 0.0), float((out - ref).norm() / ref.norm()))
            samples: dict[str, list[float]] = {c: [] for c in contenders}
            ids = torch.randint(0, 32000, (1, n), device="cuda")
            for fn in contenders.values():  # warm-up
                for _ in range(5):
                    fn(input_ids=ids, use_cache=False)
            for _ in range(args.rounds):
                for c, fn in contenders.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(args.calls):
                        fn(input_ids=ids, use_cache=False)
                    end.record()
                    end.synchronize()
                    samples[c].append(start.elapsed_time(end) * 1e3 / args.calls)
            for c in contenders:
                times[c][n] = statistics.median(samples[c])
            print(n, {c: round(t[n], 1) for c, t in times.items()}, flush=True)
            if n == 16:  # where the host time of the DTensor model goes, without CUDA graphs
                prof = cProfile.Profile()
                fn = contenders["shapewise dtensor"]
                prof.runcall(lambda: [fn(input_ids=ids, use_cache=False) for _ in range(args.calls)])
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                (Path(args.out) / "profile_dtensor_16.txt").write_text(text.getvalue())
    env = dict(gpu=torch.cuda.get_device_name(), cpu=cpu_name(), torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               model=f"transformers Llama, {args.layers} layers, dim {args.dim}, bf16, batch 1", world_size=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(env=env, sizes=SIZES, us_per_forward=times,
                                                      max_rel_error=errors), indent=1))
    lines = [f"# DTensor weights against plain weights ({env['gpu']}, torch {env['torch']}, {env['date']})", "",
             f"{env['model']}; µs per forward (median of {args.rounds} interleaved rounds of {args.calls} calls, "
             "CUDA events); in brackets, relative error against eager (plain weights) at that size.", "",
             "| contender | " + " | ".join(f"{n} tok" for n in SIZES) + " |", "|---" * (len(SIZES) + 1) + "|"]
    for c in contenders:
        lines.append(f"| {c} | " + " | ".join(f"{times[c][n]:.0f} ({errors[c][n]:.0e})" for n in SIZES) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
