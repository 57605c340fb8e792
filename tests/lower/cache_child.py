"""A fresh process for tests/test_cache.py: compile a built-in model with Inductor through
shapewise's artifact cache (``SHAPEWISE_CACHE_DIR``), check every answer against eager, and
print one JSON line: {"ok", "sources", "artifacts"}.

    python -m tests.lower.cache_child --model toy --layers 8 --sizes 2,4
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import shapewise as sw
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=("toy", "mlp"), default="toy")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--no-bias", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    torch.manual_seed(0)
    if args.model == "toy":
        model = ToyTransformer(layers=args.layers).eval()
        fast = sw.compile(model, sizes=sizes, splitting_ops=[ATTENTION_OP], backend="inductor", progress=False)
        inputs = [torch.randint(0, 64, (n,)) for n in sizes]
    else:
        model = MLP(bias=not args.no_bias).eval()
        fast = sw.compile(model, sizes=sizes, backend="inductor", progress=False)
        inputs = [torch.randn(n, 32) for n in sizes]
    ok = True
    with torch.no_grad():
        for x in inputs:
            ok = ok and torch.allclose(fast(x), model(x), rtol=1e-4, atol=1e-5)
    rows = fast.report()
    print(json.dumps({"ok": bool(ok), "sources": [r["source"] for r in rows],
                      "artifacts": [r["artifact"] for r in rows]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
