"""Device script: shapewise's decode attention kernel against SDPA at decode shapes, inside CUDA graphs.

Per (query heads, KV heads, cached tokens): 16 calls back to back in one CUDA graph, each on its own
keys and values (16 layers' caches, so L2 does not serve them), replayed 50 times; µs per call, median of
5 rounds. Contenders: SDPA on the repeated cache (what transformers runs: ``repeat_kv`` then SDPA, the
repeat timed with it), SDPA on the grouped rows (``GroupedDecodeAttention(attention="sdpa")``), and
``shapewise::decode_attention`` with the plan's slices and with 1, 2, 3, 4, 8 and 16 slices of S.

    PYTHONPATH=. python3 benchmarks/device/decode_attention_plans.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shapewise.library.kernels.decode_attention import _launch, _sms, decode_attention_plan  # noqa: E402

LAYERS, REPLAYS, ROUNDS = 16, 50, 5


def graphed_us(fn) -> float:
    fn()  # compile / warm up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPLAYS / LAYERS)
    return round(statistics.median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sms = _sms(torch.cuda.current_device())
    rows = []
    for hq, hkv, s, d in [(32, 8, 384, 64), (32, 8, 1024, 64), (32, 8, 4096, 64), (32, 8, 384, 128),
                          (32, 8, 4096, 128)]:
        n = hq // hkv
        q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        rows_q = q.reshape(1, hkv, n, d)
        ks = [torch.randn(1, hkv, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        vs = [torch.randn(1, hkv, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        mask = torch.ones(1, 1, 1, s, device="cuda", dtype=torch.bool)
        mask[..., s // 2:] = False  # half the cache still empty

        def repeat(t):
            return t[:, :, None].expand(1, hkv, n, s, d).reshape(1, hq, s, d)

        row = {"query_heads": hq, "kv_heads": hkv, "tokens": s, "head_dim": d,
               "plan_slices": decode_attention_plan(1, hkv, s, sms)[0],
               "sdpa_repeated_us": graphed_us(lambda: [F.scaled_dot_product_attention(q, repeat(k), repeat(v),
                                                                                     attn_mask=mask)
                                                       for k, v in zip(ks, vs)]),
               "sdpa_grouped_us": graphed_us(lambda: [F.scaled_dot_product_attention(rows_q, k, v, attn_mask=mask)
                                                      for k, v in zip(ks, vs)]),
               "kernel_plan_us": graphed_us(lambda: [_launch(rows_q, k, v, mask, None, sms) for k, v in zip(ks, vs)])}
        for parts in (1, 2, 3, 4, 8, 16):
            row[f"kernel_{parts}_slices_us"] = graphed_us(
                lambda parts=parts: [_launch(rows_q, k, v, mask, None, sms, parts) for k, v in zip(ks, vs)])
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_attention_plans.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
