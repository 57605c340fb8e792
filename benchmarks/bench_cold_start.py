"""Cold start, warm start and the dedupe win, in one run.

For each layer count (default 2, 8, 32) of a ToyTransformer split at its attention op, in fresh
processes:
  cold   -- empty shapewise cache, empty Inductor cache: the first call traces and compiles
            every variant (dedupe on: identical layers share artifacts);
  warm   -- a fresh process with the shapewise cache the cold run filled and an *empty*
            Inductor cache (so Inductor's own caches hide nothing);
  warm+  -- as warm, but Inductor's one-time per-cache-folder warm-up (on CPU: compiling and
            loading its vector-ISA probes) is run and timed first, so what is left is
            shapewise's own loading;
with ``--workers N``, cold again with ``compile_workers=N`` (worker processes compile the static
variants into the cache while the child compiles the rest; empty caches of its own); and once, for
the middle layer count, cold with ``dedupe=False, cache=False`` (each piece goes
to Inductor, whose own FX graph cache still shares the identical ones), and the same with
Inductor's FX graph and AOTAutograd caches off too (every piece really compiled).

Times are the wall time of the first call (trace + compile or load + run), measured inside the
child; each child also checks every size against eager. ``--repeats`` runs everything that many
times, interleaved, and reports medians (all samples are in the JSON). Writes
``cold_start_<device>.json`` and ``cold_start_<device>.md`` to ``--out``, naming the CPU / GPU,
torch version and date.

    python benchmarks/bench_cold_start.py --repeats 3                               # CPU
    PYTHONPATH=. python3 benchmarks/bench_cold_start.py --device cuda --repeats 3
    PYTHONPATH=. python3 benchmarks/bench_cold_start.py --device cuda --max-autotune --no-baseline
    python benchmarks/bench_cold_start.py --quick --out /tmp/cold                   # smoke test
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["main"]


# -- the child: one measurement in a fresh process ----------------------------------------------

def child(cfg: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch

    import shapewise as sw
    from shapewise.models import ATTENTION_OP, ToyTransformer

    import_s = time.perf_counter() - t0
    device = torch.device(cfg["device"])
    dtype = getattr(torch, cfg["dtype"])
    torch.manual_seed(0)
    model = ToyTransformer(vocab=cfg["vocab"], dim=cfg["dim"], heads=cfg["heads"], hidden=cfg["hidden"],
                           layers=cfg["layers"]).to(device=device, dtype=dtype).eval()
    static_options = {"max_autotune": True} if cfg.get("max_autotune") else None
    fast = sw.compile(model, sizes=cfg["sizes"], ranges=[tuple(r) for r in cfg["ranges"]],
                      splitting_ops=[ATTENTION_OP], backend="inductor", dedupe=cfg["dedupe"],
                      cache=cfg.get("cache", None), static_options=static_options, progress=False,
                      compile_workers=cfg.get("workers", 1), warm_start=cfg.get("warm_start", False))
    out: dict[str, Any] = {"import_s": import_s, "workers": cfg.get("workers", 1)}
    if cfg.get("inductor_warmup"):
        t = time.perf_counter()
        warm = _inductor_warmup(device)
        out["inductor_warmup_s"] = time.perf_counter() - t
        out["inductor_warmup"] = warm
    ids = {n: torch.randint(0, cfg["vocab"], (n,), device=device) for n in cfg["check"]}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        first = cfg["check"][0]
        t = time.perf_counter()
        fast(ids[first])
        sync()
        out["first_call_s"] = time.perf_counter() - t
        # With compile workers the first call runs once its own size is ready (the workers' variants
        # are loaded on first use): until every variant is, all_ready_s (wait() loads the rest).
        t = time.perf_counter()
        fast.wait()
        out["all_ready_s"] = out["first_call_s"] + time.perf_counter() - t
        # Relative norm error against a float32 copy of the model; in bfloat16 the compiled model
        # may drift from the reference about as far as eager bfloat16 does (not elementwise).
        ref = copy.deepcopy(model).float()
        errors, eager_errors = [], []
        for x in ids.values():
            want = ref(x)
            errors.append(_rel_err(fast(x), want))
            eager_errors.append(_rel_err(model(x), want))
        slack = 1e-4 if dtype == torch.float32 else 1e-2
        out["max_rel_err"], out["eager_max_rel_err"] = max(errors), max(eager_errors)
        out["correct"] = all(e <= 2 * ee + slack for e, ee in zip(errors, eager_errors))
    total = fast.report().total
    out.update({k: total.get(k, 0) for k in ("variants", "compiled", "worker", "reused", "cache", "fallback")})
    out["variant_seconds"] = total["seconds"]
    out["pieces"] = len(fast.program.compute_pieces)
    out["warm_info"] = fast.warm_info
    return out


def _rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _inductor_warmup(device) -> str:
    """Inductor's per-cache-folder warm-up, outside shapewise: on CPU its vector-ISA probes."""
    if device.type != "cpu":
        return "none needed"
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa())


