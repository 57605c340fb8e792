"""Device diagnostic (issue 26): where the host time of one shapewise decode step goes, layer by
layer of the call, with the GPU idle before each call and with it busy (a ~10 ms spin kernel
queued first, so the launch meets a full queue as it does when the host runs ahead).

The model: bench_decode's Llama-3.2-1B shapes (``--layers`` of them), bf16, through
``compile_generate(static_cache=True, cudagraphs="full")``, and the decode call generate() makes
(bench_decode's ``Step``). Each layer below is timed on its own, called with the arguments the
layer above handed it in a real step (recorded once):

  step       ``model(**kwargs)``: nn.Module's call, then all below
  module     ``ShapewiseModule.__call__``: the compiled forward as generate() reaches it
  direct     the trace's generated direct call (arguments read, checks, output rebuilt)
  runnable   ``Runnable.__call__``: dispatch key, lookup, the runner
  runner     the dispatch entry (the whole-forward graph's runner: replay, outputs copied)
  graphed    ``GraphedPiece.__call__``: address checks, input copies, replay
  replay     ``CUDAGraph.replay()`` alone

Differences between neighbours are each layer's own time. Then the same layers inside real steps
issued back to back with the GPU kept ahead (``inclusive``: each layer's call wrapped and its
time added up; no synchronize before any timed call). Then the parts of the two layers that
cost the most, each timed alone (idle GPU): the graphed piece's address checks, its copy-in and
output clone; and
the direct call's generated source, run of statements by run of statements
(``direct_segments.py``). ``--profile N`` adds a cProfile table
of N whole steps (busy GPU). On the CPU (``--device cpu``, no graphs) the layers down to the
runner run, as a smoke test.

    PYTHONPATH=. python3 benchmarks/device/host_breakdown.py --out $OUT/host_breakdown.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import shapewise as sw  # noqa: E402
import shapewise.dispatch.copies as copies_mod  # noqa: E402
import shapewise.dispatch.graphed as graphed_mod  # noqa: E402
import shapewise.dispatch.runnable as runnable_mod  # noqa: E402
from benchmarks.bench_decode import Step, make_model  # noqa: E402
from benchmarks.device.direct_segments import segments, statement_costs  # noqa: E402


def host_us(fn, rewind, busy: bool, device: str, n: int) -> float:
    for _ in range(5):
        rewind()
        fn()
    samples = []
    for _ in range(n):
        rewind()
        if device == "cuda":
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(20_000_000)  # ~10 ms of spin ahead of the call
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    if device == "cuda":
        torch.cuda.synchronize()
    return round(1e6 * statistics.median(samples), 1)


def graphed_parts(piece, piece_args, rewind, device: str, n: int) -> list[dict]:
    """The graphed piece's per-replay work, each part alone."""
    out = []
    for name, check in (("fixed (and kept)", piece._fixed_check), ("kept, with strides", piece._kept_check)):
        if check is not None:
            out.append({"part": f"{name} address check ({len(check.rows)} inputs)",
                        "idle_us": host_us(lambda: check.moved(piece_args), rewind, False, device, n)})
    class NoReplay:
        def replay(self) -> None:
            pass

    graph, piece.graph = piece.graph, NoReplay()
    try:  # the whole call as a replay makes it, less the replay
        out.append({"part": "the piece's call, its replay left out",
                    "idle_us": host_us(lambda: piece(*piece_args), rewind, False, device, n)})
    finally:
        piece.graph = graph
    if piece._copy_in is not None:  # as a replay makes it: one launch for all of them
        out.append({"part": f"copy in ({len(piece.copy_slots)} tensors)",
                    "idle_us": host_us(lambda: piece._copy_in(piece_args), rewind, False, device, n)})
    out.append({"part": "clone outputs", "idle_us": host_us(lambda: copies_mod.clone_tensors(piece.outputs), rewind,
                                                             False, device, n)})
    return out


