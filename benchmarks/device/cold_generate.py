"""Device script: the cold start of ``compile_generate`` on the Llama-3.2-1B shapes, one variant after
another against ``compile_workers`` processes, each in a fresh process with empty shapewise and
Inductor caches.

The child builds the model (random weights, bf16, on the GPU), calls ``sw.compile_generate(model,
prompt_sizes=SIZES, max_length=512, static_cache=True, cudagraphs="full", compile_workers=W)`` and
times its first ``generate()`` (prompt 64, 8 new tokens): both traces, the compile of the variants it
runs (with workers, the others are left to them: loaded on first use), the CUDA graph captures; then
``all_ready_s``, until every variant is ready (``fast.wait()``). It also checks the tokens against the same model's
eager ``generate()``. The parent runs the children one after another, alternating W, and writes
``cold_generate.json`` under ``--out``.

With ``--warm``: per repeat, four children in two cache folders (shapewise's and Inductor's kept
between the two children of a folder, as a user's second start has them): cold then warm without
``warm_start`` (the warm start loads the pieces' artifacts, Dynamo still traces), and cold then warm
with ``warm_start=True`` (the warm start loads the whole program: no Dynamo trace). Writes
``warm_generate.json`` (each row also has the steady decode: ``generate()`` of 32 tokens, ms a token,
and whether its calls were direct); ``--profile`` adds a cProfile of each warm start's first ``generate()``
(``warm_profile_whole.txt``, ``warm_profile_pieces.txt``).

    PYTHONPATH=. python3 benchmarks/device/cold_generate.py --out $OUT --workers 1,6 --repeats 1
    PYTHONPATH=. python3 benchmarks/device/cold_generate.py --out $OUT --workers 1,4,2,4/1  # 4/1: 1 thread a worker
    PYTHONPATH=. python3 benchmarks/device/cold_generate.py --out $OUT --workers 1,1+sdpa,1+sdpa:prefill
    # +sdpa: split at attention; +sdpa:prefill: the prompt trace split, decode's whole (whole_traces={"seq": 1},
    # compile_generate's default under full graphs since 2026-12-07); +none: every trace whole (splitting_ops=());
    # +default:keep, +none:keep: keep_cache=True (one static cache kept from call to call); +default:never:
    # wait_for_workers="never" (every variant a worker's, the first calls run eagerly meanwhile)
    PYTHONPATH=. python3 benchmarks/device/cold_generate.py --out $OUT --warm --profile
    PYTHONPATH=. python3 benchmarks/device/cold_generate.py --out $OUT --warm --kinds whole --parallel 6 --profile

``--cpu-layers N`` runs the same starts on this machine's CPU instead: the tiny Llama of
``bench_generate`` (hidden 64) with N layers, fp32, no CUDA graphs, but the programs the GPU's defaults
make (full graphs, FuseProjections); its graphs have as many nodes as a large model's of N layers, so the
host side of a start (tracing, keying, saving, loading) is measured.

    PYTHONPATH=. python3 benchmarks/device/cold_generate.py --out /tmp/w --warm --kinds whole --cpu-layers 16 --profile
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = (16, 32, 64, 128, 256)


def child(workers: int, warm_start: bool = False, profile: str | None = None, cpu_layers: int = 0) -> dict:
    t0 = time.perf_counter()
    if os.environ.get("BENCH_STACKS_AT"):  # every thread's stack on stderr shortly before the parent's timeout
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["BENCH_STACKS_AT"]), exit=False)

    def mark(what: str) -> None:  # progress on stderr (the parent keeps its tail when the child times out)
        print(f"[{time.perf_counter() - t0:.1f} s] {what}", file=sys.stderr, flush=True)
    import torch

    sys.path.insert(0, str(ROOT))
    import shapewise as sw
    from benchmarks.bench_generate import LLAMA_1B, TINY, llama
    from shapewise.lower import workers as worker_module

    worker_starts: list[float] = []  # when worker processes were started (s after the child's start)
    started = worker_module._Processes.__init__

    def counted(self, *args, **kwargs):
        worker_starts.append(round(time.perf_counter() - t0, 2))
        started(self, *args, **kwargs)

    worker_module._Processes.__init__ = counted
    # Each compile handed to a worker: [s after the child's start it was queued, queued first (the traced size),
    # s it was done, the worker's seconds in it, its outcome] (the critical path of a start with workers).
    tasks: list[list] = []
    submit = worker_module._Processes.submit

    def timed_submit(self, key, data, first=False):
        row = [round(time.perf_counter() - t0, 2), first, None, None, None]
        tasks.append(row)
        future = submit(self, key, data, first)

        def done(f):
            if not f.cancelled():
                _, outcome, seconds = f.result()
                row[2:] = [round(time.perf_counter() - t0, 2), round(seconds, 2), outcome[:60]]

        future.add_done_callback(done)
        return future

    worker_module._Processes.submit = timed_submit
    if os.environ.get("BENCH_WORKER_THREADS"):  # --workers W/T: Inductor's compile threads in each worker
        worker_module.worker_compile_threads = lambda n: int(os.environ["BENCH_WORKER_THREADS"])

    # Dynamo's whole traces (each symbolic run of the forward), refused ones included: 2 for compile_generate since
    # _compat.no_new_trace (3 before: the decode step's first trace, unmarked, was run and then refused)
    import torch._dynamo.symbolic_convert as symbolic_convert

    dynamo_runs: list[str] = []
    dynamo_spans: list[list[float]] = []
    run_frame = symbolic_convert.InstructionTranslator.run

    def counted_run(self, *args, **kwargs):
        dynamo_runs.append(self.f_code.co_name)
        start = time.perf_counter() - t0
        try:
            return run_frame(self, *args, **kwargs)
        finally:  # [s it started, s it took: Dynamo's trace, the backend (shapewise's pipeline) included]
            dynamo_spans.append([round(start, 2), round(time.perf_counter() - t0 - start, 2)])

    symbolic_convert.InstructionTranslator.run = counted_run
    device = "cpu" if cpu_layers else "cuda"
    if cpu_layers:
        model = llama(TINY, "cpu", torch.float32, cpu_layers)
    else:
        model = llama(LLAMA_1B, "cuda", torch.bfloat16)
    ids = torch.randint(0, 200, (1, 64), device=device)
    with torch.no_grad():
        model.generation_config.disable_compile = True
        eager = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               cache_implementation="static", output_logits=True, return_dict_in_generate=True)
    want = eager.sequences
    mark("eager generate() done")
    setup_s = time.perf_counter() - t0
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    # On the CPU, the programs the GPU's defaults make: full graphs, the projections fused, the input updates batched.
    cpu_as_gpu = dict(splitting_ops=(), fuse_projections=True, batch_updates=True) if cpu_layers else {}
    if os.environ.get("BENCH_SPLIT"):  # --workers W+sdpa: the graph split at these ops (full graphs: none)
        ops, *flags = os.environ["BENCH_SPLIT"].split(":")
        if ops != "default":
            cpu_as_gpu["splitting_ops"] = () if ops == "none" else tuple(ops.split("+"))
        if "prefill" in flags:  # W+sdpa:prefill: the prompt trace split, the decode trace (seq=1) whole
            cpu_as_gpu["whole_traces"] = {"seq": 1}
        if "keep" in flags:  # W+none:keep: one static cache kept from call to call (keep_cache=True)
            cpu_as_gpu["keep_cache"] = True
        if "never" in flags:  # W+default:never: the first calls eager while the workers compile every variant
            cpu_as_gpu["wait_for_workers"] = "never"
    t = time.perf_counter()
    compile_at = t - t0
    fast = sw.compile_generate(model, prompt_sizes=list(SIZES), max_length=512, static_cache=True,
                               cudagraphs=False if cpu_layers else "full", compile_workers=workers, progress=False,
                               warm_start=warm_start, **cpu_as_gpu)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    if not cpu_layers:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t
    mark(f"first generate() done ({first_s:.1f} s)")
    # With compile workers the first generate() runs once its own sizes are ready; the variants left to
    # the workers are loaded on first use. ready_s: until every variant is (wait() loads the rest).
    pending_at_first = sum(r["source"] == "pending" for r in fast.report())
    stand_ins = [v.compiled.stand_in for r in fast.runnables for p in r.program.compute_pieces for v in p.variants
                 if getattr(v.compiled, "stand_in", None) is not None]
    eager_calls = sum(s.calls for s in stand_ins)  # calls the first generate() ran eagerly (wait_for_workers="never")
    t = time.perf_counter()
    fast.wait()
    ready_s = first_s + (time.perf_counter() - t)
    mark("every variant ready")
    if prof is not None:
        import io
        import pstats

        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
        Path(profile).write_text(text.getvalue())
    # Then the steady decode: generate() of 32 new tokens, three times (median), per token, and whether
    # its calls went past Dynamo's frame (direct calls: on a warm start too, since this session).
    def timed(prompt: torch.Tensor, new: int, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` ``generate()`` calls of ``new`` tokens after ``prompt``."""
        out = []
        for _ in range(repeats):
            t = time.perf_counter()
            model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            if not cpu_layers:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
        return out

    with torch.no_grad():
        per_token = [t / 32 for t in timed(ids, 32, 3)]
        mark("decode timed")
        # the same prompt's prefill alone (one new token), median of 5: the decode per token is the rest
        first = timed(ids, 1, 5)
        if os.environ.get("BENCH_PROFILE"):  # a torch.profiler table of one generate() of 32 tokens
            _profile_generate(model, ids, os.environ["BENCH_PROFILE"], cpu_layers)
        # and the prefill of the longest prompt size: generate() of one new token (its prefill alone), median of 5
        prefill = timed(torch.randint(0, 200, (1, SIZES[-1]), device=device), 1, 5)
    rows = list(fast.report())
    graphs = [p for r in fast.runnables for p in (getattr(getattr(r.runtime, "graphs", None), "pieces", None) or ())]
    from shapewise.library.kernels.gemv import tuning_stats  # DecodeGemv's tuning in this start (compile_s, timing_s)

    sources: dict[str, int] = {}
    for r in rows:
        sources[r["source"]] = sources.get(r["source"], 0) + 1
    return {"workers": workers, "first_generate_s": round(first_s, 2), "all_ready_s": round(ready_s, 2),
            "pending_at_first_generate": pending_at_first, "eager_calls_at_first_generate": eager_calls,
            "setup_s": round(setup_s, 2),
            "variant_seconds": round(sum(r["seconds"] for r in rows), 2), "sources": sources,
            # [piece, binding, source, seconds in the session: a compile, a load, or the wait for a worker's artifact]
            "variants": [[r["piece"], r["key"], r["source"], round(r["seconds"], 2)] for r in rows],
            f"tokens_equal_eager_{'fp32' if cpu_layers else 'bf16'}": bool(torch.equal(got, want)),
            "token_check": token_check(got[0, ids.shape[1]:], want[0, ids.shape[1]:], eager.logits),
            "traces": fast.traces, "dynamo_runs": len(dynamo_runs), "dynamo_spans_s": dynamo_spans,
            "warm_start": warm_start,
            "warm_info": fast.warm_info,
            "generate_ms_per_token": round(sorted(per_token)[1] * 1e3, 3),
            f"prefill{ids.shape[1]}_ms": round(sorted(first)[2] * 1e3, 3),
            "decode_ms_per_token": round((sorted(per_token)[1] * 32 - sorted(first)[2]) / 31 * 1e3, 3),
            f"prefill{SIZES[-1]}_ms": round(sorted(prefill)[2] * 1e3, 3), "direct_info": fast.direct_info,
            "direct_calls": fast.direct_calls, "gemv_tuning": tuning_stats(),
            # CUDA graphs after every call above: captured, uncaptured (why), captured again (an input moved)
            "graphs": {"captured": sum(p.graph is not None for p in graphs),
                       "uncaptured": sorted({f"{p.name}: {p.uncaptured}" for p in graphs if p.uncaptured}),
                       "recaptures": sum(p.recaptures for p in graphs)},
            "worker_tasks": tasks, "compile_generate_at_s": round(compile_at, 2),
            "worker_starts_s": worker_starts,  # more than one: the workers were started again (their torch imports)
            "worker_compile_threads": worker_module.worker_compile_threads(workers) if workers > 1 else None,
            "splitting_ops": os.environ.get("BENCH_SPLIT", "default")}


