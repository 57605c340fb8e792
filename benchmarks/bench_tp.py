"""Tensor parallel on one host: a Llama-7B-sized ``TPLlama`` stack at TP=1 and TP=2, in one run.

Per world size (1 rank on one GPU, then 2 ranks on two GPUs, NCCL), in fresh processes with
empty caches, each rank:
  1. builds the single-process model (same seed everywhere, so the same weights), runs it
     eagerly at every token count (the TP=1 reference), then keeps its shard
     (``TPLlama.shard``) and runs that eagerly too;
  2. cold start: ``sw.compile(shard, sizes=tokens, cache=<one folder every rank shares>,
     cudagraphs=<--sw-mode>)`` and a first answer at every token count; times from the launch
     and from the ``sw.compile`` call, and the report (which rank compiled which artifact);
  3. per-forward time of shapewise, of eager, and of ``torch.compile(mode="reduce-overhead",
     dynamic=False)`` (compiled here, cold too: its first calls are timed), each checked
     against the TP=1 eager reference and against eager at this world size.

Timing: CUDA events around each forward of ``--iters`` back-to-back forwards, ``--rounds``
rounds after ``--warmup`` calls, a barrier before each round so the ranks time the same
forwards; the median over all forwards (rank 0's, and the largest of the ranks'). Caches:
one empty shapewise folder per world size, shared by its ranks; an empty Inductor and Triton
cache per rank (so what the ranks share is shapewise's doing). Each rank sees one GPU
(``CUDA_VISIBLE_DEVICES``; shapewise's keys name the device index, so ranks on ``cuda:0``
and ``cuda:1`` would not share artifacts). Writes ``results.json`` (after every step, so a
run cut short leaves what it measured) and ``table.md`` to ``--out``.

    PYTHONPATH=. python benchmarks/bench_tp.py --out /tmp/tp               # 2 GPUs, ~5 min
    PYTHONPATH=. python benchmarks/bench_tp.py --out /tmp/tp --quick       # 4 sizes, 2 layers
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --out /tmp/tp       # one world size
    python benchmarks/bench_tp.py --device cpu --tiny --out /tmp/tp-cpu    # smoke test (gloo)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Nothing here touches CUDA at import (CUDA_VISIBLE_DEVICES is set per rank before CUDA starts).
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from hardware import cpu_name  # noqa: E402

from shapewise.library.kernels.gemv import tuning_stats as gemv_tuning_stats  # noqa: E402
from shapewise.models import ATTENTION_OP as ATTN  # noqa: E402
from shapewise.models import TPLlama  # noqa: E402

__all__ = ["main"]

T0 = float(os.environ.get("BENCH_TP_T0", time.time()))  # the parent's clock, so every line's +s agrees


# -- configuration ------------------------------------------------------------------------------

FULL = {"dim": 4096, "heads": 32, "hidden": 11008, "vocab": 32000}
TINY = {"dim": 64, "heads": 4, "hidden": 128, "vocab": 128}
TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for results.json, table.md and the logs")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true",
                    help="tiny dims, 2 layers, tokens 1,4,16, float32 (with --device cpu: the gloo smoke test)")
    ap.add_argument("--quick", action="store_true", help="tokens 1,16,256,4096 and 2 layers")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --quick/--tiny 2)")
    ap.add_argument("--tokens", default=None, help=f"token counts (default {TOKENS})")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 32000, Llama-7B's; --tiny 128)")
    ap.add_argument("--worlds", default="1,2", help="world sizes to run, in order (default 1,2)")
    ap.add_argument("--sw-mode", default=None,
                    help="shapewise cudagraphs: full (default on CUDA), piecewise, full_and_piecewise, none "
                         "(default on CPU)")
    ap.add_argument("--sw-capture", default="first_call", choices=("first_call", "startup"),
                    help="when shapewise captures: a size's second call (default) or every size on the first call")
    ap.add_argument("--sw-full-up-to", type=int, default=None,
                    help="full_and_piecewise: the largest size captured whole (default: shapewise's)")
    ap.add_argument("--decode-gemv", type=int, default=0, metavar="MAX_TOKENS",
                    help="add sw.library.DecodeGemv(max_tokens=MAX_TOKENS) to shapewise (0: off, the default)")
    ap.add_argument("--overlap", type=int, default=0, metavar="MIN_TOKENS",
                    help="add sw.library.OverlapAllReduce(chunks=--overlap-chunks, min_tokens=MIN_TOKENS) to shapewise "
                         "(0: off, the default)")
    ap.add_argument("--overlap-chunks", type=int, default=4, help="OverlapAllReduce's chunks (default 4)")
    ap.add_argument("--backend", default="inductor", help="shapewise backend (inductor; aot_eager for a fast smoke)")
    ap.add_argument("--contenders", default="shapewise,eager,reduce-overhead",
                    help="comma list (shapewise always runs: it is the cold start)")
    ap.add_argument("--warmup", type=int, default=5, help="calls per size before timing (the first ones capture)")
    ap.add_argument("--iters", type=int, default=20, help="forwards per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, a barrier before each")
    ap.add_argument("--tol", type=float, default=None, help="relative L2 tolerance (default 2e-2 bf16, 1e-4 fp32)")
    ap.add_argument("--no-isolate", dest="isolate", action="store_false",
                    help="let every rank see every GPU (rank r on cuda:r; shapewise's keys then differ per rank)")
    ap.add_argument("--phase-timeout", type=float, default=270.0, help="seconds per world size before its ranks are "
                                                                       "killed (what they wrote is kept)")
    ap.add_argument("--work", default=None, help="folder for the caches (default: a fresh temp folder, removed)")
    ap.add_argument("--keep-work", action="store_true", help="keep the cache folders")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    dims = dict(TINY if args.tiny else FULL)
    if args.vocab:
        dims["vocab"] = args.vocab
    args.dims = dims
    args.layers = args.layers or (2 if args.tiny or args.quick else 4)
    default_tokens = "1,4,16" if args.tiny else ("1,16,256,4096" if args.quick else TOKENS)
    args.token_list = sorted({int(t) for t in (args.tokens or default_tokens).split(",") if t})
    args.world_list = [int(w) for w in args.worlds.split(",") if w]
    args.sw_mode = args.sw_mode or ("none" if cpu else "full")
    if cpu and args.sw_mode != "none":
        ap.error("CUDA graphs need --device cuda: use --sw-mode none on CPU")
    args.dtype = "float32" if cpu or args.tiny else "bfloat16"
    args.tol = args.tol or (2e-2 if args.dtype == "bfloat16" else 1e-4)
    args.contender_list = [c for c in args.contenders.split(",") if c]
    return args


def cudagraphs_option(args: argparse.Namespace) -> Any:
    """``--sw-mode`` (and ``--sw-capture``, ``--sw-full-up-to``) as ``sw.compile``'s ``cudagraphs``:
    none -> False, piecewise -> True, else the mode's name, or a dict when the other two are given."""
    if args.sw_mode == "none":
        return False
    extra = {k: v for k, v in (("capture", args.sw_capture), ("full_up_to", args.sw_full_up_to))
             if v is not None and (k, v) != ("capture", "first_call")}
    if extra:
        return {"mode": args.sw_mode, **extra}
    return True if args.sw_mode == "piecewise" else args.sw_mode


