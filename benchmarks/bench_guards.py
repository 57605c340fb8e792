"""Per-call cost of the input guards of a Pipeline runnable (CPU, a small MLP).

Measures, for one static size, the runnable's per-call path (key build, dict lookup, call)
with the guarded runner and with the bare runner it wraps, on the same inputs; the check
alone (runner replaced by a no-op); and, for context, ``sw.compile`` (Dynamo's guards in
front, no shapewise checks). Writes ``benchmarks/results/guards.json`` and prints a table.

    python benchmarks/bench_guards.py [--calls 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch

import shapewise as sw
from shapewise._compat import no_zero_one_specialisation
from shapewise.ir import make_runner
from shapewise.models import MLP


def trace(model, x):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)
    with no_zero_one_specialisation():
        torch.compile(model, backend=backend, dynamic=False, fullgraph=True)(x)
    return graphs[0]


def per_call_ns(fn, args, calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--no-size-asserts", action="store_true", help="static_options={\"size_asserts\": False}")
    opts = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = MLP(dim=32, hidden=64).eval()
    x = torch.randn(8, 32)
    gm = trace(model, x.clone())
    rows = {}
    with torch.no_grad():
        lower = sw.Lower(backend=opts.backend, static_options={"size_asserts": False} if opts.no_size_asserts else ())
        runnable = sw.Pipeline([sw.Concretize(sizes=[8]), lower]).run(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        params = dict(model.named_parameters())
        args = []
        for n in placeholders:
            v = n.meta["example_value"]
            if isinstance(v, torch.SymInt):
                args.append(8)
            elif n.target == "L_x_":
                args.append(x)
            else:  # L_self_modules_up_parameters_weight_ → up.weight
                name = n.target.removeprefix("L_self_modules_").removesuffix("_")
                name = name.replace("_modules_", ".").replace("_parameters_", ".")
                args.append(params[name])
        guarded = runnable.table.exact[(8,)]
        program, guards = runnable.program, runnable.runtime.guards
        (binding,) = [b for b in program.dispatch.exact if b.key == (8,)]
        bare = make_runner(program.graph, program.callables(binding))  # the runner the checks wrap
        key_fn, exact = runnable.table.key_fn, runnable.table.exact

        def path(fn):
            table = {(8,): fn}

            def call(*a):
                return table.get(key_fn(a))(*a)
            return call

        torch.testing.assert_close(runnable(*args)[0], model(x))
        rows["tensor_inputs"] = sum(isinstance(a, torch.Tensor) for a in args)
        # Interleaved rounds (bare, guarded, bare, ...), the best of each: a noisy machine
        # slows both alike instead of whichever ran during the noise.
        best = {"bare_ns": float("inf"), "guarded_ns": float("inf"), "runnable_ns": float("inf")}
        for _ in range(opts.repeat):
            for name, fn in (("bare_ns", path(bare)), ("guarded_ns", path(guarded)), ("runnable_ns", runnable)):
                best[name] = min(best[name], per_call_ns(fn, args, opts.calls, 1))
        rows.update(best)
        checks_only = guards.wrap(binding, lambda *a: None)  # the same generated checks around no runner
        rows["check_only_ns"] = per_call_ns(checks_only, args, opts.calls * 5, opts.repeat)
        rows["empty_call_ns"] = per_call_ns(lambda *a: None, args, opts.calls * 5, opts.repeat)
        assert exact[(8,)] is guarded
        fast = sw.compile(model, sizes=[8], backend=opts.backend)
        fast(x)
        rows["sw_compile_ns"] = per_call_ns(fast, (x,), opts.calls, opts.repeat)
    rows["overhead_ns"] = rows["guarded_ns"] - rows["bare_ns"]
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu": _cpu(), "threads": torch.get_num_threads(), "backend": opts.backend,
            "size_asserts": not opts.no_size_asserts, "model": "MLP(32, 64), n=8",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    out = {"meta": meta, "results": rows}
    folder = Path(__file__).parent / "results" / "guards"
    folder.mkdir(parents=True, exist_ok=True)
    name = "no_size_asserts.json" if opts.no_size_asserts else "default.json"
    (folder / name).write_text(json.dumps(out, indent=2) + "\n")
    write_table(folder)
    width = max(map(len, rows))
    for k, v in rows.items():
        print(f"{k:<{width}}  {v:10.0f}" + (" ns" if k.endswith("_ns") else ""))
    print(json.dumps(meta))


def write_table(folder: Path) -> None:
    """results.md: one column per run in ``folder``."""
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    if not runs:
        return
    labels = {
        "bare_ns": "runnable path, bare runner (ns/call)",
        "guarded_ns": "runnable path, guarded runner (ns/call)",
        "overhead_ns": "guard overhead (ns/call)",
        "check_only_ns": "the check alone, runner a no-op (ns)",
        "empty_call_ns": "an empty Python call, for scale (ns)",
        "sw_compile_ns": "sw.compile, Dynamo in front, no shapewise checks (ns/call)",
        "tensor_inputs": "tensor inputs checked",
    }
    meta = next(iter(runs.values()))["meta"]
    lines = [f"# Input guards: per-call cost ({meta['model']}, Inductor, CPU)", "",
             f"{meta['cpu']}, torch {meta['torch']}, Python {meta['python']}, {meta['threads']} thread; "
             f"run {', '.join(r['meta'].get('date', 'on a date not recorded') for r in runs.values())}; "
             "best of interleaved rounds. `python benchmarks/bench_guards.py [--no-size-asserts]`.", "",
             "| | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]
    for key, label in labels.items():
        lines.append(f"| {label} | " + " | ".join(f"{r['results'][key]:.0f}" for r in runs.values()) + " |")
    (folder / "results.md").write_text("\n".join(lines) + "\n")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
