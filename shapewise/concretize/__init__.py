"""Shape analysis (symbols, sources, guards) and concretisation of size bindings:
``analyze`` (AnalyzeShapes), ``bindings`` (sizes and ranges into checked bindings),
``examples`` (example arguments per variant), ``observe`` (the layouts inputs really have),
``concretize`` (the Concretize pass)."""

from shapewise.concretize.analyze import AnalyzeShapes, analyze_graph, resolve_symbol_names
from shapewise.concretize.bindings import (
    check_binding,
    check_sizes,
    make_bindings,
    primary_symbols,
    refusal,
    resolve_names,
)
from shapewise.concretize.concretize import Concretize, attach_variants
from shapewise.concretize.examples import example_args
from shapewise.concretize.observe import observed_inputs, observed_range_inputs

__all__ = ["AnalyzeShapes", "Concretize", "analyze_graph", "attach_variants", "check_binding", "check_sizes",
           "example_args", "make_bindings", "observed_inputs", "observed_range_inputs", "primary_symbols", "refusal",
           "resolve_names", "resolve_symbol_names"]