def log(tag: str, msg: str) -> None:
    now = datetime.datetime.now().strftime("%H:%M:%S")
    sys.stdout.write(f"[{now} +{time.time() - T0:6.1f}s {tag}] {msg}\n")  # one write: ranks share stdout
    sys.stdout.flush()


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


# -- one rank -------------------------------------------------------------------------------------

class Rank:
    """One rank's run: its result dict, written to ``rank<r>.json`` after every step."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, phase_dir: Path, sw_cache: Path) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.phase_dir, self.sw_cache = phase_dir, sw_cache
        self.tag = f"tp{world} r{rank}"
        self.cuda = args.device == "cuda"
        self.result: dict[str, Any] = {"rank": rank, "world_size": world, "pid": os.getpid(), "status": "started",
                                       "contenders": {}, "errors": []}
        launch = os.environ.get("BENCH_TP_LAUNCH")
        self.launch = float(launch) if launch else None

    def save(self) -> None:
        write_json(self.phase_dir / f"rank{self.rank}.json", self.result)

    def since_launch(self) -> float | None:
        return time.time() - self.launch if self.launch else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    # -- timing ------------------------------------------------------------------------------
    def time_forward(self, fn: Callable[[], Any]) -> dict[str, float]:
        """Per-forward microseconds: median (and min, p90) over rounds x iters forwards."""
        a = self.args
        for _ in range(a.warmup):
            fn()
        self.sync()
        samples: list[float] = []
        for _ in range(a.rounds):
            self.barrier()
            if self.cuda:
                events = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters + 1)]
                events[0].record()
                for i in range(a.iters):
                    fn()
                    events[i + 1].record()
                torch.cuda.synchronize()
                samples += [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(a.iters)]
            else:
                for _ in range(a.iters):
                    t0 = time.perf_counter()
                    fn()
                    samples.append((time.perf_counter() - t0) * 1e6)
        samples.sort()
        return {"median": statistics.median(samples), "min": samples[0],
                "p90": samples[min(len(samples) - 1, int(0.9 * len(samples)))], "n": len(samples)}

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> None:
        a, r = self.args, self.result
        import shapewise as sw

        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        dtype = getattr(torch, a.dtype)
        r["device"] = str(device)
        r["device_name"] = torch.cuda.get_device_name(device) if self.cuda else platform.processor() or "cpu"
        r["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        r["start_s_since_launch"] = self.since_launch()
        torch.set_grad_enabled(False)
        for name in ("recompile_limit", "cache_size_limit"):  # 13 sizes, dynamic=False: 13 graphs
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)

        # 1. The single-process model, its eager answers (the TP=1 reference), this rank's shard.
        t = time.perf_counter()
        d = a.dims
        torch.manual_seed(0)  # every rank, and the TP=1 process, build the same weights
        with torch.device(device):
            full = TPLlama(a.layers, d["dim"], d["heads"], d["hidden"], d["vocab"], world=1)
        full = full.to(dtype).eval().requires_grad_(False)
        ids = {n: torch.randint(0, d["vocab"], (n,), generator=torch.Generator().manual_seed(n)).to(device)
               for n in a.token_list}
        refs = {n: full(x) for n, x in ids.items()}
        if self.world > 1:
            with torch.device(device):
                part = TPLlama.shard(full, self.rank, self.world)
            part = part.to(dtype).eval().requires_grad_(False)
            del full
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        else:
            part = full
        eager_out = {}
        for n, x in ids.items():
            y = part(x)
            eager_out[n] = y
            r.setdefault("eager_vs_tp1_eager", {})[n] = rel_err(y, refs[n])
        self.sync()
        r["build_and_reference_s"] = time.perf_counter() - t
        r["params_per_rank"] = sum(p.numel() for p in part.parameters())
        log(self.tag, f"model built, references computed ({r['build_and_reference_s']:.1f} s, "
                      f"{r['params_per_rank'] / 1e6:.0f}M parameters on this rank)")
        if self.world > 1 and self.cuda:
            r["all_reduce"] = self.all_reduce_bandwidth(device, dtype)
            log(self.tag, f"all-reduce of 32 MiB: {r['all_reduce']['us']:.0f} us, "
                          f"bus bandwidth {r['all_reduce']['busbw_GBps']:.0f} GB/s")
        self.save()

        def check(name: str, row: dict[str, Any], n: int, y: torch.Tensor) -> None:
            row.setdefault("err_vs_tp1_eager", {})[n] = rel_err(y, refs[n])
            row.setdefault("err_vs_eager", {})[n] = rel_err(y, eager_out[n])

        def first_calls(name: str, row: dict[str, Any], call: Callable[[torch.Tensor], torch.Tensor]) -> None:
            """The first call at every size (compiles, captures), each timed and checked."""
            for n, x in ids.items():
                t1 = time.perf_counter()
                y = call(x)
                self.sync()
                row["first_call_s"][n] = time.perf_counter() - t1
                check(name, row, n, y)
                del y

        # 2. Cold start: shapewise, every size, one cache folder for every rank.
        mode = cudagraphs_option(a)
        name = f"shapewise {a.sw_mode}" + (f"+DecodeGemv({a.decode_gemv})" if a.decode_gemv else "") + (
            f"+Overlap({a.overlap_chunks}@{a.overlap})" if a.overlap else "")
        passes = [sw.library.DecodeGemv(max_tokens=a.decode_gemv)] if a.decode_gemv else []
        if a.overlap:
            passes.append(sw.library.OverlapAllReduce(chunks=a.overlap_chunks, min_tokens=a.overlap))
        row: dict[str, Any] = {"us": {}, "first_call_s": {}}
        r["contenders"][name] = row
        self.barrier()
        t0 = time.perf_counter()
        try:
            fast = sw.compile(part, sizes=a.token_list, splitting_ops=[ATTN], backend=a.backend, cudagraphs=mode,
                              cache=str(self.sw_cache), progress=False, graph_passes=passes)
            first_calls(name, row, fast)
            ready = time.perf_counter()
            row["compile_s"] = ready - t0
            cold = {"compile_to_ready_s": ready - t0, "launch_to_ready_s": self.since_launch(),
                    "first_call_s": row["first_call_s"][a.token_list[0]]}
            cold.update(self.report_summary(fast))
            r["cold_start"] = cold
            log(self.tag, f"{name}: cold start {cold['compile_to_ready_s']:.1f} s from sw.compile "
                          f"({cold['compiled']} artifacts compiled here, {cold['loaded']} loaded, "
                          f"traces {cold['traces']}); max error vs TP=1 eager "
                          f"{max(row['err_vs_tp1_eager'].values()):.1e}")
            self.save()
            self.time_all(name, row, ids, lambda x: fast(x))
        except Exception as e:  # noqa: BLE001 - recorded, and the other contenders still run
            self.failed(name, row, e)
        fast = None
        self.reset()

        # 3. The others: eager, then torch.compile reduce-overhead (cold: its first calls are timed).
        if "eager" in a.contender_list:
            row = {"us": {}}
            r["contenders"]["eager"] = row
            for n in a.token_list:
                row.setdefault("err_vs_tp1_eager", {})[n] = r["eager_vs_tp1_eager"][n]
                row.setdefault("err_vs_eager", {})[n] = 0.0
            self.time_all("eager", row, ids, lambda x: part(x))
        if "reduce-overhead" in a.contender_list:
            if self.cuda:
                name = "reduce-overhead"
                compiled = torch.compile(part, mode="reduce-overhead", dynamic=False)

                def call(x: torch.Tensor) -> torch.Tensor:
                    torch.compiler.cudagraph_mark_step_begin()  # the last call's outputs are not read again
                    return compiled(x)
            else:  # no CUDA graphs on CPU: plain dynamic=False with the same backend
                name = "torch.compile dynamic=False"
                compiled = torch.compile(part, dynamic=False, backend=a.backend)
                call = compiled
            row = {"us": {}, "first_call_s": {}}
            r["contenders"][name] = row
            self.barrier()
            t0 = time.perf_counter()
            try:
                first_calls(name, row, call)
                row["compile_s"] = time.perf_counter() - t0
                if self.cuda:  # Inductor's own count of graphs it chose not to capture (0: all captured)
                    from torch._dynamo.utils import counters

                    row["cudagraph_skips"] = int(counters["inductor"].get("cudagraph_skips", 0))
                log(self.tag, f"{name}: compiled and answered every size in {row['compile_s']:.1f} s"
                              + (f", CUDA graph skips {row['cudagraph_skips']}" if self.cuda else ""))
                self.save()
                self.time_all(name, row, ids, call)
            except Exception as e:  # noqa: BLE001
                self.failed(name, row, e)
            compiled = call = None
            self.reset()
        r["status"] = "done"
        r["total_s_since_launch"] = self.since_launch()
        self.save()

    def time_all(self, name: str, row: dict[str, Any], ids: dict[int, torch.Tensor],
                 fn: Callable[[torch.Tensor], Any]) -> None:
        for n, x in ids.items():
            stats = self.time_forward(lambda x=x: fn(x))
            row["us"][n] = stats["median"]
            row.setdefault("us_min", {})[n] = stats["min"]
            row.setdefault("us_p90", {})[n] = stats["p90"]
            err = row.get("err_vs_tp1_eager", {}).get(n, math.nan)
            log(self.tag, f"{name:28s} T={n:5d} {stats['median']:10.1f} us  err vs TP=1 eager {err:.1e}")
            self.save()

    def failed(self, name: str, row: dict[str, Any], e: BaseException) -> None:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
        self.result["errors"].append({"contender": name, "traceback": traceback.format_exc()[-6000:]})
        log(self.tag, f"{name}: FAILED {row['error']}")
        traceback.print_exc(limit=4, file=sys.stdout)
        self.save()

    def reset(self) -> None:
        torch._dynamo.reset()
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def report_summary(self, fast: Any) -> dict[str, Any]:
        """Who compiled what: this rank's compiled / loaded artifacts, and per artifact the
        rank the report names (the ``rank`` column when world > 1)."""
        rows = [dict(row) for row in fast.report()]
        by_artifact: dict[str, dict[str, Any]] = {}  # the row that compiled or loaded each artifact
        for row in sorted(rows, key=lambda row: row.get("source") not in ("compiled", "cache")):
            if row.get("artifact"):
                by_artifact.setdefault(row["artifact"], row)
        compiled = sorted({row["artifact"] for row in rows if row.get("source") == "compiled" and row.get("artifact")})
        loaded = sorted({row["artifact"] for row in rows if row.get("source") == "cache" and row.get("artifact")})
        owner = {art: row.get("rank", self.rank if row.get("source") == "compiled" else None)
                 for art, row in by_artifact.items()}
        try:
            stages = [rec.spec for rec in fast.runnable.trace]
        except Exception:  # noqa: BLE001 - only informative
            stages = []
        return {
            "variants": len(rows),
            "sources": dict(Counter(str(row.get("source")) for row in rows)),
            "distinct_artifacts": len(by_artifact),
            "compiled": len(compiled),
            "loaded": len(loaded),
            "compiled_by_rank": {str(k): v for k, v in sorted(Counter(str(o) for o in owner.values()).items())},
            "variant_seconds": sum(float(row.get("seconds", 0.0)) for row in rows),
            "traces": fast.traces,
            "pieces": len(fast.program.compute_pieces),
            "stages": stages,
            "capture_info": getattr(fast.runnable, "capture_info", None),  # capture="startup": time, memory
            "gemv_tuning": gemv_tuning_stats(),  # DecodeGemv's tuning in this process: shapes, compile_s, timing_s
            "rows": [{k: row.get(k) for k in ("piece", "key", "source", "artifact", "rank", "seconds")}
                     for row in rows],
        }

    def all_reduce_bandwidth(self, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
        """NCCL all-reduce of a 32 MiB tensor: microseconds and bus bandwidth (a check of the link)."""
        import torch.distributed as dist

        x = torch.ones(16 * 2**20, device=device, dtype=dtype)
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 20
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / iters
        size = x.numel() * x.element_size()
        return {"bytes": size, "us": us, "busbw_GBps": size / (us * 1e-6) * 2 * (self.world - 1) / self.world / 1e9}


def worker(args: argparse.Namespace, rank: int, world: int, local_rank: int, phase_dir: Path, sw_cache: Path) -> int:
    """One rank: CUDA device and process group, then ``Rank.run``; the process group is torn down."""
    import torch.distributed as dist

    if args.device == "cuda":
        torch.cuda.set_device(0 if args.isolate else local_rank)  # isolated: the one visible GPU
    if world > 1:
        if args.device == "cuda":
            dist.init_process_group("nccl", rank=rank, world_size=world,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world)
    bench = Rank(args, rank, world, phase_dir, sw_cache)
    try:
        bench.run()
    except Exception as e:  # noqa: BLE001 - recorded; the exit status says it too
        bench.result["status"] = "failed"
        bench.failed("setup", {}, e)
        return 1
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0


# -- the parent: fresh processes per world size ----------------------------------------------------

def hardware(args: argparse.Namespace) -> dict[str, Any]:
    cpu = cpu_name()
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": socket.gethostname(), "cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" and
        torch.cuda.is_available() else None,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    from shapewise.version import __version__

    info["shapewise"] = __version__
    # The source that ran, by content: a checkout copied over an older .git (the device machine's)
    # would report the wrong commit.
    digest = hashlib.sha256()
    for path in sorted((ROOT / "shapewise").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    info["source_sha256"] = digest.hexdigest()[:12]
    return info


def gpu_list() -> list[str]:
    """The GPUs a rank may be given: CUDA_VISIBLE_DEVICES's entries, else 0..n-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [v.strip() for v in visible.split(",") if v.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def child_env(args: argparse.Namespace, world: int, rank: int, work: Path, port: int, logs: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "BENCH_TP_ROLE": "worker", "BENCH_TP_LAUNCH": repr(time.time()), "BENCH_TP_T0": repr(T0),
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    env.update(cache_env(args, world, rank, work))
    if args.device == "cuda":
        if args.isolate:
            gpus = gpu_list()
            env["CUDA_VISIBLE_DEVICES"] = gpus[rank]
        if "NCCL_DEBUG" not in os.environ:  # which transport NCCL picked, read back by the parent
            env.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": str(logs / f"nccl-tp{world}-r{rank}.%p.log")})
    return env


