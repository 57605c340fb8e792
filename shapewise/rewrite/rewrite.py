"""Rewrite: several ``GraphPass``es and ``InductorPass``es as one stage, between Concretize and Lower.

In: a concretized ``Program`` (its bindings and variants; Concretize runs on demand). Out: the
program whose variants each graph pass applies to carry its rewrite, in the order given
(``Variant.gm``, and the passes' ``uuid()``s in ``Variant.passes``), and whose variants each
Inductor pass applies to carry it (``Variant.inductor_passes``); this ``Rewrite`` is recorded in
``Program.rewrites``. Variants no pass changes keep sharing the piece's graph, so they dedupe as
before. One graph pass alone can also run as a stage of its own (``Pipeline([..., MyPass(),
Lower()])``); see ``shapewise.passes.graph_pass``. A pass whose result is not a valid graph for
the piece (lint fails, placeholders or the number of outputs changed) raises a
``ShapewiseError`` that names the pass, the piece and the sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from shapewise.errors import ConfigError
from shapewise.ir.program import Program
from shapewise.passes.base import Pass, register_pass
from shapewise.passes.graph_pass import GraphPass, InductorPass, rewrite_program, variant_sizes

__all__ = ["Rewrite", "variant_sizes"]


@register_pass
@dataclass(frozen=True)
class Rewrite(Pass):
    """``Rewrite(passes=[MyRewrite()], inductor_passes=[MyPostGrad()])``: see the module docstring."""

    name: ClassVar[str] = "rewrite"
    passes: tuple[GraphPass, ...] = ()
    inductor_passes: tuple[InductorPass, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "passes", tuple(self.passes))
        object.__setattr__(self, "inductor_passes", tuple(self.inductor_passes))
        for p in self.passes:
            if not isinstance(p, GraphPass):
                hint = " (an InductorPass goes in inductor_passes)" if isinstance(p, InductorPass) else ""
                raise ConfigError(f"Rewrite(passes=...) takes sw.GraphPass objects, got {p!r}{hint}")
        for p in self.inductor_passes:
            if not isinstance(p, InductorPass):
                raise ConfigError(f"Rewrite(inductor_passes=...) takes sw.InductorPass objects, got {p!r}")

    def requires(self, program: Program) -> Sequence[Pass | str]:
        return [] if program.bindings is not None else ["concretize"]

    def apply(self, program: Program) -> Program:
        return rewrite_program(program, self.passes, self.inductor_passes, by=self)
