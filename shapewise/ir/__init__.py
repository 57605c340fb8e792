"""The IR, the bottom layer: the data every pass takes and returns (``Program``, ``Piece``,
``Variant``, ``Binding``, ``ShapeInfo``, ``TensorMeta``), the symbolic helpers, the canonical
printer, the stitched runner, content keys and report rows. It imports nothing of shapewise
but the torch adapter and the errors."""

from shapewise.ir.printer import format_graph, format_program, format_shapes
from shapewise.ir.program import Binding, Piece, Program, ShapeInfo, SymbolSource, TensorMeta, Variant
from shapewise.ir.report import Report, html_table, text_table
from shapewise.ir.runner import make_runner
from shapewise.ir.symbolic import INT_MAX, evaluate, range_hint, range_text

__all__ = [
    "INT_MAX", "Binding", "Piece", "Program", "Report", "ShapeInfo", "SymbolSource", "TensorMeta", "Variant",
    "evaluate", "format_graph", "format_program", "format_shapes", "html_table", "make_runner", "range_hint",
    "range_text", "text_table",
]
