"""Shape analysis (symbols, sources, guards) and concretisation of size bindings."""

from shapewise.concretize.analyze import AnalyzeShapes, analyze_graph
from shapewise.concretize.concretize import Concretize, check_binding, example_args, make_bindings

__all__ = ["AnalyzeShapes", "Concretize", "analyze_graph", "check_binding", "example_args",
           "make_bindings"]
