"""Which of the host-path changes of issue 12 buys what: shapewise static on bench_host's model
(bench_llama's Stack, 4 layers, dim 256, fp32, CPU) with each change taken out in turn, against
torch.compile(dynamic=False) in the same process; interleaved rounds, median (and min) per call.

    python benchmarks/ablate_host.py [--out FILE.json]

Each configuration runs in a fresh process: measured in one process, shapewise compiles of the
same model interfere (the static time of "all three taken out" read 0.90x there and 1.11x alone).
Taking a change out patches ``shapewise.lower.lower`` in that process (the lean splitting call,
the lean call of aliasing pieces) or passes ``static_options={"size_asserts": True}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llama import ATTN, Stack  # noqa: E402

import shapewise as sw  # noqa: E402
import shapewise.lower.lower as lower_module  # noqa: E402

TOKENS = (1, 2)
CONFIGS = {
    "all on (the default)": (),
    "- splitting op called through its dispatch": ("split",),
    "- Inductor's size_asserts kept": ("asserts",),
    "- aliasing pieces wrapped": ("alias",),
    "- all three (lean calls only: the code before)": ("split", "asserts", "alias"),
    "lean=False (none of them, nor lean calls)": ("lean",),
}


def per_call_us(fn, x, calls: int = 200) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t0) / calls * 1e6


def measure(off: tuple[str, ...]) -> dict[str, dict[int, list[float]]]:
    kw: dict = {}
    if "split" in off:
        lower_module.lean_splitting_call = lambda piece: None
    if "alias" in off:
        real = lower_module.lean_call
        lower_module.lean_call = lambda fn, piece, variant: real(fn, dataclasses.replace(piece, returned=None), variant)
    if "asserts" in off:
        kw["static_options"] = {"size_asserts": True}
    if "lean" in off:
        kw["lean"] = False
    torch.manual_seed(0)
    model = Stack(4, 256, heads=4, hidden=512, max_tokens=64).eval()
    fns = {t: torch.compile(model, dynamic=False) for t in TOKENS}
    contenders = {"dynamic=False": lambda x: fns[x.shape[0]](x),
                  "shapewise": sw.compile(model, sizes=list(TOKENS), splitting_ops=[ATTN], dynamic_dims={"x": 0},
                                          progress=False, cache=False, **kw)}
    xs = {t: torch.randn(t, 256) for t in TOKENS}
    times = {k: {t: [] for t in TOKENS} for k in contenders}
    with torch.no_grad():
        for fn in contenders.values():
            for x in xs.values():
                for _ in range(3):
                    fn(x)
        for _ in range(9):
            for t, x in xs.items():
                for name, fn in contenders.items():
                    times[name][t].append(per_call_us(fn, x))
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--off", default=None, help="(internal) measure one configuration: comma list of changes off")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.off is not None:
        print(json.dumps(measure(tuple(filter(None, args.off.split(","))))))
        return 0
    rows = {}
    for name, off in CONFIGS.items():
        out = subprocess.run([sys.executable, __file__, "--off", ",".join(off)], check=True, capture_output=True,
                             text=True).stdout
        rows[name] = json.loads(out.strip().splitlines()[-1])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median (min) µs per call, 9 rounds of 200, "
          "each configuration in its own process with dynamic=False measured beside it")
    print("| configuration | " + " | ".join(f"{t} token{'s' * (t > 1)}: shapewise / dynamic=False" for t in TOKENS)
          + " |")
    print("|---|" + "---|" * len(TOKENS))
    for name, times in rows.items():
        cells = []
        for t in map(str, TOKENS):
            sw_t, base = times["shapewise"][t], times["dynamic=False"][t]
            cells.append(f"{statistics.median(sw_t):.0f} ({min(sw_t):.0f}) / {statistics.median(base):.0f} = "
                         f"{statistics.median(sw_t) / statistics.median(base):.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
