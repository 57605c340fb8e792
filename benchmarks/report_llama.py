"""Combine bench_llama.py result files into one markdown table and a plot.

    python benchmarks/report_llama.py benchmarks/results/llama_h200/run1_main.json \
        benchmarks/results/llama_h200/run2_cudagraphs_autotune.json --out benchmarks/results/llama_h200
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    runs = [json.loads(Path(f).read_text()) for f in args.files]
    env = runs[0]["env"]
    tokens = runs[0]["tokens"]
    columns: dict[str, dict] = {}
    for i, run in enumerate(runs, 1):
        for name, row in run["results"].items():
            columns[f"{name} (run {i})" if any(name in r["results"] for r in runs[:i - 1]) else name] = row
    ceil = env["ceilings"]
    m = env["model"]
    weights = m["layers"] * (4 * m["dim"] ** 2 + 3 * m["dim"] * m["mlp"]) * 2
    params = weights // 2

    def floor_us(t: int) -> float:
        act = 4 * t * m["dim"] * 2 * m["layers"] * 2
        flops = 2 * t * params + m["layers"] * 2 * t * t * m["dim"]
        return max((weights + act) / ceil["copy_bytes_per_s"], flops / ceil["matmul_flops_per_s"]) * 1e6

    names = list(columns)
    lines = [f"# Llama-style stack ({m['layers']} layers, hidden {m['dim']}, MLP {m['mlp']}, {m['heads']} heads, "
             f"bf16) on {env['device']}", "",
             f"torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}, {env['date']}; {env['timing']}.",
             f"Measured ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), bf16 matmul "
             f"{ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s. Runs: " + ", ".join(Path(f).name for f in args.files)
             + ". A name seen in an earlier run gets '(run N)'.", "",
             "Median µs per forward of the 4-layer stack (per layer: ÷4). `—`: not run at that size.", ""]
    head = ["tokens", *names, "roofline floor"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in tokens:
        cells = [str(t)]
        for n in names:
            r = columns[n]
            v = r["us"].get(str(t), r["us"].get(t))
            cells.append(f"{v:.0f}" if v is not None else ("failed" if "error" in r else "—"))
        cells.append(f"{floor_us(t):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| contender | compile + first calls, s | max rel. error vs eager | error |", "|---|---|---|---|"]
    for n in names:
        r = columns[n]
        errs = list(r["err"].values())
        lines.append(f"| {n} | {r['compile_s']:.1f} | {max(errs):.1e} | {r.get('error', '')} |" if errs
                     else f"| {n} | {r['compile_s']:.1f} | — | {r.get('error', '')} |")
    out = Path(args.out)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for n in names:
        pts = sorted((int(k), v) for k, v in columns[n]["us"].items())
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, label=n)
    ax.plot(tokens, [floor_us(t) for t in tokens], "k--", label="roofline floor")
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="µs per forward (4 layers)",
           title=f"{env['device']}, torch {env['torch']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
