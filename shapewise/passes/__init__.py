"""The pass framework: Pass, Program, Pipeline, instruments, the printer; and Lower."""

from shapewise.passes.base import Instrument, Pass, PassRecord, Pipeline, PrintAfter, Timing, parse_spec, register_pass
from shapewise.passes.display import Report
from shapewise.passes.instruments import Dump, Verify, random_inputs
from shapewise.passes.lower import Lower
from shapewise.passes.printer import format_graph, format_program, format_shapes
from shapewise.passes.program import Binding, Piece, Program, ShapeInfo, SymbolSource, TensorMeta, Variant

__all__ = [
    "Binding", "Dump", "Instrument", "Lower", "Pass", "PassRecord", "Piece", "Pipeline", "PrintAfter", "Program",
    "Report", "Verify", "random_inputs",
    "ShapeInfo", "SymbolSource", "TensorMeta", "Timing", "Variant", "format_graph", "format_program",
    "format_shapes", "parse_spec", "register_pass",
]
