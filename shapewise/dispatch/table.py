"""DispatchTable: run-time sizes → the runner compiled for them, in O(1) for exact sizes and
one bisect per symbol for ranges."""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy

from shapewise.errors import ConfigError, DispatchMiss
from shapewise.ir.program import Binding, SymbolSource
from shapewise.ir.report import html_table, text_table

__all__ = ["DispatchTable", "describe_key", "key_function"]

MISS_POLICIES = ("error", "dynamic", "eager")
_MEMO_LIMIT = 4096


def key_function(sources: Sequence[SymbolSource]) -> Callable[[Sequence[Any]], tuple]:
    """A function ``args -> tuple of symbol values``, generated once (no loop per call)."""
    body = ", ".join(s.expr("args") for s in sources)
    return eval(f"lambda args: ({body}{',' if sources else ''})")  # noqa: S307 - generated from ints


def describe_key(symbols: Sequence[sympy.Symbol], names: Mapping[sympy.Symbol, str], key: tuple) -> str:
    """``{n=8}``, written as ``Binding.describe`` writes it (a shared name told apart by the symbol)."""
    return Binding(tuple(zip(symbols, key))).describe(names)


class DispatchTable:
    """Exact keys in a dict; range boxes on a grid found by per-symbol bisect.

    ``exact``: key tuple → runner. ``ranges``: (binding, runner) with inclusive bounds per
    symbol. ``miss``: called with the key when nothing covers it (raises or builds a runner).
    An exact size always wins over a range that holds it. Range hits are memoised in
    ``exact`` so the next call with that key is one dict lookup.
    """

    def __init__(
        self,
        symbols: Sequence[sympy.Symbol],
        sources: Sequence[SymbolSource],
        exact: Mapping[tuple, Callable[..., Any]],
        ranges: Sequence[tuple[Binding, Callable[..., Any]]] = (),
        names: Mapping[sympy.Symbol, str] | None = None,
        on_miss: str = "error",
        miss_runner: Callable[[tuple], Callable[..., Any]] | None = None,
        fixed: Mapping[str, int] | None = None,
    ) -> None:
        if on_miss not in MISS_POLICIES:
            raise ConfigError(f"on_miss must be one of {MISS_POLICIES}, got {on_miss!r}")
        self.symbols = tuple(symbols)
        self.names = dict(names or {})
        self.key_fn = key_function(sources)
        self.sources = tuple(sources)
        self.exact: dict[tuple, Callable[..., Any]] = dict(exact)
        self.static_keys = tuple(self.exact)
        self.range_bindings = tuple(b for b, _ in ranges)
        self.on_miss = on_miss
        self._miss_runner = miss_runner
        self.fixed = dict(fixed or {})  # sizes the trace fixed (Dynamo specialised them), named in a miss
        self._lock = threading.Lock()
        self._memo = 0
        # Grid: per symbol, the sorted cut points of all range boxes.
        d = len(self.symbols)
        self._cuts: list[list[int]] = [sorted({c for b, _ in ranges for c in (b.bounds()[j][0], b.bounds()[j][1] + 1)})
                                       for j in range(d)]
        self._cells: dict[tuple[int, ...], Callable[..., Any]] = {}
        for binding, runner in ranges:
            spans = []
            for j, (lo, hi) in enumerate(binding.bounds()):
                cuts = self._cuts[j]
                spans.append(range(bisect.bisect_right(cuts, lo) - 1, bisect.bisect_left(cuts, hi + 1)))
            for cell in itertools.product(*spans):
                if cell in self._cells:
                    raise ConfigError(f"range {binding.describe(self.names)} overlaps another range")
                self._cells[cell] = runner

    def add_exact(self, entries: Mapping[tuple, Callable[..., Any]]) -> None:
        """Serve ``entries`` (key → runner) by exact lookup, before any range or earlier entry
        that holds the key (the CUDA graphs of the captured sizes)."""
        self.exact.update(entries)
        self.static_keys = tuple(dict.fromkeys((*self.static_keys, *entries)))

    def replace_runner(self, old: Callable[..., Any], new: Callable[..., Any]) -> None:
        """Put ``new`` wherever ``old`` is (exact entries, memoised range hits, range cells):
        how a lazily or background-compiled binding is swapped in. Safe while other threads
        dispatch: each entry is replaced by one dict assignment."""
        for key, fn in list(self.exact.items()):
            if fn is old:
                self.exact[key] = new
        for cell, fn in list(self._cells.items()):
            if fn is old:
                self._cells[cell] = new

    def describe_key(self, key: tuple) -> str:
        return describe_key(self.symbols, self.names, key)

    @property
    def miss_runner(self) -> Callable[[tuple], Callable[..., Any]] | None:
        """What builds a runner for a size nothing covers (the miss policy's; None: misses raise)."""
        return self._miss_runner

    def find_range(self, key: tuple) -> Callable[..., Any] | None:
        cell = []
        for v, cuts in zip(key, self._cuts):
            i = bisect.bisect_right(cuts, v) - 1
            if i < 0:
                return None
            cell.append(i)
        return self._cells.get(tuple(cell))

    def resolve(self, key: tuple) -> Callable[..., Any]:
        """The runner for ``key`` (the slow path after an exact-dict miss)."""
        fn = self.exact.get(key)
        if fn is not None:
            return fn
        fn = self.find_range(key) if self._cells else None
        if fn is None:
            if self.on_miss == "error" or self._miss_runner is None:
                raise DispatchMiss(self.miss_message(key))
            with self._lock:
                fn = self._miss_runner(key)
        if self._memo < _MEMO_LIMIT:
            self.exact[key] = fn
            self._memo += 1
        return fn

    def miss_message(self, key: tuple) -> str:
        sizes = ", ".join(self.describe_key(k) for k in self.static_keys) or "none"
        ranges = ", ".join(b.describe(self.names) for b in self.range_bindings) or "none"
        fixed = ", ".join(f"{name}={v}" for name, v in self.fixed.items())
        described = self.describe_key(key)
        if fixed:
            described = "{" + ", ".join(x for x in (described[1:-1], fixed) if x) + "}"
        why = f" (this trace fixed {fixed}: the model specialised them)" if fixed else ""
        return (
            f"no compiled variant for size {described}{why}: compiled sizes: {sizes}; "
            f"ranges: {ranges}. Add it to sizes or ranges, or pass on_miss='dynamic' or 'eager'."
        )

    def __len__(self) -> int:
        return len(self.static_keys) + len(self.range_bindings)

    def __str__(self) -> str:
        """What the key reads, then one row per entry."""
        return self._header() + "\n" + text_table(self.rows(), ["kind", "key"])

    def _repr_html_(self) -> str:
        return html_table(self.rows(), ["kind", "key"], caption=self._header())

    def _header(self) -> str:
        names = ", ".join(f"{s}" + (f" ({self.names[s]})" if s in self.names else "") + f" ← {src}"
                          for s, src in zip(self.symbols, self.sources))
        return (f"DispatchTable: {len(self.static_keys)} exact, {len(self.range_bindings)} ranges, "
                f"on_miss={self.on_miss!r}; key = ({names})")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def rows(self) -> list[dict[str, Any]]:
        rows = [{"key": self.describe_key(k), "kind": "exact"} for k in self.static_keys]
        rows += [{"key": b.describe(self.names), "kind": "range"} for b in self.range_bindings]
        return rows