def _profile_generate(model, ids, path: str, cpu_layers: int) -> None:
    """torch.profiler over one ``generate()`` of 32 tokens: the GPU's events (count and µs by name, the
    largest 40) and the host's top-level ops (count and self µs by name), as JSON at ``path``."""
    from collections import Counter

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([] if cpu_layers else [ProfilerActivity.CUDA])
    with torch.no_grad(), profile(activities=acts) as prof:
        model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        if not cpu_layers:
            torch.cuda.synchronize()
    gpu_n: Counter[str] = Counter()
    gpu_us: Counter[str] = Counter()
    host_n: Counter[str] = Counter()
    host_us: Counter[str] = Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu_n[e.name] += 1
            gpu_us[e.name] += e.device_time
        elif e.cpu_parent is None:
            host_n[e.name] += 1
            host_us[e.name] += e.cpu_time_total
    Path(path).write_text(json.dumps({
        "gpu_events": sum(gpu_n.values()), "gpu_us": round(sum(gpu_us.values()), 1),
        "gpu_by_name": [[n, gpu_n[n], round(t, 1)] for n, t in gpu_us.most_common(40)],
        "host_top_level_us": round(sum(host_us.values()), 1),
        "host_by_name": [[n, host_n[n], round(t, 1)] for n, t in host_us.most_common(40)]}, indent=1))


