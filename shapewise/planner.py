"""Choose a small ladder of padded sizes that wastes as little as possible.

Given observed sizes (say, sequence lengths), :func:`plan_sizes` picks at most
``K`` bucket sizes so that padding every observation up to the smallest bucket
that holds it costs the fewest padded elements, optionally plus a per-bucket
compile cost.  The optimum is exact: a dynamic programme over the sorted
candidate sizes, made fast by divide-and-conquer optimisation (the segment cost
satisfies the quadrangle inequality) and vectorised with numpy.

The ``shapewise plan`` command line is ``shapewise.plan_cli``.
"""

from __future__ import annotations

import math
import numbers
import operator
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

__all__ = ["Plan", "plan_sizes"]

_INT64_SAFE = 2**62


@dataclass(frozen=True)
class Plan:
    """A bucket ladder and what it costs.

    ``sizes`` are the chosen bucket sizes, ascending; ``served[i]`` is how many
    observations bucket ``sizes[i]`` serves and ``bucket_padding[i]`` the padded
    elements they add.  ``padding`` is the total padded elements, ``total`` the
    sum of the observed sizes (times their counts), ``waste`` is
    ``padding / (total + padding)`` and ``compile_cost`` the summed compile cost
    of the chosen sizes.
    """

    sizes: tuple[int, ...]
    padding: int
    total: int
    waste: float
    compile_cost: float
    served: tuple[int, ...]
    bucket_padding: tuple[int, ...]

    @property
    def objective(self) -> float:
        """The minimised quantity: padding plus compile cost."""
        return self.padding + self.compile_cost

    def bucket_of(self, size: int) -> int:
        """Return the smallest chosen size that holds ``size``."""
        n = _as_int(size, "size")
        if n < 1:
            raise ValueError(f"size must be a positive integer, got {n}")
        i = bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise ValueError(
                f"size {n} is larger than the largest bucket {self.sizes[-1]}; "
                f"plan with observations that include it (buckets: {list(self.sizes)})"
            )
        return self.sizes[i]

    def table(self) -> str:
        """A short human-readable table: each bucket, what it serves, its padding."""
        head = ("bucket", "served", "padding", "waste")
        rows = []
        for size, served, pad in zip(self.sizes, self.served, self.bucket_padding):
            used = size * served
            rows.append((str(size), str(served), str(pad), _pct(pad, used)))
        widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in rows]
        n = len(self.sizes)
        summary = (
            f"{n} size{'s' if n != 1 else ''}: padding {self.padding} "
            f"on {self.total} elements, waste {self.waste:.2%}"
        )
        if self.compile_cost:
            summary += f", compile cost {self.compile_cost:g}"
        lines.append(summary)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _pct(part: int, whole: int) -> str:
    return f"{part / whole:.2%}" if whole else "-"


def _as_int(value: Any, what: str) -> int:
    """Return ``value`` as a Python int, or raise TypeError naming ``what``."""
    if type(value) is int:
        return value
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(
        f"{what} must be an integer, got {value!r} ({type(value).__name__})"
    )


def _histogram(observed: Iterable[int] | Mapping[int, int]) -> dict[int, int]:
    """Validate observations and return {size: count} with positive counts."""
    if isinstance(observed, (str, bytes)):
        raise TypeError(
            "observed must be integer sizes or a {size: count} mapping, not a string"
        )
    hist: Counter[int] = Counter()
    if isinstance(observed, Mapping):
        for key, value in observed.items():
            size = _as_int(key, "an observed size")
            count = _as_int(value, f"the count for size {size}")
            if size < 1:
                raise ValueError(
                    f"observed sizes must be positive integers, got size {size}"
                )
            if count < 0:
                raise ValueError(
                    f"counts must be >= 0, got count {count} for size {size}"
                )
            if count:
                hist[size] += count
    else:
        try:
            items = list(observed)
        except TypeError:
            raise TypeError(
                "observed must be an iterable of integer sizes or a {size: count} "
                f"mapping, got {type(observed).__name__}"
            ) from None
        if not all(type(x) is int for x in items):
            items = [_as_int(x, f"observed size #{i}") for i, x in enumerate(items)]
        hist.update(items)
        if hist and min(hist) < 1:
            bad = min(hist)
            raise ValueError(
                f"observed sizes must be positive integers, got {bad} "
                f"(at position {items.index(bad)})"
            )
    if not hist:
        raise ValueError(
            "no observations: give at least one positive size "
            "(or a histogram with a positive count)"
        )
    return dict(hist)