# -- the parent: orchestrate fresh processes ------------------------------------------------------

def run_child(cfg: dict[str, Any], sw_cache: Path, inductor_cache: Path,
              extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    env = {**os.environ, "SHAPEWISE_CACHE_DIR": str(sw_cache), "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           **(extra_env or {})}
    env.pop("SHAPEWISE_CACHE", None)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=cfg["timeout"])
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"child {cfg['run']} L={cfg['layers']} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def _median(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The sample with the median first-call time (its other fields stay consistent)."""
    ordered = sorted(samples, key=lambda r: r["first_call_s"])
    return ordered[(len(ordered) - 1) // 2]


def hardware(device: str) -> dict[str, Any]:
    import torch

    cpu = cpu_name()
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_average_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def table(results: dict[str, Any]) -> str:
    hw, cfg = results["hardware"], results["config"]
    lines = [
        f"# Cold vs warm start ({cfg['device']})",
        "",
        f"{hw.get('gpu', hw['cpu'])} ({hw['cpu_count']} CPU cores); torch {hw['torch']}; {hw['date']}; "
        f"load average at start {hw['load_average_1m_at_start']}",
        f"ToyTransformer(dim={cfg['dim']}, hidden={cfg['hidden']}, heads={cfg['heads']}, vocab={cfg['vocab']}, "
        f"{cfg['dtype']}), split at its attention op; sizes {cfg['sizes']}, ranges {cfg['ranges']}"
        + ("; static sizes with max_autotune." if cfg.get("max_autotune") else "."),
        "Seconds of the first call (Dynamo trace + compile or load of every variant + one run), in a fresh "
        "process; median of {repeats} run(s). warm: shapewise cache full, Inductor cache empty. warm+: the same "
        "after Inductor's one-time per-cache-folder warm-up (timed separately; on CPU its vector-ISA probes, "
        "which TORCHINDUCTOR_VEC_ISA_OK=1 skips).".format(repeats=cfg.get("repeats", 1)),
        "",
        "| layers | compute pieces | variants | cold s (min-max) | compiled / reused | warm s | warm / cold | "
        "Inductor warm-up s | warm+ s | warm+ / cold | cold / cold(2 layers) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = results["runs"][0]["cold"]["first_call_s"]
    for r in results["runs"]:
        c, w, wp = r["cold"], r["warm"], r["warm_plus"]
        spread = sorted(x["first_call_s"] for x in r["samples"]["cold"])
        lines.append(
            f"| {r['layers']} | {c['pieces']} | {c['variants']} | {c['first_call_s']:.1f} "
            f"({spread[0]:.0f}-{spread[-1]:.0f}) | "
            f"{c['compiled']} / {c['reused']} | {w['first_call_s']:.1f} | "
            f"{w['first_call_s'] / c['first_call_s']:.0%} | "
            f"{wp.get('inductor_warmup_s', 0):.1f} | {wp['first_call_s']:.1f} | "
            f"{wp['first_call_s'] / c['first_call_s']:.0%} | {c['first_call_s'] / base:.2f}x |")
    if results.get("no_dedupe"):
        nd, nd2 = results["no_dedupe"], results.get("no_dedupe_no_inductor_cache")
        same = next(r for r in results["runs"] if r["layers"] == nd["layers"])["cold"]
        lines += ["", f"Dedupe, {nd['layers']} layers, cold: with dedupe {same['first_call_s']:.1f} s "
                      f"({same['compiled']} pieces compiled); without ({nd['compiled']} pieces sent to Inductor, "
                      f"whose FX graph cache still shares identical ones) {nd['first_call_s']:.1f} s"
                  + (f"; without, Inductor's caches off too {nd2['first_call_s']:.1f} s." if nd2 else ".")]
    if any("cold_workers" in r for r in results["runs"]):
        w = results["runs"][0]["cold_workers"].get("workers", "?")
        lines += ["", f"Cold with {w} compile worker processes (`compile_workers={w}`; its own empty caches) against "
                      "one variant after another (issue 29):", "",
                  "| layers | serial cold s | with workers: first call s | of serial | every variant ready s "
                  "| of serial | compiled here / in workers |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in results["runs"]:
            c, cw = r["cold"], r["cold_workers"]
            first, ready, serial = cw["first_call_s"], cw.get("all_ready_s", cw["first_call_s"]), c["first_call_s"]
            lines.append(f"| {r['layers']} | {serial:.1f} | {first:.1f} | {first / serial:.2f} "
                         f"| {ready:.1f} | {ready / serial:.2f} | {cw['compiled']} / {cw.get('worker', 0)} |")
    if any("warm_ws" in r for r in results["runs"]):
        lines += ["", "Warm starts with the Inductor cache the cold start filled (a user's second start; issue 29): "
                      "pieces only (`warm_start=False`: Dynamo traces, the pieces' artifacts load) against the whole "
                      "program (`warm_start=True`: the saved traces load, no Dynamo trace, no split or keys):", "",
                  "| layers | cold s | warm, pieces s | of cold | cold, warm_start s | warm, whole program s "
                  "| of cold |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in results["runs"]:
            c, wk, cw, ww = r["cold"], r["warm_kept"], r["cold_ws"], r["warm_ws"]
            lines.append(f"| {r['layers']} | {c['first_call_s']:.1f} | {wk['first_call_s']:.2f} | "
                         f"{wk['first_call_s'] / c['first_call_s']:.0%} | {cw['first_call_s']:.1f} | "
                         f"{ww['first_call_s']:.2f} | {ww['first_call_s'] / cw['first_call_s']:.0%} |")
        infos = {r["warm_ws"].get("warm_info", "")[:40] for r in results["runs"]}
        lines += ["", f"warm_start's warm runs said: {sorted(infos)}"]
    t = results["targets"]
    lines += ["", "Targets (issue 3): warm start <= 10% of cold: "
              f"{'met' if t['warm_le_10pct'] else 'NOT met'} (worst warm/cold {t['worst_warm_ratio']:.0%}; "
              f"after Inductor's warm-up {t['worst_warm_plus_ratio']:.0%}); "
              f"{t['big_layers']}-layer cold <= 1.3x {t['small_layers']}-layer cold: "
              f"{'met' if t['big_le_1_3x'] else 'NOT met'} ({t['big_over_small']:.2f}x).",
              "", "Every run checked every size against a float32 copy of the model (relative norm error, "
              "allowed twice eager's own plus a slack): "
              + ("all correct." if results["all_correct"] else "SOME WRONG (see JSON).")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cold_start"),
                        help="folder for the JSON and table (default benchmarks/results/cold_start)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--layers", default="2,8,32", help="layer counts (default 2,8,32)")
    parser.add_argument("--sizes", default="1,2,4,8,16", help="static sizes (default 1,2,4,8,16)")
    parser.add_argument("--ranges", default="17-256", help="ranges lo-hi,... (default 17-256; '' for none)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the dedupe=False cold runs")
    parser.add_argument("--max-autotune", action="store_true",
                        help="static sizes compile with max_autotune (as a server would; a longer cold start)")
    parser.add_argument("--quick", action="store_true", help="layers 2,4; sizes 1,4; no range (smoke test)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    parser.add_argument("--repeats", type=int, default=1, help="runs of everything, interleaved; medians reported")
    parser.add_argument("--workers", type=int, default=1,
                        help="also a cold start with this many compile worker processes (compile_workers; 1: none)")
    parser.add_argument("--warm-start", action="store_true",
                        help="also cold with warm_start=True, then its warm start (the whole program loaded, no "
                             "Dynamo trace), beside the pieces-only warm start, both with their Inductor cache kept")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.quick:
        args.layers, args.sizes, args.ranges = "2,4", "1,4", ""
    layers = [int(x) for x in args.layers.split(",") if x]
    if not layers:
        parser.error("--layers needs at least one layer count")
    sizes = [int(x) for x in args.sizes.split(",") if x]
    ranges = [[int(v) for v in r.split("-")] for r in args.ranges.split(",") if r]
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    base_cfg = {"device": args.device, "dtype": dtype, "dim": args.dim, "hidden": args.hidden, "heads": args.heads,
                "vocab": args.vocab, "sizes": sizes, "ranges": ranges, "dedupe": True, "timeout": args.timeout,
                "max_autotune": args.max_autotune,
                "check": sizes + [r[0] for r in ranges] + [r[1] for r in ranges]}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"hardware": hardware(args.device),
                               "config": {**base_cfg, "layers": layers, "repeats": args.repeats}, "runs": []}
    runs_of = {"cold": {}, **({"cold_workers": {"workers": args.workers}} if args.workers > 1 else {}),
               "warm": {}, "warm_plus": {"inductor_warmup": True},
               **({"warm_kept": {}, "cold_ws": {"warm_start": True}, "warm_ws": {"warm_start": True}}
                  if args.warm_start else {})}
    # Runs that share another's caches: a warm start with the Inductor cache its cold start filled
    # (as a user's second start has it), and warm_start's own folders.
    inductor_of = {"warm_kept": "cold", "warm_ws": "cold_ws"}
    samples: dict[int, dict[str, list[dict[str, Any]]]] = {n: {k: [] for k in runs_of} for n in layers}
    baseline_layers = None if args.no_baseline or len(layers) < 2 else (
        layers[len(layers) // 2] if len(layers) > 2 else layers[-1])
    baselines: dict[str, list[dict[str, Any]]] = {"no_dedupe": [], "no_dedupe_no_inductor_cache": []}
    inductor_caches_off = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    with tempfile.TemporaryDirectory(prefix="shapewise-bench-") as tmp:
        tmp_path = Path(tmp)
        for rep in range(args.repeats):
            if baseline_layers is not None:
                cfg = {**base_cfg, "layers": baseline_layers, "dedupe": False, "cache": False}
                for name, env in (("no_dedupe", None), ("no_dedupe_no_inductor_cache", inductor_caches_off)):
                    r = run_child({**cfg, "run": name}, tmp_path / f"sw-{name}-{rep}", tmp_path / f"ind-{name}-{rep}",
                                  env)
                    baselines[name].append(r)
                    print(f"[{rep + 1}/{args.repeats}] L={baseline_layers:3d} {name}: first call "
                          f"{r['first_call_s']:7.1f} s  compiled {r['compiled']:3d}  correct {r['correct']}",
                          flush=True)
            for n in layers:
                cfg = {**base_cfg, "layers": n}
                sw_cache = tmp_path / f"sw-{n}-{rep}"
                for name, extra in runs_of.items():  # (cold_workers: a shapewise cache of its own, empty)
                    cache = tmp_path / f"sw-{n}-workers-{rep}" if name == "cold_workers" else \
                        tmp_path / f"sw-{n}-ws-{rep}" if name in ("cold_ws", "warm_ws") else sw_cache
                    r = run_child({**cfg, **extra, "run": name}, cache,
                                  tmp_path / f"inductor-{n}-{inductor_of.get(name, name)}-{rep}")
                    samples[n][name].append(r)
                    print(f"[{rep + 1}/{args.repeats}] L={n:3d} {name:9s} first call {r['first_call_s']:7.1f} s  "
                          f"compiled {r['compiled']:3d}  workers {r.get('worker', 0):3d}  reused {r['reused']:3d}  "
                          f"cache {r['cache']:3d}  "
                          f"correct {r['correct']}", flush=True)
        for n in layers:
            results["runs"].append({"layers": n, **{k: _median(v) for k, v in samples[n].items()},
                                    "samples": samples[n]})
        for name, got in baselines.items():
            if got:
                results[name] = {"layers": baseline_layers, **_median(got), "samples": got}
    runs = results["runs"]
    small, big = runs[0], runs[-1]
    worst = max(r["warm"]["first_call_s"] / r["cold"]["first_call_s"] for r in runs)
    worst_plus = max(r["warm_plus"]["first_call_s"] / r["cold"]["first_call_s"] for r in runs)
    ratio = big["cold"]["first_call_s"] / small["cold"]["first_call_s"]
    results["targets"] = {"warm_le_10pct": worst <= 0.10, "worst_warm_ratio": worst,
                          "worst_warm_plus_ratio": worst_plus, "big_layers": big["layers"],
                          "small_layers": small["layers"], "big_over_small": ratio, "big_le_1_3x": ratio <= 1.3}
    results["all_correct"] = all(x["correct"] for r in runs for k in runs_of for x in r["samples"][k]) and \
        all(results.get(k, {}).get("correct", True) for k in ("no_dedupe", "no_dedupe_no_inductor_cache"))
    stem = out_dir / f"cold_start_{args.device}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    stem.with_suffix(".md").write_text(table(results))
    print(table(results))
    print(f"wrote {stem}.json and {stem}.md")
    return 0 if results["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