def token_check(got, want, logits) -> str:
    """The compiled generate()'s new tokens against eager's: "equal", or at the first step that differs,
    the eager logit of the token the compiled model chose below eager's best: a near-tie (bf16 greedy
    decoding of random weights flips on those: within 1% of the logits' scale + 0.02, the size of the
    compiled model's bf16 logit error) or a wrong token."""
    differ = (got != want).nonzero()
    if not len(differ):
        return "equal"
    j = int(differ[0])
    row = logits[j][0].float()
    gap, scale = float(row.max() - row[got[j]]), float(row.abs().max())
    verdict = "near-tie" if gap <= 0.01 * scale + 0.02 else "WRONG"
    return f"{verdict} at new token {j}: eager's logit of the compiled token {gap:.4f} below its best " \
           f"(scale {scale:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", default="1,4",
                    help="compile_workers per start, in order; W/T: T Inductor compile threads in each worker (else "
                         "shapewise's share of the CPUs); a suffix +op(+op...): splitting_ops=(op, ...), e.g. 1+sdpa; "
                         "+sdpa:prefill: the decode trace whole (whole_traces={'seq': 1}); +none: splitting_ops=()")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=200)
    ap.add_argument("--child", type=int, default=None)
    ap.add_argument("--warm", action="store_true", help="cold and warm starts, with and without warm_start")
    ap.add_argument("--warm-start", action="store_true", help=argparse.SUPPRESS)  # the child's
    ap.add_argument("--kinds", default="whole,pieces",
                    help="with --warm: whole (warm_start=True), pieces (warm_start=False), or both")
    ap.add_argument("--parallel", type=int, default=0,
                    help="with --warm: then one more cold start of the whole program on this many compile workers")
    ap.add_argument("--profile", action="store_true",
                    help="a cProfile of each start's first generate() under --out (with --warm: each warm start's)")
    ap.add_argument("--profile-to", default=None, help=argparse.SUPPRESS)  # the child's
    ap.add_argument("--torch-profile", action="store_true",
                    help="a torch.profiler table (GPU events, host ops) of each start's generate() of 32 tokens")
    ap.add_argument("--cpu-layers", type=int, default=0,
                    help="on the CPU: the tiny Llama with this many layers instead of the 1B on the GPU")
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.warm_start, args.profile_to, args.cpu_layers)))
        return
    if args.warm:
        return warm_main(args)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = {"gpu": _device_name(args), "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "prompt_sizes": SIZES}
    results = []
    for _ in range(args.repeats):
        for entry in args.workers.split(","):
            entry, _, split = entry.partition("+")
            w, _, threads = entry.partition("/")
            with tempfile.TemporaryDirectory() as d:
                env = _cache_env(d)
                if threads:
                    env["BENCH_WORKER_THREADS"] = threads
                if split:
                    env["BENCH_SPLIT"] = split
                if args.torch_profile:
                    tag = f"{entry}+{split}" if split else entry
                    env["BENCH_PROFILE"] = str(out / f"profile_{len(results)}_{tag}.json")
                profile_to = str(out / f"profile_cold_{len(results)}.txt") if args.profile else None
                row = _run_child(args, env, int(w), False, profile_to)
                row["worker_threads"] = threads or "auto"
                results.append(row)
                # written after every child: a run its deadline cuts short keeps what it measured
                (out / "cold_generate.json").write_text(json.dumps({**head, "rows": results}, indent=1))


def _device_name(args: argparse.Namespace) -> str:
    import platform

    import torch

    if args.cpu_layers:
        return f"CPU ({platform.processor() or platform.machine()}), tiny Llama of {args.cpu_layers} layers"
    return torch.cuda.get_device_name()


def _cache_env(folder: str) -> dict:
    """The child's environment: shapewise's and Inductor's caches in ``folder``."""
    env = {**os.environ, "SHAPEWISE_CACHE_DIR": f"{folder}/sw", "TORCHINDUCTOR_CACHE_DIR": f"{folder}/inductor",
           "PYTHONPATH": str(ROOT)}
    env.pop("SHAPEWISE_CACHE", None)
    return env


def _run_child(args: argparse.Namespace, env: dict, workers: int, warm_start: bool,
               profile_to: str | None = None) -> dict:
    t = time.perf_counter()
    env = {**env, "BENCH_STACKS_AT": str(max(1.0, args.timeout - 10))}
    cmd = [sys.executable, __file__, "--out", args.out, "--child", str(workers),
           *(["--warm-start"] if warm_start else []), *(["--profile-to", profile_to] if profile_to else []),
           "--cpu-layers", str(args.cpu_layers)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        row = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
            {"workers": workers, "warm_start": warm_start, "error": proc.stderr[-2000:]}
    except subprocess.TimeoutExpired as e:  # the child's stacks, dumped 10 s before (where it hangs, or what is slow)
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        row = {"workers": workers, "warm_start": warm_start, "error": f"timed out after {args.timeout} s",
               "stderr_tail": tail[-6000:]}
    row["process_s"] = round(time.perf_counter() - t, 2)
    print(json.dumps(row), flush=True)
    return row


def warm_main(args: argparse.Namespace) -> None:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = {"gpu": _device_name(args), "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "prompt_sizes": SIZES}
    rows: list[dict] = []
    kinds = {"whole": True, "pieces": False}
    for _ in range(args.repeats):
        for warm_start in [kinds[k] for k in args.kinds.split(",")]:
            with tempfile.TemporaryDirectory() as d:
                env = _cache_env(d)
                for start in ("cold", "warm"):
                    profile_to = str(out / f"warm_profile_{'whole' if warm_start else 'pieces'}.txt") \
                        if start == "warm" and args.profile else None
                    row = _run_child(args, env, 1, warm_start, profile_to)
                    row["start"] = start
                    rows.append(row)
                    # written after every child: a run its deadline cuts short keeps what it measured
                    (out / "warm_generate.json").write_text(json.dumps({**head, "rows": rows}, indent=1))
    if args.parallel:
        with tempfile.TemporaryDirectory() as d:
            env = _cache_env(d)
            row = _run_child(args, env, args.parallel, True)
            row["start"] = "cold"
            rows.append(row)
            (out / "warm_generate.json").write_text(json.dumps({**head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
