"""The pass framework: Pass, Program, Pipeline, instruments, the printer; and Lower."""

from shapewise.passes.base import Instrument, Pass, PassRecord, Pipeline, PrintAfter, Timing, parse_spec, register_pass
from shapewise.passes.lower import Lower
from shapewise.passes.printer import format_graph, format_program, format_shapes
from shapewise.passes.program import Binding, Piece, Program, ShapeInfo, SymbolSource, TensorMeta, Variant

__all__ = [
    "Binding", "Instrument", "Lower", "Pass", "PassRecord", "Piece", "Pipeline", "PrintAfter", "Program",
    "ShapeInfo", "SymbolSource", "TensorMeta", "Timing", "Variant", "format_graph", "format_program",
    "format_shapes", "parse_spec", "register_pass",
]
