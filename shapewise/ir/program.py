"""The data that flows through the pipeline: Program, Piece, ShapeInfo, Binding, Variant.

Plain data: no live sessions, threads or pass objects (run-time state lives on the
``Runnable``). How each object shows itself is registered in ``RENDERERS`` from above (the
canonical printer here in ``ir``, HTML and pictures by ``shapewise.display``); the IR imports
neither.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch.fx

from shapewise.ir.symbolic import evaluate, range_text

__all__ = ["RENDERERS", "Binding", "Piece", "Program", "ShapeInfo", "SubclassMeta", "SymbolSource", "TensorMeta",
           "Variant"]

#: (class name, "text" | "html" | "png") -> renderer. Registered by ``ir.printer`` and
#: ``shapewise.display``.
RENDERERS: dict[tuple[str, str], Callable[[Any], Any]] = {}


def _render(obj: Any, kind: str) -> Any:
    fn = RENDERERS.get((type(obj).__name__, kind))
    return fn(obj) if fn is not None else None


@dataclass(frozen=True)
class SymbolSource:
    """Where a symbol's run-time value is read from the call's arguments.

    ``kind`` is ``"int"`` (``args[index]`` is the value), ``"size"`` (``args[index].shape[dim]``)
    or ``"stride"`` (``args[index].stride(dim)``).
    """

    kind: str
    index: int
    dim: int = -1

    def expr(self, argname: str = "args") -> str:
        if self.kind == "int":
            return f"{argname}[{self.index}]"
        if self.kind == "size":
            return f"{argname}[{self.index}].shape[{self.dim}]"
        return f"{argname}[{self.index}].stride({self.dim})"

    def __str__(self) -> str:
        return self.expr()


@dataclass(frozen=True)
class SubclassMeta:
    """What makes a tensor-subclass input (a ``DTensor``, a quantised weight) again around fake
    inner tensors: its class, the context ``__tensor_flatten__`` gave, and each inner tensor's
    ``TensorMeta`` or, for an object it carries (a ``DeviceMesh``), the object
    (``cls.__tensor_unflatten__(inner, ctx, shape, stride)`` rebuilds it)."""

    cls: type
    ctx: Any
    inner: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class TensorMeta:
    """A placeholder's layout as sympy expressions, plus dtype/device; ``subclass`` when the
    input is a traceable tensor subclass (the layout is then the outer tensor's)."""

    shape: tuple[sympy.Expr, ...]
    stride: tuple[sympy.Expr, ...]
    offset: sympy.Expr
    dtype: Any
    device: Any
    requires_grad: bool = False
    subclass: SubclassMeta | None = None

    def at(self, values: Mapping[sympy.Symbol, int]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(shape, stride, storage offset) as ints at the sizes ``values``."""
        return (tuple(evaluate(e, values) for e in self.shape), tuple(evaluate(e, values) for e in self.stride),
                evaluate(self.offset, values))


@dataclass(frozen=True)
class ShapeInfo:
    """The symbolic facts of one graph (a piece or the whole program).

    - ``symbols``: free symbols, in the order they first appear in the inputs;
    - ``sources``: for each symbol, where its run-time value is read;
    - ``inputs``: per placeholder, a ``TensorMeta``, a sympy expr (SymInt input) or a constant;
    - ``guards``: (sympy boolean, where it came from) that every valid binding satisfies;
    - ``ranges``: per symbol, the (lower, upper) bounds the trace proved (None = open);
    - ``hints``: per symbol, its traced value.
    """

    symbols: tuple[sympy.Symbol, ...]
    sources: Mapping[sympy.Symbol, SymbolSource]
    inputs: tuple[Any, ...]
    input_names: tuple[str, ...]
    guards: tuple[tuple[sympy.Basic, str], ...] = ()
    ranges: Mapping[sympy.Symbol, tuple[int | None, int | None]] = field(default_factory=dict)
    hints: Mapping[sympy.Symbol, int] = field(default_factory=dict)
    names: Mapping[sympy.Symbol, str] = field(default_factory=dict)

    def name_of(self, s: sympy.Symbol) -> str:
        return self.names.get(s, str(s))

    def __str__(self) -> str:
        return _render(self, "text") or repr(self)

    def _repr_html_(self) -> str | None:
        return _render(self, "html")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


@dataclass(frozen=True)
class Binding:
    """Values for every dispatch symbol: an int (one size) or an inclusive (lo, hi) range.

    >>> Binding.of({s0: 8})            # static
    >>> Binding.of({s0: (17, 512)})    # a range: compiled with symbolic sizes
    """

    items: tuple[tuple[sympy.Symbol, int | tuple[int, int]], ...]

    @staticmethod
    def of(mapping: Mapping[sympy.Symbol, int | tuple[int, int]]) -> Binding:
        return Binding(tuple(mapping.items()))

    @property
    def mapping(self) -> dict[sympy.Symbol, int | tuple[int, int]]:
        return dict(self.items)

    @property
    def is_static(self) -> bool:
        return all(isinstance(v, int) for _, v in self.items)

    @property
    def key(self) -> tuple:
        return tuple(v for _, v in self.items)

    def static_values(self) -> dict[sympy.Symbol, int]:
        return {s: v for s, v in self.items if isinstance(v, int)}

    def bounds(self) -> tuple[tuple[int, int], ...]:
        return tuple((v, v) if isinstance(v, int) else v for _, v in self.items)

    def corners(self, over: Iterable[sympy.Symbol] | None = None) -> list[dict[sympy.Symbol, int]]:
        """The corners of the binding's box (every range at either end); one point if static.
        ``over``: the corners of the box's projection onto those symbols only (what a guard over
        them sees; 2**k points for k ranges, not 2**n for all n of a cache's many symbols)."""
        keep = None if over is None else set(over)
        items = [(s, v) for s, v in self.items if keep is None or s in keep]
        ends = [[v] if isinstance(v, int) else sorted({v[0], v[1]}) for _, v in items]
        return [dict(zip([s for s, _ in items], combo)) for combo in itertools.product(*ends)]

    def describe(self, names: Mapping[sympy.Symbol, str] | None = None) -> str:
        """``{n=8}``; dims that share a name and a value print once (``{batch=2, seq=8}`` for
        input_ids' and attention_mask's batch); a name whose symbols differ is told apart by the
        symbol: ``{n[s1]=4, n[s2]=6}``."""
        names = names or {}
        shown = [names.get(s, str(s)) for s, _ in self.items]
        values: dict[str, set[Any]] = {}
        for (_, v), name in zip(self.items, shown):
            values.setdefault(name, set()).add(v)
        parts, done = [], set()
        for (s, v), name in zip(self.items, shown):
            val = str(v) if isinstance(v, int) else range_text(v[0], v[1], "..", "")
            if len(values[name]) == 1:
                if name not in done:
                    parts.append(f"{name}={val}")
                done.add(name)
            else:
                parts.append(f"{name}[{s}]={val}")
        return "{" + ", ".join(parts) + "}"

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class Variant:
    """One compiled version of a piece for one binding.

    ``gm``: this variant's own graph when graph passes rewrote it (None: the piece's graph);
    ``passes``: the ``uuid()`` of each graph pass applied, in order; ``inductor_passes``: the
    post-grad passes Inductor runs when it compiles this variant; ``inductor_options``: the
    Inductor config the applied graph passes need, as sorted (name, value) pairs;
    ``artifact_key``: (its artifact's content key, whether it may be on disk), set by ``Lower``.
    """

    binding: Binding
    example_args: tuple[Any, ...] = ()
    compiled: Callable[..., Any] | None = None
    report: Mapping[str, Any] = field(default_factory=dict)
    gm: torch.fx.GraphModule | None = None
    passes: tuple[str, ...] = ()
    inductor_passes: tuple[Any, ...] = ()
    inductor_options: tuple[tuple[str, Any], ...] = ()
    artifact_key: tuple[str, bool] | None = None

    @property
    def pass_labels(self) -> list[str]:
        """The graph passes applied, as ``name{fields}`` (their uuid without class and version),
        then the inductor passes' specs: what the report and the printer show."""
        return [u.split(":", 1)[-1].rsplit("@", 1)[0] for u in self.passes] + [p.spec() for p in self.inductor_passes]


@dataclass(frozen=True)
class Piece:
    """A subgraph of the split program. Splitting pieces run as they are (never compiled).

    ``returned``: the positions of its outputs that the program returns to its caller (None:
    not known, taken as all); the others only feed later pieces. ``call``: what runs a
    splitting piece (set by ``Lower``: a direct call of its op where that is lean; None: the
    graph's ``forward``).
    """

    name: str
    gm: torch.fx.GraphModule
    is_splitting: bool = False
    shapes: ShapeInfo | None = None
    variants: tuple[Variant, ...] = ()
    returned: frozenset[int] | None = None
    call: Callable[..., Any] | None = None

    def as_compiled_for(self, variant: Variant) -> Piece:
        """This piece with the graph ``variant`` compiles: its rewritten one, if graph passes made one."""
        return self if variant.gm is None else dataclasses.replace(self, gm=variant.gm)

    def variant_for(self, binding: Binding) -> Variant | None:
        for v in self.variants:
            if v.binding == binding:
                return v
        return None


@dataclass(frozen=True)
class Program:
    """What each pass takes and returns. Passes never mutate a Program; they make a new one.

    ``gm``: the whole traced graph; ``graph``: the stitching graph (calls ``piece_i``
    submodules in order); ``pieces``; ``shapes``: the whole graph's ``ShapeInfo``;
    ``bindings``: the variants to build; ``dispatch``: the dispatch plan, once made
    (``dispatch.plan.DispatchPlan``: data; the Runnable builds the live table from it).

    Set by the caller: ``symbol_names`` ({symbol or its name: dim name}, read by AnalyzeShapes; a
    name that is no symbol of the graph is a ConfigError), ``on_miss`` (overrides BuildDispatch's),
    ``inputs_guarded_by`` ("dynamo" when Dynamo's guards check the inputs, so the dispatch adds
    none). Set by the stages: ``split_plan`` and
    ``splitting_ops`` (Split), ``lowering`` (the
    Lower pass, a frozen spec, whose variants these are: the dispatch compiles lazy and background
    variants with it), ``fixed_sizes`` (Concretize: the dims this trace fixed, by name), ``rewrites`` (the Rewrite
    passes applied, frozen specs: the dispatch applies them to the variants it makes itself).
    """

    gm: torch.fx.GraphModule
    graph: torch.fx.GraphModule | None = None
    pieces: tuple[Piece, ...] = ()
    shapes: ShapeInfo | None = None
    bindings: tuple[Binding, ...] | None = None
    dispatch: Any = None
    lowering: Any = None
    symbol_names: Mapping[Any, str] = field(default_factory=dict)
    on_miss: str | None = None
    inputs_guarded_by: str | None = None
    split_plan: Any = None
    splitting_ops: tuple[Any, ...] = ()
    fixed_sizes: Mapping[str, int] = field(default_factory=dict)
    rewrites: tuple[Any, ...] = ()

    def replace(self, **changes: Any) -> Program:
        return dataclasses.replace(self, **changes)

    def callables(self, binding: Binding | None) -> dict[str, Callable[..., Any]]:
        """{piece name: what runs it at ``binding``}: the compiled variant, a splitting piece's
        ``call``, or else the graph's own ``forward`` (the variant's rewritten graph, or the
        piece's: splitting pieces, uncompiled variants, and every piece when ``binding`` is None)."""
        out = {}
        for p in self.pieces:
            v = None if p.is_splitting or binding is None else p.variant_for(binding)
            if v is not None and v.compiled is not None:
                out[p.name] = v.compiled
            elif p.call is not None:
                out[p.name] = p.call
            else:
                out[p.name] = (v.gm if v is not None and v.gm is not None else p.gm).forward
        return out

    @property
    def is_split(self) -> bool:
        return self.graph is not None

    @property
    def compute_pieces(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if not p.is_splitting)

    def __str__(self) -> str:
        return _render(self, "text") or repr(self)

    def _repr_html_(self) -> str | None:
        return _render(self, "html")

    def _repr_png_(self) -> bytes | None:
        return _render(self, "png")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))
