"""A decode step on the CPU (no CUDA graphs) with the projections fused (``FuseProjections``) and
without, side by side in one process, rounds interleaved: what ``shapewise::linear_group``'s host
cost per call does where no graph replays it (why ``compile_generate`` fuses by default only
where the steps replay CUDA graphs).

The model: a transformers Llama with 16 tiny layers (hidden 64: the compute is negligible, the
step is host time), ``compile_generate(static_cache=True, backend=...)``, generate()'s decode call
(bench_decode's ``Step``); one thread. Also the op alone against one ``F.linear`` over the same
packed weights and against three ``F.linear`` calls. Medians over rounds of per-call times.

    python benchmarks/bench_fuse_cpu.py --out benchmarks/results/host_cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shapewise as sw  # noqa: E402
from benchmarks.bench_decode import Step  # noqa: E402
from benchmarks.hardware import cpu_name  # noqa: E402


def build(layers: int, fuse: bool, backend: str) -> Step:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    sw.compile_generate(model, prompt_sizes=[8], max_length=408, static_cache=True, backend=backend,
                        fuse_projections=fuse, progress=False)
    return Step("sw", model, torch.randint(0, 128, (1, 8)), 400)


def per_call_us(fn, calls: int) -> float:
    return min(timeit.repeat(fn, number=calls, repeat=3)) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps = {"unfused": build(args.layers, False, args.backend), "fused": build(args.layers, True, args.backend)}
    buf = torch.randn(128, 64)
    ws, x = [buf[:64], buf[64:96], buf[96:]], torch.randn(1, 1, 64)
    op = torch.ops.shapewise.linear_group.default
    ops = {"linear_group (q, k, v packed)": lambda: op(x, ws, []), "one F.linear over the packed weight":
           lambda: F.linear(x, buf), "three F.linear": lambda: [F.linear(x, w) for w in ws]}
    samples: dict[str, list[float]] = {k: [] for k in [*steps, *ops]}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, step in steps.items():
                step.rewind()
                samples[name].append(per_call_us(step.call, 50))
            for name, fn in ops.items():
                samples[name].append(per_call_us(fn, 2000))
    rows = [{"what": k, "median_us": round(statistics.median(v), 2)} for k, v in samples.items()]
    hw = f"{cpu_name()} ({os.cpu_count()} CPU cores, 1 thread used)"
    result = {"hardware": hw, "torch": torch.__version__, "transformers": transformers.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "layers": args.layers,
              "backend": args.backend, "rows": rows, "samples_us": samples}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fuse_cpu.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Fused projections on the CPU, no CUDA graphs ({args.layers} tiny layers, {args.backend})", "",
             f"{hw}; torch {torch.__version__}, transformers {transformers.__version__}; {result['date'][:16]} UTC. "
             f"Medians over {args.rounds} interleaved rounds.", "", "| what | µs per call |", "|---|---:|"]
    lines += [f"| {'decode step, ' if r['what'] in steps else ''}{r['what']} | {r['median_us']} |" for r in rows]
    (args.out / "fuse_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
