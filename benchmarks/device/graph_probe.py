"""Device script: which of ``compile_generate``'s CUDA graphs replay, capture again or run uncaptured over
repeated ``generate()`` calls (the Llama-3.2-1B shapes with 2 layers, bf16, static cache, full graphs), for
the default (the prompt trace split, decode whole) and for every trace whole (``splitting_ops=()``): per
graphed piece its replays since capture, captures again, why it is uncaptured, and shapewise's log lines.
Written to find why the whole program's ``generate()`` took 2.59 ms a token against 1.62 split on an H100
(2026-12-07, cold_generate's torch.profiler tables: two ~18 ms compiled calls a generate()).

    PYTHONPATH=. python3 benchmarks/device/graph_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def probe(split: bool, layers: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import shapewise as sw
    from benchmarks.bench_generate import LLAMA_1B, llama

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage()[:400])

    log = logging.getLogger("shapewise")
    log.setLevel(logging.INFO)
    handler = Keep()
    log.addHandler(handler)
    model = llama(LLAMA_1B, "cuda", torch.bfloat16, layers)
    extra = {} if split else {"splitting_ops": ()}
    fast = sw.compile_generate(model, prompt_sizes=[16, 64], max_length=512, static_cache=True, cudagraphs="full",
                               compile_workers=1, progress=False, **extra)
    ids = torch.randint(0, 200, (1, 64), device="cuda")
    per_call = []
    with torch.no_grad():
        for i in range(5):
            lines.append(f"--- generate() {i}")
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
            torch.cuda.synchronize()
            per_call.append(round((time.perf_counter() - t) * 1e3, 2))
            state = []
            for n, runnable in enumerate(fast.runnables):
                graphs = getattr(getattr(runnable, "runtime", None), "graphs", None)
                for p in (graphs.pieces if graphs is not None else []):
                    state.append([n, p.name, str(p.key), p.graph is not None, p.replays, p.recaptures,
                                  p.uncaptured, p.fallbacks, sorted(p.moved_inputs)])
            lines.append(json.dumps(state))
    log.removeHandler(handler)
    return {"split": split, "generate_ms": per_call, "log": lines}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [probe(split, args.layers) for split in (False, True)]
    (out / "graph_probe.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(r["split"], r["generate_ms"])
        for line in r["log"][-12:]:
            print("  ", line[:300])


if __name__ == "__main__":
    main()
