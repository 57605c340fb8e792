"""The serial host part of a cold ``compile_generate``: Dynamo's trace, against shapewise's whole first call.

Issue 29's parallel cold start is held back by what no compile worker can take: Dynamo tracing the model
in the session, and shapewise's pipeline after it. This measures both on the CPU, each in a fresh process:

- ``dynamo_static`` / ``dynamo_symbolic``: ``torch.compile(model, fullgraph=True)`` with a backend that
  only notes the time Dynamo hands it the graph: seconds from the call to that moment (the trace), for
  one prefill of ``--prompt`` tokens into a static cache, with seq static or marked dynamic (``mark_dynamic``
  alone: the cache's lengths stay static);
- ``shapewise_eager``: ``sw.compile_generate(..., backend="eager")`` (nothing compiled: the FX pieces run
  as they are) and its first ``generate()`` of 3 tokens: both of its traces (the prompt, symbolic in seq,
  and the decode step), the pipeline, and the runs;
- ``shapewise_eager_late``: the same with the unmarked decode trace refused by the backend, after Dynamo
  traced it whole, as before 2026-12-07 (night), not before it starts (``_compat.no_new_trace``);
- ``torch_eager``: transformers' ``generate()`` with ``torch.compile(backend="eager")`` on the forward,
  the same 3 tokens: Dynamo's traces as torch.compile makes them, for reference.

The model is ``bench_generate``'s tiny Llama (hidden 64) with ``--layers`` layers: its graphs have as many
nodes as a large model's of that many layers, so the trace costs what it would there (the tensors are small).

    PYTHONPATH=. python3 benchmarks/bench_trace_cost.py --layers 16 --repeats 3 --out benchmarks/results/trace_cost_cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("dynamo_static", "dynamo_symbolic", "shapewise_eager", "shapewise_eager_late", "torch_eager")


def child(kind: str, layers: int, prompt: int) -> float:
    """Seconds of ``kind`` (see the module's docstring) in this process."""
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from benchmarks.bench_generate import TINY, llama

    model = llama(TINY, "cpu", torch.float32, layers)
    ids = torch.randint(0, 200, (1, prompt))
    plain = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad():
        if kind.startswith("dynamo_"):
            handed: list[float] = []

            def note(gm, example_inputs):
                handed.append(time.perf_counter())
                return gm.forward

            cache = transformers.StaticCache(config=model.config, max_cache_len=4 * prompt)
            # symbolic: seq alone marked dynamic (dynamic=True would make the cache's lengths symbolic too)
            symbolic = kind == "dynamo_symbolic"
            fn = torch.compile(model, backend=note, fullgraph=True, dynamic=None if symbolic else False)
            if symbolic:
                torch._dynamo.mark_dynamic(ids, 1)
            t = time.perf_counter()
            fn(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt), use_cache=True)
            return handed[0] - t
        if kind.startswith("shapewise_eager"):  # (compile_generate itself traces nothing: timed with the first call)
            import shapewise as sw
            from shapewise._compat import retrace

            if kind == "shapewise_eager_late":
                retrace._HANDLER[:] = [None]  # as a torch without compile-start callbacks

            t = time.perf_counter()
            sw.compile_generate(model, prompt_sizes=[prompt // 2, prompt, 2 * prompt], max_length=4 * prompt,
                                static_cache=True, progress=False, backend="eager", cache=False)
            model.generate(ids, **plain)
        else:
            model.forward = torch.compile(model.forward, backend="eager")
            model.generation_config.disable_compile = True
            t = time.perf_counter()
            model.generate(ids, **plain, cache_implementation="static")
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="a folder for trace_cost.json and trace_cost.md")
    ap.add_argument("--child", choices=KINDS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.prompt)))
        return
    import platform

    import torch

    from benchmarks.hardware import cpu_name

    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.repeats):  # interleaved: each repeat runs every kind once, each in a fresh process
        for kind in KINDS:
            out = subprocess.run([sys.executable, __file__, "--child", kind, "--layers", str(args.layers),
                                  "--prompt", str(args.prompt)], capture_output=True, text=True,
                                 env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
            if out.returncode:
                sys.exit(f"{kind} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            seconds[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    import transformers

    head = {"cpu": cpu_name(), "machine": platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "layers": args.layers, "prompt": args.prompt,
            "repeats": args.repeats}
    rows = {k: {"median_s": round(statistics.median(v), 3), "all_s": [round(x, 3) for x in v]}
            for k, v in seconds.items()}
    lines = [f"# Dynamo's trace against shapewise's first call (CPU: {head['cpu']})", "",
             f"torch {head['torch']}, transformers {head['transformers']}; the tiny Llama of {args.layers} layers, "
             f"prompt {args.prompt}; median of {args.repeats} fresh processes each.", "",
             "| what | median s | all |", "|---|---:|---|"]
    lines += [f"| {k} | {r['median_s']} | {', '.join(map(str, r['all_s']))} |" for k, r in rows.items()]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "trace_cost.json").write_text(json.dumps({**head, "rows": rows}, indent=1))
        (out / "trace_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
