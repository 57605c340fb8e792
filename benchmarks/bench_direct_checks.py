"""Host time of a decode step's direct call (shapewise.direct), the compiled program stubbed out,
with the checks as generated now and as generated before, side by side in one process, rounds
interleaved: one check per object (before 2026-12-03) and ``direct_checks.merge_checks`` (now: the
layers' constants read by one map, each class's attributes once).

The model: a transformers Llama with 16 tiny layers (hidden 64), through
``sw.compile_generate(static_cache=True, backend="eager")``; the step is generate()'s decode call
(bench_decode's ``Step``). The Runnable is replaced by one that returns its first outputs, so what
is timed is the direct call alone: reading the arguments, the checks, the output rebuild (and the
``nn.Module`` call around it). Medians and minima over rounds of the per-call time, warm (calls
back to back) and cold (each call after 16 MB of memory is read, as the program between two
decode steps evicts the caches; each call timed alone).

    python benchmarks/bench_direct_checks.py --out benchmarks/results/host_cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import timeit
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shapewise as sw  # noqa: E402
import shapewise.direct_checks as checks  # noqa: E402
import shapewise.dispatch.runnable as runnable  # noqa: E402
from benchmarks.bench_decode import Step  # noqa: E402
from benchmarks.hardware import cpu_name  # noqa: E402


def build(layers: int, merged: bool):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    real = checks.merge_checks
    if not merged:
        checks.merge_checks = lambda lines, env: lines  # as generated before merge_checks
    try:
        fast = sw.compile_generate(model, prompt_sizes=[8], max_length=408, static_cache=True, backend="eager",
                                   progress=False)
        step = Step("sw", model, torch.randint(0, 128, (1, 8)), 400)
        step.rewind()
        with torch.no_grad():
            step.call()  # arms the decode trace's direct call
    finally:
        checks.merge_checks = real
    return fast, step


def cold_us(call, calls: int, thrash: torch.Tensor) -> float:
    """Median time of ``calls`` calls, each after ``thrash`` is read through (caches evicted)."""
    times = []
    for _ in range(calls):
        thrash.sum()
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    contenders = {"checks per object (before)": build(args.layers, False),
                  "merged checks (now)": build(args.layers, True)}
    for name, (fast, _) in contenders.items():
        assert fast.direct_info.endswith(": on"), (name, fast.direct_info)
    real_call = runnable.Runnable.__call__
    first: dict[int, object] = {}

    def stub(self, *a):
        if id(self) not in first:
            first[id(self)] = real_call(self, *a)
        return first[id(self)]

    runnable.Runnable.__call__ = stub
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    cold: dict[str, list[float]] = {name: [] for name in contenders}
    thrash = torch.ones(4 * 2**20)  # 16 MB
    try:
        with torch.no_grad():
            for _ in range(3):  # warm-up
                for _, step in contenders.values():
                    step.rewind()
                    step.call()
            for _ in range(args.rounds):
                for name, (fast, step) in contenders.items():
                    step.rewind()
                    before = fast.direct_calls
                    t = min(timeit.repeat(step.call, number=args.calls, repeat=3)) / args.calls
                    assert fast.direct_calls == before + 3 * args.calls, f"{name}: a call left the direct path"
                    samples[name].append(t * 1e6)
                    step.rewind()
                    cold[name].append(cold_us(step.call, args.calls, thrash) * 1e6)
    finally:
        runnable.Runnable.__call__ = real_call
    rows = [{"contender": name, "median_us": round(statistics.median(v), 1), "min_us": round(min(v), 1),
             "cold_median_us": round(statistics.median(cold[name]), 1), "cold_min_us": round(min(cold[name]), 1),
             "lines": len(contenders[name][0]._directs.armed[0].source.splitlines())} for name, v in samples.items()]
    hw = f"{cpu_name()} ({os.cpu_count()} CPU cores)"
    result = {"hardware": hw, "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "layers": args.layers, "rounds": args.rounds, "calls": args.calls, "rows": rows, "samples_us": samples,
              "cold_samples_us": cold}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "direct_checks.json").write_text(json.dumps(result, indent=1))
    lines = [f"# A decode step's direct call, the program stubbed ({args.layers} layers)", "",
             f"{hw}; torch {torch.__version__}, transformers {transformers.__version__}; {result['date'][:16]} UTC. "
             f"Per call, median (min) over {args.rounds} interleaved rounds: warm, each round the best of 3 x "
             f"{args.calls} calls back to back; cold, each round the median of {args.calls} calls, each after 16 MB "
             "is read. All check the objects' distinctness by map(id) (changed with merge_checks).",
             "", "| contender | warm µs per call | min | cold µs per call | min | lines of the generated call |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['contender']} | {r['median_us']} | {r['min_us']} | {r['cold_median_us']} | {r['cold_min_us']} | "
              f"{r['lines']} |" for r in rows]
    (args.out / "direct_checks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
