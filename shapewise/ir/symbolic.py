"""Symbolic helpers over sympy sizes: evaluate an expression at sizes, print a range, choose a
range's representative size. Pure functions; the IR and every stage use these one copies."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import sympy

__all__ = ["INT_MAX", "evaluate", "range_hint", "range_text"]

#: The open end of a range (``(65, INT_MAX)`` is 65 and up).
INT_MAX = 2**63 - 1


def evaluate(expr: Any, values: Mapping[sympy.Symbol, int]) -> int:
    """Evaluate an integer sympy expression (torch's FloorDiv, Mod, ... included) at ``values``."""
    if isinstance(expr, int):
        return expr
    out = sympy.sympify(expr).xreplace({s: sympy.Integer(v) for s, v in values.items()})
    if out.free_symbols:
        missing = ", ".join(sorted(str(s) for s in out.free_symbols))
        raise KeyError(f"no value for symbol(s) {missing} in {expr}")
    return int(out)


def range_text(lo: Any, hi: Any, sep: str = ", ", brackets: str = "[]") -> str:
    """``[2, inf]`` (``hi`` None or INT_MAX is open); ``range_text(6, 9, "..", "")`` is ``6..9``."""
    top = "inf" if hi is None or (isinstance(hi, int) and hi >= INT_MAX) else hi
    body = f"{lo}{sep}{top}"
    return f"{brackets[0]}{body}{brackets[1]}" if brackets else body


def range_hint(lo: int, hi: int, traced: int | None) -> int:
    """A representative value to trace a range with: the traced size if it lies inside,
    else the geometric middle; never 0 or 1 (they would be specialised)."""
    if traced is not None and lo <= traced <= hi and traced >= 2:
        return traced
    mid = int(math.sqrt(max(lo, 2) * min(hi, 8192)))
    return min(max(mid, lo, 2), hi)
