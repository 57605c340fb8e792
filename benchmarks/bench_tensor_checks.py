"""What a direct call's checks of a KV cache's tensors cost: the Python checks ``shapewise.direct``
generates today (per tensor: type, dtype, device, grad, rank, contiguity, fixed sizes) against one
C++ call of Dynamo's ``TensorGuards`` over all of them (sizes and strides per tensor; the stride of
a size-1 dim left unchecked, as contiguity leaves it). Both must refuse the same changed tensors.

    python3 benchmarks/bench_tensor_checks.py --out /tmp/checks.json            # CPU
    PYTHONPATH=. python3 benchmarks/bench_tensor_checks.py --device cuda --out $OUT/checks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch._C._dynamo.guards import TensorGuards


def python_checks(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    Tensor = torch.Tensor

    def check(tensors) -> bool:
        for r in tensors:
            if type(r) is not Tensor or r.dtype is not dtype or r.device != device or r.requires_grad is not False \
                    or r.dim() != len(shape) or not r.is_contiguous():
                return False
            if tuple(r.shape) != shape:
                return False
        return True

    return check


def tensor_guards(tensors: list[torch.Tensor]):
    strides = [[None if n == 1 else s for n, s in zip(t.shape, t.stride())] for t in tensors]
    guards = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                          dynamic_dims_strides=strides)
    return lambda ts: guards.check(*ts)


def median_us(fn, arg, repeats: int = 20000) -> float:
    for _ in range(200):
        fn(arg)
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeats // 5):
            fn(arg)
        rounds.append((time.perf_counter() - t) / (repeats // 5) * 1e6)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--counts", default="32,48,64")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    shape, dtype = (1, 8, 384, 64), torch.bfloat16
    rows = []
    for n in map(int, args.counts.split(",")):
        cache = [torch.randn(shape, device=device).to(dtype) for _ in range(n)]
        py, tg = python_checks(shape, dtype, cache[0].device), tensor_guards(cache)
        changed = {"same": cache, "dtype": [*cache[:-1], cache[-1].half()],
                   "shape": [*cache[:-1], cache[-1][..., :32]], "layout": [*cache[:-1], cache[-1].transpose(2, 3)],
                   "grad": [*cache[:-1], cache[-1].clone().requires_grad_()]}
        agree = {k: (py(v), tg(v)) for k, v in changed.items()}
        assert all(a == b for a, b in agree.values()), agree
        rows.append({"tensors": n, "python_us": round(median_us(py, cache), 2),
                     "tensor_guards_us": round(median_us(tg, cache), 2), "agree": agree})
        print(rows[-1])
    args.out.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
