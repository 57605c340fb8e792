"""Concretize: turn requested sizes into bindings, check them against the trace's guards,
and build each piece's static example arguments (shape, stride, offset, storage length)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from shapewise._compat import FakeTensorMode
from shapewise.concretize.bindings import (
    _freeze,
    _FrozenDict,
    _is_int,
    check_binding,
    check_sizes,
    clip_binding,
    make_bindings,
    serves_neither_end,
)
from shapewise.concretize.examples import example_args
from shapewise.concretize.observe import observed_inputs, observed_range_inputs
from shapewise.errors import ConfigError, GuardViolation
from shapewise.ir.keys import graph_key
from shapewise.ir.program import Binding, Piece, Program, Variant
from shapewise.passes.base import Pass, register_pass

__all__ = ["Concretize", "attach_variants"]

log = logging.getLogger("shapewise")


@register_pass
@dataclass(frozen=True)
class Concretize(Pass):
    """Bindings from sizes/ranges; per compute piece one ``Variant`` with static example args.
    A binding that contradicts a guard of the trace raises ``GuardViolation``. With
    ``refused="skip"`` or ``"skip-sizes"`` a single size is left out with a warning (behind Dynamo
    a call at that size traces again) and a range is cut to the part the trace's proven ranges
    allow (``clip_binding``: a range across a branch of the model's Python, ``n < window``; left
    out when nothing is left). A range whose ends contradict another guard (``n % 2 == 0``) is
    still refused with ``"skip-sizes"`` if the trace serves one of its ends (the
    range was given wrong), else left to another trace; with ``"skip"`` it is kept, its guards checked per call
    (Dynamo's, or a direct call's checks of a range's interior). ``sw.compile`` uses
    "skip-sizes" for its first trace and "skip" for later ones; the torch.compile backend entry
    "skip".

    ``Concretize(sizes=(1, 8), ranges=((9, 512),))``; ``Concretize(sizes={"batch": [1, 2], "seq": [128]})``.
    """

    name: ClassVar[str] = "concretize"
    sizes: Any = ()
    ranges: Any = ()
    refused: str = "error"
    fixed: Mapping[str, int | None] = dataclasses.field(default_factory=dict)  # dims the trace fixed (None: lacks)

    def __post_init__(self) -> None:
        check_sizes(self.sizes, self.ranges)  # fail before any trace: typos, sizes <= 0, overlaps
        if self.refused not in ("error", "skip", "skip-sizes"):
            raise ConfigError(f"refused must be 'error', 'skip' or 'skip-sizes', got {self.refused!r}")
        if _is_int(self.sizes):
            object.__setattr__(self, "sizes", (self.sizes,))
        object.__setattr__(self, "sizes", _freeze(self.sizes) if not isinstance(self.sizes, Mapping) else self.sizes)
        ranges = self.ranges
        object.__setattr__(self, "ranges", ranges if isinstance(ranges, Mapping) else _freeze(ranges))
        object.__setattr__(self, "fixed", _FrozenDict(self.fixed or {}))

    def requires(self, program: Program) -> Sequence[Pass | str]:
        return _need_split_and_shapes(program)

    def apply(self, program: Program) -> Program:
        shapes = program.shapes
        if not shapes.symbols and self.refused == "skip" and not self.fixed:
            # A trace with every size fixed (Dynamo specialised it, e.g. its first trace without
            # dynamic=True, or at size 1): compile it as it is; it serves exactly that call.
            log.info("shapewise: this trace has no dynamic sizes; compiling it as traced")
            bindings = (Binding(()),)
            return program.replace(bindings=bindings, pieces=attach_variants(program.pieces, bindings, program),
                                   fixed_sizes=self._fixed_sizes())
        bindings = []
        for b in make_bindings(shapes, self.sizes, self.ranges, self.fixed):
            if self.refused != "error" and not b.is_static:
                cut = clip_binding(shapes, b)
                if cut is None:
                    log.info("shapewise: %s is outside what this trace allows; a call in it traces again",
                             b.describe(shapes.names))
                    continue
                if cut != b:
                    log.info("shapewise: this trace serves %s of the range %s (a call in the rest of it fails the "
                             "trace's guards and traces again)", cut.describe(shapes.names), b.describe(shapes.names))
                b = cut
            try:
                check_binding(shapes, b, single_symbol=self.refused != "error" and not b.is_static)
            except GuardViolation as e:
                if self.refused == "skip-sizes" and not b.is_static and serves_neither_end(shapes, b):
                    # Both ends fail a guard over their size (deepseek_v4 chunks by 4: a trace at 4
                    # serves 4..7): the range is another branch's, and a call in it traces again.
                    log.info("shapewise: this trace serves neither end of %s (%s); a call in it traces again",
                             b.describe(shapes.names), e)
                    continue
                if self.refused == "error" or (self.refused == "skip-sizes" and not b.is_static):
                    raise
                if not b.is_static:
                    # A guard over several symbols fails at some corner of the range: the trace
                    # serves the sizes in it that its guards allow (Dynamo's guards, or a direct
                    # call's checks of the range's interior, send the others to another trace).
                    log.info("shapewise: this trace serves only the sizes its guards allow in %s: %s",
                             b.describe(shapes.names), e)
                    bindings.append(b)
                    continue
                log.warning("shapewise: skipping %s in this trace: %s (a call at that size makes Dynamo trace again)",
                            b.describe(shapes.names), e)
                continue
            bindings.append(b)
        return program.replace(bindings=tuple(bindings), pieces=attach_variants(program.pieces, bindings, program),
                               fixed_sizes=self._fixed_sizes())

    def _fixed_sizes(self) -> dict[str, int]:
        return {name: v for name, v in (self.fixed or {}).items() if v is not None}


def attach_variants(pieces: Iterable[Piece], bindings: Sequence[Binding],
                    program: Program | None = None) -> tuple[Piece, ...]:
    """Give every compute piece one uncompiled variant per binding. With ``program``, a static
    variant's inputs take the layouts eager makes at its size (``observed_inputs``)."""
    pieces = tuple(pieces)
    out = []
    modes = {b: FakeTensorMode() for b in bindings if b.is_static}
    observed = {}
    if program is not None and modes:
        memo: dict[Any, Any] = {}  # identical layers at one size lay their outputs out alike: run one
        digests = {}
        for p in pieces:
            gk = graph_key(p.gm, p.shapes)
            digests[p.name] = gk.digest if gk is not None else None
        shared = (FakeTensorMode(allow_non_fake_inputs=True), {})  # one mode; parameters made once
        observed = {b: observed_inputs(program, b, memo, digests, shared) for b in modes}
    if program is not None:
        observed.update({b: observed_range_inputs(program, b) for b in bindings if not b.is_static})
    for p in pieces:
        if p.is_splitting:
            out.append(p)
            continue
        variants = tuple(Variant(b, example_args(p, b, modes.get(b), observed.get(b, {}).get(p.name)))
                         for b in bindings)
        out.append(dataclasses.replace(p, variants=variants))
    return tuple(out)


def _need_split_and_shapes(program: Program) -> list[str]:
    needs = [] if program.is_split else ["split"]
    if program.shapes is None or any(p.shapes is None for p in program.pieces):
        needs.append("analyze_shapes")
    return needs