def inclusive(fast, step, device: str, steps: int, rounds: int) -> list[dict]:
    """Each layer's time inside real steps, issued back to back with the GPU kept ahead (a spin
    queued first; ``steps`` per round, under the launch queue's depth): every layer's call wrapped
    to add up its inclusive time, so a layer's own time is its row less the row below. No single
    call after a synchronize (the timings above), so no wake-up after the wait in any number."""
    import shapewise.direct as direct_mod
    import shapewise.module as module_mod

    totals: dict[str, int] = dict.fromkeys(("loop", "module", "direct calls", "direct", "runnable", "runner",
                                            "graphed", "replay"), 0)

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                totals[name] += time.perf_counter_ns() - t
        return wrapper

    patches = [(module_mod.ShapewiseModule, "__call__", "module"), (direct_mod.DirectCalls, "__call__", "direct calls"),
               (direct_mod.DirectCall, "__call__", "direct"), (runnable_mod.Runnable, "__call__", "runnable"),
               (graphed_mod.GraphedPiece, "__call__", "graphed")]
    if device == "cuda":
        patches.append((torch.cuda.CUDAGraph, "replay", "replay"))
    runnables = [r for r in fast.runnables if hasattr(r, "_exact")]
    saved = [(cls, attr, cls.__dict__[attr]) for cls, attr, _ in patches]
    exact = [(r, dict(r._exact)) for r in runnables]
    try:
        for cls, attr, name in patches:
            setattr(cls, attr, timed(name, cls.__dict__[attr]))
        for r, entries in exact:
            r._exact = {k: timed("runner", fn) for k, fn in entries.items()}
        for _ in range(rounds):
            step.rewind()
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda._sleep(40_000_000)  # ~20 ms of spin: the host stays ahead for every step
            t = time.perf_counter_ns()
            for _ in range(steps):
                step.call()
            totals["loop"] += time.perf_counter_ns() - t
            if device == "cuda":
                torch.cuda.synchronize()
    finally:
        for cls, attr, real in saved:
            setattr(cls, attr, real)
        for r, entries in exact:
            r._exact = entries
    n = steps * rounds
    names = list(totals)
    return [{"layer": name, "inclusive_us": round(totals[name] / n / 1e3, 1),
             "own_us": round((totals[name] - (totals[names[i + 1]] if i + 1 < len(names) else 0)) / n / 1e3, 1)}
            for i, name in enumerate(names)]


def record(cls, name: str, seen: dict) -> None:
    """Wrap ``cls.__call__`` to keep the first call's (self, args) under ``name``."""
    real = cls.__call__

    def spy(self, *args):
        seen.setdefault(name, (self, args))
        return real(self, *args)

    cls.__call__ = spy
    seen.setdefault("_restore", []).append((cls, real))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shape", default="1b", help="bench_decode's model shapes (1b, 8b, tiny)")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--profile", type=int, default=0)
    args = ap.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = make_model(args.shape, device, dtype, args.layers)
    fast = sw.compile_generate(model, prompt_sizes=[16], max_length=16 + 200, static_cache=True, backend="inductor",
                               cudagraphs="full" if device == "cuda" else False, progress=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device=device)
    step = Step("sw_full", model, ids, 200)
    back = step.rewind
    with torch.no_grad():
        back()
        step.call()  # captured, armed
        seen: dict = {}
        record(runnable_mod.Runnable, "runnable", seen)
        record(graphed_mod.GraphedPiece, "graphed", seen)
        back()
        step.call()
        for cls, real in seen.pop("_restore"):
            cls.__call__ = real
        runnable, run_args = seen["runnable"]
        entry = runnable._exact.get(runnable._key(run_args))
        (direct,) = [d for d in fast._directs.armed][:1]
        layers = {
            "step": step.call,
            "module": lambda: fast(**step.kwargs),
            "direct": lambda: direct((), step.kwargs),
            "runnable": lambda: runnable(*run_args),
            "runner": lambda: entry(*run_args),
        }
        if "graphed" in seen:
            piece, piece_args = seen["graphed"]
            layers["graphed"] = lambda: piece(*piece_args)
            layers["replay"] = piece.graph.replay
        rows = []
        for name, fn in layers.items():
            row = {"layer": name, "idle_us": host_us(fn, back, False, device, args.calls)}
            if device == "cuda":
                row["busy_us"] = host_us(fn, back, True, device, args.calls)
            rows.append(row)
            print(row, flush=True)
        warm = inclusive(fast, step, device, steps=10, rounds=10)
        for row in warm:
            print(row, flush=True)
        parts = []
        if "graphed" in seen:
            parts = graphed_parts(piece, piece_args, back, device, args.calls)
            for row in parts:
                print(row, flush=True)
        segs = segments(direct, (), step.kwargs, back, cuts=16, calls=max(args.calls, 500))
        costs = statement_costs(direct, (), step.kwargs, back, calls=max(args.calls, 500))
        for row in costs:
            print(row)
        for row in segs:
            print(row, flush=True)
        profile = None
        if args.profile:
            prof = cProfile.Profile()
            for _ in range(min(args.profile, step.room)):
                back()
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda._sleep(20_000_000)
                prof.enable()
                step.call()
                prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            profile = text.getvalue()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "shape": args.shape, "layers": args.layers, "direct_info": fast.direct_info, "rows": rows,
              "graphed_parts": parts, "direct_segments": segs, "direct_statements": costs, "inclusive": warm,
              "profile": profile}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if profile:
        print(profile)


if __name__ == "__main__":
    main()
