"""The dispatch plan: what ``BuildDispatch`` and ``CudaGraphs`` decide, as data.

In: a Program whose bindings are made (and compiled, unless its ``Lower`` defers them). Out: the
Program with ``dispatch`` set to a ``DispatchPlan``: the key (which input dims it reads), the
exact sizes and ranges served, the miss policy, when each variant compiles, and (from
``CudaGraphs``) a ``GraphPlan``. No callables: the ``Runnable`` builds the live objects from the
plan (``dispatch.runtime.build_runtime``), so a Program stays something to print, compare and
pickle, and two Runnables of one Program share no run-time state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import sympy

from shapewise.dispatch.table import MISS_POLICIES, describe_key
from shapewise.errors import ConfigError
from shapewise.ir.program import Binding, Program, SymbolSource
from shapewise.ir.report import html_table, text_table
from shapewise.passes.base import Pass, register_pass

__all__ = ["BuildDispatch", "DispatchPlan", "GraphPlan", "GraphSize", "Layout"]

#: A static input buffer's layout at one size: (shape, stride, storage offset).
Layout = tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass(frozen=True)
class GraphSize:
    """One captured size: its dispatch key, the binding whose kernels it replays, and whether it
    is one graph around the whole forward (``whole``) or one graph per compiled piece."""

    key: tuple[int, ...]
    binding: Binding
    whole: bool


@dataclass(frozen=True)
class GraphPlan:
    """What ``CudaGraphs`` decided: the sizes captured (largest first), the static buffers'
    layouts, and which inputs the graphs read where they are.

    ``layouts``: per buffer set, one entry per input, None for an input that is not a CUDA
    tensor, else its layout at each key of that set. The sets: ``"forward"`` (the graph's inputs
    at whole-forward sizes), ``"staged"`` (the graph's inputs, copied once per call at piecewise
    sizes) and each compute piece's name (its inputs at piecewise sizes). ``in_place``: per compute
    piece, the inputs a splitting op makes that its graph reads where the op left them
    (``split_pools``). ``written``: the graph inputs the model writes (a KV cache)."""

    sizes: tuple[GraphSize, ...]
    layouts: Mapping[str, tuple[Mapping[tuple, Layout] | None, ...]]
    in_place: Mapping[str, frozenset[int]] = field(default_factory=dict)
    written: frozenset[int] = frozenset()
    split_pools: bool = False
    copy_outputs: bool = True
    pad: bool = False
    at_startup: bool = False

    @property
    def keys(self) -> tuple[tuple[int, ...], ...]:
        return tuple(s.key for s in self.sizes)

    def replace(self, **changes: Any) -> GraphPlan:
        return replace(self, **changes)


@dataclass(frozen=True)
class DispatchPlan:
    """What ``BuildDispatch`` decided: the dispatch key (``sources``: where each symbol is read
    from the call's inputs), the bindings served (``exact``: single sizes, one dict lookup;
    ``ranges``: boxes, bisected), ``on_miss`` ("error", "dynamic" or "eager"), ``compile``
    (``Lower``'s mode: "eager_all" means every variant is compiled, "lazy" and "background" that
    the runtime compiles ``deferred`` ones), the sizes the trace fixed (named in a miss), and the
    ``graphs`` plan once ``CudaGraphs`` ran."""

    symbols: tuple[sympy.Symbol, ...]
    sources: tuple[SymbolSource, ...]
    names: Mapping[sympy.Symbol, str]
    exact: tuple[Binding, ...]
    ranges: tuple[Binding, ...]
    on_miss: str = "error"
    compile: str = "eager_all"
    deferred: frozenset[Binding] = frozenset()
    fixed: Mapping[str, int] = field(default_factory=dict)
    graphs: GraphPlan | None = None

    def replace(self, **changes: Any) -> DispatchPlan:
        return replace(self, **changes)

    def describe_key(self, key: tuple) -> str:
        return describe_key(self.symbols, self.names, key)

    def rows(self) -> list[dict[str, Any]]:
        """One row per entry: its kind ("exact", "range"), its sizes, and how it runs."""
        captured = {s.key: s for s in self.graphs.sizes} if self.graphs is not None else {}
        rows = []
        for b in (*self.exact, *self.ranges):
            row = {"key": b.describe(self.names), "kind": "exact" if b.is_static else "range"}
            size = captured.get(b.key) if b.is_static else None
            notes = [*(["compiled on first use" if self.compile == "lazy" else "compiled in the background"]
                       if b in self.deferred else []),
                     *([f"CUDA graph ({'whole forward' if size.whole else 'per piece'})"] if size else [])]
            row["runs"] = "; ".join(notes) or "compiled"
            rows.append(row)
        exact = {b.key for b in self.exact}
        for s in captured.values():
            if s.key not in exact:  # a size inside a range, captured with that range's kernels
                rows.append({"key": self.describe_key(s.key), "kind": "graph",
                             "runs": f"CUDA graph ({'whole forward' if s.whole else 'per piece'}) of "
                                     f"{s.binding.describe(self.names)}"})
        return rows

    def _header(self) -> str:
        names = ", ".join(f"{s}" + (f" ({self.names[s]})" if s in self.names else "") + f" ← {src}"
                          for s, src in zip(self.symbols, self.sources))
        graphs = ""
        if self.graphs is not None:
            g = self.graphs
            graphs = (f"; CUDA graphs at {len(g.sizes)} size(s)" + (" (captured at start-up)" if g.at_startup else "")
                      + (", padded" if g.pad else ""))
        return (f"DispatchPlan: {len(self.exact)} exact, {len(self.ranges)} ranges, on_miss={self.on_miss!r}, "
                f"compile={self.compile!r}{graphs}; key = ({names})")

    def __str__(self) -> str:
        return self._header() + "\n" + text_table(self.rows(), ["kind", "key", "runs"])

    def _repr_html_(self) -> str:
        return html_table(self.rows(), ["kind", "key", "runs"], caption=self._header())

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


@register_pass
@dataclass(frozen=True)
class BuildDispatch(Pass):
    """Plan the dispatch: one entry per binding. ``on_miss``: "error" (default), "dynamic"
    (compile a general variant on the first miss) or "eager"."""

    name: ClassVar[str] = "build_dispatch"
    on_miss: str = "error"

    def __post_init__(self) -> None:
        if self.on_miss not in MISS_POLICIES:
            raise ConfigError(f"on_miss must be one of {MISS_POLICIES}, got {self.on_miss!r}")

    def requires(self, program: Program) -> Sequence[Pass | str]:
        deferred = getattr(program.lowering, "deferred", False)  # lazy / background: compiled at run time
        if program.bindings is None or (not deferred and any(
            v.compiled is None for p in program.compute_pieces for v in p.variants
        )):
            return ["lower"]
        return ()

    def apply(self, program: Program) -> Program:
        shapes = program.shapes
        on_miss = program.on_miss or self.on_miss
        if on_miss not in MISS_POLICIES:
            raise ConfigError(f"on_miss must be one of {MISS_POLICIES}, got {on_miss!r}")
        mode = program.lowering.compile if program.lowering is not None else "eager_all"
        deferred = frozenset(
            b for b in program.bindings
            if mode != "eager_all" and any((v := p.variant_for(b)) is not None and v.compiled is None
                                           for p in program.compute_pieces))
        plan = DispatchPlan(
            symbols=tuple(shapes.symbols), sources=tuple(shapes.sources[s] for s in shapes.symbols),
            names=dict(shapes.names), exact=tuple(b for b in program.bindings if b.is_static),
            ranges=tuple(b for b in program.bindings if not b.is_static), on_miss=on_miss, compile=mode,
            deferred=deferred, fixed=dict(program.fixed_sizes))
        return program.replace(dispatch=plan)