def _cost_fn(
    compile_cost: float | Mapping[int, float] | Callable[[int], float] | None,
) -> Callable[[int], Any]:
    """Turn the ``compile_cost`` argument into a size -> raw cost function."""
    if compile_cost is None:
        return lambda size: 0
    if isinstance(compile_cost, numbers.Real) and not isinstance(
        compile_cost, (bool, np.bool_)
    ):
        if not _finite_nonneg(compile_cost):
            raise ValueError(
                f"compile_cost must be a finite number >= 0, got {compile_cost!r}"
            )
        return lambda size: compile_cost
    if isinstance(compile_cost, Mapping):
        table = compile_cost

        def lookup(size: int) -> Any:
            try:
                return table[size]
            except KeyError:
                raise ValueError(
                    f"compile_cost mapping has no entry for size {size}; give a cost "
                    "for every candidate size (or restrict candidates=...)"
                ) from None

        return lookup
    if callable(compile_cost):
        return compile_cost
    raise TypeError(
        "compile_cost must be a number, a {size: cost} mapping, a callable "
        f"size -> cost, or None; got {type(compile_cost).__name__}"
    )


def _finite_nonneg(value: numbers.Real) -> bool:
    """True if ``value`` is >= 0 and representable as a finite float."""
    try:
        return math.isfinite(float(value)) and value >= 0
    except OverflowError:
        return False


