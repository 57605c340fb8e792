"""Your own rewrites, per piece and per size, with torch's own matchers.

Two passes on a toy MLP block split at an attention op:
- ``TanhGelu`` (a ``sw.GraphPass``, ``torch.fx.subgraph_rewriter``): at decode sizes (up to
  ``max_tokens`` tokens) the exact GELU becomes its tanh approximation; larger sizes keep erf.
- ``TwiceIsAdd`` (a ``sw.InductorPass``, Inductor's pattern matcher): in Inductor's post-grad
  graph of the variants it applies to, ``x * 2`` becomes ``x + x``.
The report shows which variant got which pass; every variant is checked against eager (the tanh
GELU within its approximation error, the rest to float32 rounding).

    python examples/graph_passes.py
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.fx import subgraph_rewriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shapewise as sw  # noqa: E402
from shapewise.models import ATTENTION_OP  # noqa: E402


def _exact(x):
    return F.gelu(x)


def _tanh(x):
    return F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class TanhGelu(sw.GraphPass):
    """Exact GELU -> tanh GELU where every size is at most ``max_tokens`` (decode)."""

    name: ClassVar[str] = "tanh_gelu"
    max_tokens: int = 4

    def applies(self, sizes: sw.passes.Sizes) -> bool:
        return all(isinstance(v, int) and v <= self.max_tokens for v in sizes.values())

    def rewrite(self, gm: torch.fx.GraphModule, sizes: sw.passes.Sizes) -> sw.PassResult:
        return sw.PassResult(gm, bool(subgraph_rewriter.replace_pattern(gm, _exact, _tanh)))


@dataclass(frozen=True)
class TwiceIsAdd(sw.InductorPass):
    """``x * 2`` -> ``x + x`` in Inductor's post-grad graph (Inductor's pattern matcher)."""

    name: ClassVar[str] = "twice_is_add"
    replaced: list = field(default_factory=list, compare=False, repr=False)

    def rewrite(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

        patterns = PatternMatcherPass()
        register_replacement(lambda x: x * 2.0, lambda x: x + x, [torch.empty(8)], fwd_only, patterns)
        self.replaced.append(patterns.apply(graph))


class Block(torch.nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(x.shape[0], 4, -1)
        a = torch.ops.shapewise_toy.attention(h, h, h).reshape(x.shape[0], -1)
        return self.down(F.gelu(self.up(a))) * 2.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = Block().eval()
    twice = TwiceIsAdd()
    fast = sw.compile(model, sizes=[1, 2, 4, 16], ranges=[(17, 64)], splitting_ops=[ATTENTION_OP],
                      backend=args.backend, graph_passes=[TanhGelu(max_tokens=4)],
                      inductor_passes=[twice] if args.backend == "inductor" else [], cache=False)
    errors = {}
    with torch.no_grad():
        for n in (1, 2, 4, 16, 17, 40, 64):
            x = torch.randn(n, 32)
            out, ref = fast(x), model(x)
            errors[n] = float((out - ref).abs().max())
    print(fast.report())
    for n, e in errors.items():
        print(f"n={n:3}: max abs error vs eager {e:.2e}")
    return {"errors": errors, "rows": list(fast.report()), "inductor_replacements": list(twice.replaced),
            "traces": fast.traces}


if __name__ == "__main__":
    main()