def cache_env(args: argparse.Namespace, world: int, rank: int, work: Path) -> dict[str, str]:
    """Empty per-rank Inductor and Triton caches; compile threads split between the ranks."""
    ind = work / f"inductor-tp{world}-r{rank}"
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(ind), "TRITON_CACHE_DIR": str(ind / "triton-own"),
        "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS",
                                                        str(max(1, min(32, (os.cpu_count() or 1) // world)))),
        # Keep NVLink multicast off wherever it is not said otherwise.
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_phase(args: argparse.Namespace, world: int, out: Path, work: Path) -> dict[str, Any]:
    """``world`` fresh worker processes (this script, ``BENCH_TP_ROLE=worker``); kills them all
    at the phase timeout or shortly after one fails. Returns how it ended."""
    phase_dir = out / f"tp{world}"
    if phase_dir.exists():
        shutil.rmtree(phase_dir)
    phase_dir.mkdir(parents=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    for p in work.glob(f"*-tp{world}*"):
        shutil.rmtree(p, ignore_errors=True)
    sw_cache = work / f"sw-cache-tp{world}"
    sw_cache.mkdir(parents=True)
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--phase-dir", str(phase_dir),
            "--sw-cache", str(sw_cache)]
    procs = []
    t0 = time.time()
    ended, failed_at = "ok", None
    try:
        for rank in range(world):
            err = open(logs / f"tp{world}-r{rank}.stderr.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(argv, env=child_env(args, world, rank, work, port, logs), cwd=ROOT,
                                           stderr=err), err))
        log("parent", f"TP={world}: started {world} rank(s) (pids {[p.pid for p, _ in procs]}), "
                      f"timeout {args.phase_timeout:.0f} s")
        while True:
            codes = [p.poll() for p, _ in procs]
            if all(c is not None for c in codes):
                if any(c != 0 for c in codes):
                    ended = f"exit codes {codes}"
                break
            if any(c not in (None, 0) for c in codes) and failed_at is None:
                failed_at = time.time()
            if failed_at is not None and time.time() - failed_at > 30:
                ended = f"a rank failed (exit codes {codes}); the others were killed"
                break
            if time.time() - t0 > args.phase_timeout:
                ended = f"timed out after {args.phase_timeout:.0f} s; killed"
                break
            time.sleep(0.5)
    finally:  # also on an exception or a signal here: no rank outlives its phase
        for p, err in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            err.close()
    wall = time.time() - t0
    log("parent", f"TP={world}: {ended} after {wall:.0f} s")
    if ended != "ok":
        for rank in range(world):
            tail = (logs / f"tp{world}-r{rank}.stderr.log").read_text(errors="replace")[-3000:]
            print(f"--- tail of logs/tp{world}-r{rank}.stderr.log ---\n{tail}", flush=True)
    return {"ended": ended, "wall_s": wall, "nccl_transports": nccl_transports(logs, world)}


def nccl_transports(logs: Path, world: int) -> list[str]:
    """The distinct 'via ...' transports NCCL logged for this world size (P2P/CUMEM, SHM, NET...)."""
    seen: dict[str, None] = {}
    for f in sorted(logs.glob(f"nccl-tp{world}-r*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if " via " in line:
                seen[line.split(" via ", 1)[1].strip()] = None
    return list(seen)


# -- aggregation: rank files -> results.json and table.md ------------------------------------------

def load_phases(out: Path) -> dict[int, dict[str, Any]]:
    phases: dict[int, dict[str, Any]] = {}
    for d in sorted(out.glob("tp*")):
        if not d.is_dir() or not d.name[2:].isdigit():
            continue
        world = int(d.name[2:])
        ranks = []
        for r in range(world):
            f = d / f"rank{r}.json"
            try:
                ranks.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                ranks.append({"rank": r, "status": "no result", "contenders": {}})
        phases[world] = {"world_size": world, "ranks": ranks}
    return phases


def _num(d: dict, n: int) -> float | None:
    """d[n] where JSON made the int keys strings."""
    v = d.get(str(n), d.get(n)) if d else None
    return None if v is None else float(v)


def summarize(phases: dict[int, dict[str, Any]], tokens: list[int], tol: float) -> dict[str, Any]:
    forward: dict[str, dict[str, dict[str, Any]]] = {}
    errors: dict[str, dict[str, dict[str, Any]]] = {}
    cold: dict[str, Any] = {}
    for world, ph in phases.items():
        ranks = ph["ranks"]
        names = list(dict.fromkeys(n for rk in ranks for n in rk.get("contenders", {})))
        for name in names:
            rows = [rk.get("contenders", {}).get(name, {}) for rk in ranks]
            f = forward.setdefault(name, {}).setdefault(f"tp{world}", {})
            e = errors.setdefault(name, {}).setdefault(f"tp{world}", {})
            for n in tokens:
                us = [_num(row.get("us", {}), n) for row in rows]
                if us[0] is not None:
                    f[str(n)] = {"rank0_us": us[0], "max_over_ranks_us": max(u for u in us if u is not None),
                                 "ranks_reporting": sum(u is not None for u in us)}
                er = [_num(row.get("err_vs_tp1_eager", {}), n) for row in rows]
                ee = [_num(row.get("err_vs_eager", {}), n) for row in rows]
                if any(x is not None for x in er):
                    e[str(n)] = {"vs_tp1_eager": max(x for x in er if x is not None),
                                 "vs_eager_same_tp": max((x for x in ee if x is not None), default=None)}
            fails = [row["error"] for row in rows if row.get("error")]
            if fails:
                f["error"] = fails[0]
            comp = [row.get("compile_s") for row in rows if row.get("compile_s") is not None]
            if comp:
                f["compile_and_first_calls_s_max_over_ranks"] = max(comp)
        cs = [rk.get("cold_start") for rk in ranks]
        if any(cs):
            done = [c for c in cs if c]
            cold[f"tp{world}"] = {
                "ranks_reporting": len(done),
                "compile_to_ready_s": max(c["compile_to_ready_s"] for c in done),
                "launch_to_ready_s": max((c["launch_to_ready_s"] for c in done if c.get("launch_to_ready_s")),
                                         default=None),
                "first_call_s": max(c["first_call_s"] for c in done),
                "distinct_artifacts": done[0]["distinct_artifacts"],
                "compiled_per_rank": [c["compiled"] if c else None for c in cs],
                "loaded_per_rank": [c["loaded"] if c else None for c in cs],
                "compiled_by_rank_per_report": [c["compiled_by_rank"] if c else None for c in cs],
                "variants": done[0]["variants"],
                "traces_per_rank": [c["traces"] if c else None for c in cs],
                "variant_seconds_per_rank": [round(c["variant_seconds"], 2) if c else None for c in cs],
                "gemv_tuning_per_rank": [c.get("gemv_tuning") if c else None for c in cs],
                "stages": done[0].get("stages"),
            }
    summary: dict[str, Any] = {"per_forward_us": forward, "rel_l2_error": errors, "cold_start": cold}
    # Targets of issue 14.
    targets: dict[str, Any] = {}
    sw_name = next((n for n in forward if n.startswith("shapewise")), None)
    if "tp1" in cold and "tp2" in cold:
        ratio = cold["tp2"]["compile_to_ready_s"] / cold["tp1"]["compile_to_ready_s"]
        targets["cold_tp2_over_tp1"] = {"value": ratio, "target": "<= 0.6", "met": ratio <= 0.6}
    big = str(max(tokens))
    if sw_name and big in forward[sw_name].get("tp1", {}) and big in forward[sw_name].get("tp2", {}):
        ratio = forward[sw_name]["tp2"][big]["max_over_ranks_us"] / forward[sw_name]["tp1"][big]["rank0_us"]
        targets[f"tp2_over_tp1_at_{big}"] = {"value": ratio, "target": "<= 0.6", "met": ratio <= 0.6}
    ro = next((n for n in forward if n in ("reduce-overhead", "torch.compile dynamic=False")), None)
    if sw_name and ro and forward[ro].get("tp2") and forward[sw_name].get("tp2"):
        pairs = {n: (forward[sw_name]["tp2"][n]["rank0_us"], forward[ro]["tp2"][n]["rank0_us"])
                 for n in map(str, tokens) if n in forward[sw_name]["tp2"] and n in forward[ro]["tp2"]}
        worse = {n: s / o for n, (s, o) in pairs.items() if s > o}
        targets["shapewise_le_reduce_overhead_tp2"] = {
            "ratios": {n: s / o for n, (s, o) in pairs.items()}, "sizes_slower": sorted(worse, key=int),
            "met": bool(pairs) and not worse}
    if sw_name and errors.get(sw_name, {}).get("tp2"):
        worst = max(v["vs_tp1_eager"] for v in errors[sw_name]["tp2"].values())
        targets["tp2_equals_tp1_reference"] = {"max_rel_l2": worst, "tolerance": tol, "met": worst <= tol}
    all_errs = [v[k] for c in errors.values() for w in c.values() for v in w.values()
                for k in ("vs_tp1_eager", "vs_eager_same_tp") if v.get(k) is not None]
    summary["all_within_tolerance"] = bool(all_errs) and max(all_errs) <= tol
    summary["targets"] = targets
    return summary


def write_results(out: Path, meta: dict[str, Any], phase_info: dict[int, dict[str, Any]], final: bool) -> str:
    phases = load_phases(out)
    for world, info in phase_info.items():
        phases.setdefault(world, {"world_size": world, "ranks": []})["run"] = info
    cfg = meta["config"]
    summary = summarize(phases, cfg["tokens"], cfg["tolerance"])
    hw = dict(meta["env"])
    names = [rk.get("device_name") for ph in phases.values() for rk in ph["ranks"] if rk.get("device_name")]
    hw["gpu"] = names[0] if names and cfg["device"] == "cuda" else None
    hw["devices_seen"] = sorted(set(names))
    results = {**meta, "env": hw, "world_sizes": sorted(phases), "complete": final, "summary": summary,
               "phases": {f"tp{w}": phases[w] for w in sorted(phases)}}
    write_json(out / "results.json", results)
    table = markdown(results)
    (out / "table.md").write_text(table)
    return table


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(results: dict[str, Any]) -> str:
    env, cfg, s = results["env"], results["config"], results["summary"]
    fw, errs, cold = s["per_forward_us"], s["rel_l2_error"], s["cold_start"]
    worlds = [f"tp{w}" for w in results["world_sizes"]]
    m = cfg["model"]
    lines = [f"# Tensor parallel: TPLlama ({m['layers']} layers, dim {m['dim']}, hidden {m['hidden']}, {m['heads']} "
             f"heads, vocab {m['vocab']}, {cfg['dtype']}) on {env.get('gpu') or env['cpu']}",
             "",
             f"torch {env['torch']}, Triton {env.get('triton')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}, "
             f"shapewise {env.get('shapewise')} (source {env.get('source_sha256')}), {env['date']}; world sizes "
             f"{results['world_sizes']}; shapewise cudagraphs={cfg['sw_mode']!r}, backend {cfg['backend']}. "
             f"{cfg['timing']}." + ("" if results["complete"] else " **Incomplete run** (see results.json)."),
             "", "## Median µs per forward (TP=2: rank 0 / slowest rank)", ""]
    names = list(fw)
    head = ["tokens"] + [f"{n} {w.upper()}" for n in names for w in worlds if w in fw[n]]
    sw_name = next((n for n in names if n.startswith("shapewise")), None)
    ro = next((n for n in names if n in ("reduce-overhead", "torch.compile dynamic=False")), None)
    if sw_name and "tp1" in fw.get(sw_name, {}) and "tp2" in fw.get(sw_name, {}):
        head.append("shapewise TP2/TP1")
    if sw_name and ro and "tp2" in fw.get(sw_name, {}) and "tp2" in fw.get(ro, {}):
        head.append(f"shapewise/{ro} TP2")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in map(str, cfg["tokens"]):
        cells = [n]
        for name in names:
            for w in worlds:
                if w not in fw[name]:
                    continue
                v = fw[name][w].get(n)
                if v is None:
                    cells.append("failed" if "error" in fw[name][w] else "—")
                elif w == "tp1":
                    cells.append(_fmt(v["rank0_us"]))
                else:
                    cells.append(f"{_fmt(v['rank0_us'])} / {_fmt(v['max_over_ranks_us'])}")
        if "shapewise TP2/TP1" in head:
            a, b = fw[sw_name]["tp2"].get(n), fw[sw_name]["tp1"].get(n)
            cells.append(_fmt(a["max_over_ranks_us"] / b["rank0_us"], ".2f") if a and b else "—")
        if f"shapewise/{ro} TP2" in head:
            a, b = fw[sw_name]["tp2"].get(n), fw[ro]["tp2"].get(n)
            cells.append(_fmt(a["rank0_us"] / b["rank0_us"], ".2f") if a and b else "—")
        lines.append("| " + " | ".join(cells) + " |")
    failures = [f"{name} {w.upper()}: {fw[name][w]['error']}" for name in names for w in worlds
                if "error" in fw[name].get(w, {})]
    if failures:
        lines += [""] + [f"- failed: {f}" for f in failures]

    lines += ["", f"## Relative L2 error (tolerance {cfg['tolerance']:g}; worst rank)", "",
              "vs TP=1 eager: against the single-process eager model; vs eager: against eager at the same TP.", ""]
    head = ["tokens"] + [f"{n} {w.upper()} vs {k}" for n in errs for w in worlds if w in errs[n]
                         for k in (("TP=1 eager",) if n == "eager" else ("TP=1 eager", "eager"))]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in map(str, cfg["tokens"]):
        cells = [n]
        for name in errs:
            for w in worlds:
                if w not in errs[name]:
                    continue
                v = errs[name][w].get(n, {})
                cells.append(_fmt(v.get("vs_tp1_eager"), ".1e"))
                if name != "eager":
                    cells.append(_fmt(v.get("vs_eager_same_tp"), ".1e"))
        lines.append("| " + " | ".join(cells) + " |")

    lines += ["", "## Cold start (fresh processes, empty caches; shapewise's folder shared by the ranks)", "",
              "| world | sw.compile to every size answered, s | launch to ready, s | first call, s | variants | "
              "distinct artifacts | compiled per rank | loaded from cache per rank | report: compiled by rank | "
              f"{ro or 'torch.compile'} compile + first calls, s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for w in worlds:
        c = cold.get(w)
        if not c:
            continue
        ro_s = fw.get(ro, {}).get(w, {}).get("compile_and_first_calls_s_max_over_ranks") if ro else None
        lines.append(f"| {w[2:]} | {_fmt(c['compile_to_ready_s'], '.1f')} | {_fmt(c['launch_to_ready_s'], '.1f')} | "
                     f"{_fmt(c['first_call_s'], '.1f')} | {c['variants']} | {c['distinct_artifacts']} | "
                     f"{c['compiled_per_rank']} | {c['loaded_per_rank']} | "
                     f"{c['compiled_by_rank_per_report'][0]} | {_fmt(ro_s, '.1f')} |")
    breakdown = [(w, c) for w, c in cold.items() if c.get("variant_seconds_per_rank")]
    if breakdown:
        lines += ["", "Where each rank's cold start went, s (variants: compile or load of every variant, the "
                  "report's seconds; DecodeGemv tuning: compiling its candidates, timing them, shapes timed here):", "",
                  "| world | rank | variants | gemv compile | gemv timing | gemv shapes timed |",
                  "|---|---|---|---|---|---|"]
        for w, c in breakdown:
            tunings = c.get("gemv_tuning_per_rank") or []
            for r, secs in enumerate(c["variant_seconds_per_rank"]):
                g = tunings[r] if r < len(tunings) and tunings[r] else {}
                lines.append(f"| {w[2:]} | {r} | {_fmt(secs, '.1f')} | {_fmt(g.get('compile_s'), '.1f')} | "
                             f"{_fmt(g.get('timing_s'), '.1f')} | {g.get('shapes', '-')} |")
    lines += ["", "## Targets (issue 14)", ""]
    for k, v in s["targets"].items():
        val = v.get("value", v.get("max_rel_l2"))
        extra = f" (slower at {v['sizes_slower']})" if v.get("sizes_slower") else ""
        lines.append(f"- {k}: {'met' if v['met'] else 'NOT met'}" + (f", {_fmt(val, '.3g')}" if val is not None
                                                                       else "") + extra)
    lines.append(f"- every error within tolerance: {s['all_within_tolerance']}")
    for w in worlds:
        run = results["phases"][w].get("run", {})
        if run:
            lines.append(f"- TP={w[2:]} phase: {run['ended']}, {run['wall_s']:.0f} s wall"
                         + (f"; NCCL transports: {', '.join(run['nccl_transports'][:4])}"
                            if run.get("nccl_transports") else ""))
        ar = [rk.get("all_reduce") for rk in results["phases"][w]["ranks"] if rk.get("all_reduce")]
        if ar:
            lines.append(f"- TP={w[2:]} all-reduce of {ar[0]['bytes'] >> 20} MiB: {ar[0]['us']:.0f} µs, "
                         f"bus bandwidth {ar[0]['busbw_GBps']:.0f} GB/s (rank 0)")
    return "\n".join(lines) + "\n"


def metadata(args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    d = args.dims
    return {
        "env": env,
        "config": {
            "device": args.device, "dtype": args.dtype, "tokens": args.token_list, "worlds": args.world_list,
            "model": {"class": "shapewise.models.TPLlama", "layers": args.layers,
                      **d, "parallelism": "qkv, gate_up column-parallel; o, down row-parallel + all-reduce; "
                                          "head vocab-parallel + all-gather; embedding, norms replicated"},
            "sw_mode": args.sw_mode, "decode_gemv": args.decode_gemv,
            "overlap_all_reduce": {"min_tokens": args.overlap, "chunks": args.overlap_chunks} if args.overlap else None,
            "cudagraphs_option": cudagraphs_option(args),
            "backend": args.backend,
            "contenders": args.contender_list, "tolerance": args.tol, "isolate_gpus": args.isolate,
            "timing": (f"{'CUDA events' if args.device == 'cuda' else 'perf_counter'} around each forward, "
                       f"{args.rounds} rounds x {args.iters} back-to-back forwards after {args.warmup} warm-up calls, "
                       "a barrier before each round; median over all forwards"),
            "cold_start": ("fresh processes; empty shapewise cache folder shared by the ranks of one world size; "
                           "empty Inductor and Triton caches per rank; compile_to_ready_s: from sw.compile to a first "
                           "answer at every token count (Dynamo trace, every compile or load, one warm-up call per "
                           "size); launch_to_ready_s: from the parent's Popen; cold start uses the same token "
                           "counts as the timing"),
            "reference": "the single-process (TP=1) model run eagerly in each rank's process, same seed and weights",
            "inductor_compile_threads_per_rank": {
                str(w): cache_env(args, w, 0, Path("."))["TORCHINDUCTOR_COMPILE_THREADS"] for w in args.world_list},
        },
    }


def torchrun_main(args: argparse.Namespace) -> int:
    """Under torchrun: this process is one rank of WORLD_SIZE; one world size per launch.
    Results merge with earlier launches into the same --out (tp1/, tp2/ folders)."""
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    args.world_list = [world]
    out = Path(args.out)
    work = Path(args.work or Path(tempfile.gettempdir()) / f"bench_tp-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
    phase_dir, sw_cache = out / f"tp{world}", work / f"sw-cache-tp{world}"
    if args.device == "cuda" and args.isolate:
        gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[local] if gpus else str(local)  # before CUDA starts
    ind = Path(cache_env(args, world, rank, work)["TORCHINDUCTOR_CACHE_DIR"])
    shutil.rmtree(ind, ignore_errors=True)
    os.environ.update(cache_env(args, world, rank, work))
    from torch._inductor import config as inductor_config  # read its threads at import: set them here too

    inductor_config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    if rank == 0:  # before init_process_group, which no rank leaves before every rank is in it
        shutil.rmtree(sw_cache, ignore_errors=True)
        shutil.rmtree(phase_dir, ignore_errors=True)
        sw_cache.mkdir(parents=True, exist_ok=True)
        phase_dir.mkdir(parents=True, exist_ok=True)
    code = worker(args, rank, world, local, phase_dir, sw_cache)
    if rank == 0:
        deadline = time.time() + 120  # the others' files (their last save ends their run)
        while time.time() < deadline and not all(
                (phase_dir / f"rank{r}.json").exists() and json.loads((phase_dir / f"rank{r}.json").read_text())
                .get("status") in ("done", "failed") for r in range(world)):
            time.sleep(0.5)
        table = write_results(out, metadata(args, hardware(args)), {}, final=True)
        print(table, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    ap_extra = argparse.ArgumentParser(add_help=False)
    ap_extra.add_argument("--phase-dir")
    ap_extra.add_argument("--sw-cache")
    extra, rest = ap_extra.parse_known_args(raw)
    args = parse_args(rest)
    args.argv = rest
    role = os.environ.get("BENCH_TP_ROLE")
    if role == "worker":  # spawned by the parent below: env names the rank and the GPU
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return worker(args, rank, world, int(os.environ["LOCAL_RANK"]), Path(extra.phase_dir), Path(extra.sw_cache))
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        return torchrun_main(args)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in ("results.json", "table.md"):
        (out / old).unlink(missing_ok=True)
    if args.device == "cuda":
        n = len(gpu_list())
        if max(args.world_list) > n:
            raise SystemExit(f"TP={max(args.world_list)} needs {max(args.world_list)} GPUs, {n} visible")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_tp-"))
    work.mkdir(parents=True, exist_ok=True)
    meta = metadata(args, hardware(args))
    log("parent", f"config: {json.dumps(meta['config'])}")

    def on_term(signum: int, frame: Any) -> None:  # a timeout's SIGTERM: stop the ranks, keep the results
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    info: dict[int, dict[str, Any]] = {}
    try:
        for world in args.world_list:
            info[world] = {"ended": "running", "wall_s": 0.0}
            info[world] = run_phase(args, world, out, work)
            write_results(out, meta, info, final=False)
    finally:
        table = write_results(out, meta, info, final=all(i["ended"] == "ok" for i in info.values())
                              and len(info) == len(args.world_list))
        if not args.keep_work and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(table, flush=True)
    log("parent", f"wrote {out / 'results.json'} and {out / 'table.md'}")
    ok = all(i["ended"] == "ok" for i in info.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