def _check_cost(value: Any, size: int) -> float | int:
    """Validate one compile cost (a finite real >= 0) and return it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"compile cost for size {size} must be a real number, got {value!r}"
        )
    if not _finite_nonneg(value):
        raise ValueError(
            f"compile cost for size {size} must be finite and >= 0, got {value!r}"
        )
    return value


def plan_sizes(
    observed: Iterable[int] | Mapping[int, int],
    max_sizes: int,
    *,
    compile_cost: float | Mapping[int, float] | Callable[[int], float] | None = None,
    candidates: Iterable[int] | None = None,
) -> Plan:
    """Pick at most ``max_sizes`` bucket sizes minimising padding (+ compile cost).

    ``observed`` is an iterable of positive int sizes or a ``{size: count}``
    histogram.  Each observation is padded to the smallest chosen size holding
    it; the largest observed size is always covered.  ``compile_cost`` (a
    constant, a ``{size: cost}`` mapping or a callable) is added per chosen
    size, so fewer sizes are chosen when one isn't worth its cost.  Sizes come
    from ``candidates`` when given (it must hold a size >= the largest
    observation), else from the distinct observed sizes.  The result is exact
    (integer arithmetic, or float64 comparisons when a compile cost is
    fractional).
    """
    k = _as_int(max_sizes, "max_sizes")
    if k < 1:
        raise ValueError(f"max_sizes must be >= 1, got {k}")
    hist = _histogram(observed)
    xs = sorted(hist)
    lo, hi = xs[0], xs[-1]

    if candidates is None:
        cands = xs
    else:
        if isinstance(candidates, (str, bytes)):
            raise TypeError("candidates must be an iterable of integer sizes")
        raw = {_as_int(c, "a candidate size") for c in candidates}
        if not raw:
            raise ValueError("candidates is empty; give at least one size")
        if min(raw) < 1:
            raise ValueError(
                f"candidate sizes must be positive integers, got {min(raw)}"
            )
        above = [c for c in raw if c >= hi]
        if not above:
            raise ValueError(
                f"candidates must include a size >= the largest observed size {hi}; "
                f"the largest candidate is {max(raw)}"
            )
        top = min(above)
        # Sizes below the smallest observation serve nothing; above ``top``
        # nothing is left to serve.  With non-negative costs neither can help.
        cands = sorted(c for c in raw if lo <= c <= top)

    cost_of = _cost_fn(compile_cost)
    costs = [_check_cost(cost_of(c), c) for c in cands]

    # Prefix sums at each candidate: W = observations <= c, S = their sizes.
    counts_at: list[int] = []
    sums_at: list[int] = []
    p, w, s = 0, 0, 0
    for c in cands:
        while p < len(xs) and xs[p] <= c:
            cnt = hist[xs[p]]
            w += cnt
            s += cnt * xs[p]
            p += 1
        counts_at.append(w)
        sums_at.append(s)

    integral = all(float(x).is_integer() for x in costs)
    bound = 4 * cands[-1] * w + sum(costs)
    if integral and bound < _INT64_SAFE:
        dtype: Any = np.int64
        costs = [int(x) for x in costs]
    elif not integral:
        dtype = np.float64
    else:
        dtype = object
        costs = [int(x) for x in costs]

    chosen_idx = _solve(cands, counts_at, sums_at, costs, k, dtype)
    sizes = tuple(cands[j] for j in chosen_idx)
    return _make_plan(
        hist, xs, sizes, fsum_cost=math.fsum(costs[j] for j in chosen_idx)
    )


def _solve(
    cands: list[int],
    counts_at: list[int],
    sums_at: list[int],
    costs: list[Any],
    k: int,
    dtype: Any,
) -> list[int]:
    """Exact DP over candidates; return indices (into ``cands``) of the ladder.

    Index 0 of the arrays below is a sentinel "nothing chosen yet" with value 0
    in every layer, so layer ``k`` holds the best cost using *at most* ``k``
    sizes with the last one at ``cands[j-1]``:

        g_k(j) = cc(j) + c_j W_j - S_j + min_{0 <= i < j} [g_{k-1}(i) + S_i - c_j W_i]

    The matrix inside the min is Monge, so leftmost argmins are monotone in
    ``j`` and each layer is solved by divide and conquer, one recursion level
    at a time with numpy.
    """
    n = len(cands)
    c = np.array([0, *cands], dtype=dtype)
    W = np.array([0, *counts_at], dtype=dtype)
    S = np.array([0, *sums_at], dtype=dtype)
    cc = np.array([0, *costs], dtype=dtype)
    base = cc + c * W - S  # the i-independent part of g_k(j)

    g = np.zeros(n + 1, dtype=dtype)
    g[1:] = base[1:]  # layer 1: one size, so i = 0
    args = [np.zeros(n + 1, dtype=np.int64)]
    for _ in range(1, min(k, n)):
        best, arg = _layer(g + S, W, c, n)
        g_new = base + best
        g_new[0] = 0
        if np.array_equal(g_new, g):
            break  # more sizes no longer help anywhere
        g = g_new
        args.append(arg)

    chosen = []
    j, layer = n, len(args) - 1
    while j:
        chosen.append(j - 1)
        j = int(args[layer][j])
        layer -= 1
    return chosen[::-1]


def _layer(
    h: np.ndarray, W: np.ndarray, c: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """For j in 1..n: min and leftmost argmin over 0 <= i < j of h[i] - c[j]*W[i]."""
    best = np.zeros(n + 1, dtype=h.dtype)
    arg = np.zeros(n + 1, dtype=np.int64)
    # One entry per open subproblem: rows jlo..jhi, argmin known in olo..ohi.
    jlo = np.array([1])
    jhi = np.array([n])
    olo = np.array([0])
    ohi = np.array([n - 1])
    while jlo.size:
        mid = (jlo + jhi) >> 1
        top = np.minimum(ohi, mid - 1)
        lengths = top - olo + 1  # >= 1 since olo < jlo <= mid
        starts = np.cumsum(lengths) - lengths
        i = np.arange(int(starts[-1] + lengths[-1])) - np.repeat(starts - olo, lengths)
        vals = h[i] - np.repeat(c[mid], lengths) * W[i]
        mins = np.minimum.reduceat(vals, starts)
        hits = np.flatnonzero(vals == np.repeat(mins, lengths))
        opt = i[hits[np.searchsorted(hits, starts)]]
        best[mid] = mins
        arg[mid] = opt
        left = jlo < mid
        right = mid < jhi
        jlo = np.concatenate((jlo[left], mid[right] + 1))
        jhi = np.concatenate((mid[left] - 1, jhi[right]))
        olo = np.concatenate((olo[left], opt[right]))
        ohi = np.concatenate((opt[left], ohi[right]))
    return best, arg


def _make_plan(
    hist: Mapping[int, int], xs: list[int], sizes: tuple[int, ...], fsum_cost: float
) -> Plan:
    """Build a Plan, computing served counts and padding exactly."""
    cnt = [0, *accumulate(hist[x] for x in xs)]
    tot = [0, *accumulate(hist[x] * x for x in xs)]
    served, pads = [], []
    prev = 0
    for size in sizes:
        end = bisect_left(xs, size + 1)  # observations <= size
        served.append(cnt[end] - cnt[prev])
        pads.append(size * served[-1] - (tot[end] - tot[prev]))
        prev = end
    padding = sum(pads)
    total = tot[-1]
    return Plan(
        sizes=sizes,
        padding=padding,
        total=total,
        waste=padding / (total + padding),
        compile_cost=float(fsum_cost),
        served=tuple(served),
        bucket_padding=tuple(pads),
    )
