"""shapewise: one Dynamo trace, N static Inductor compiles, O(1) shape dispatch.

>>> import shapewise as sw
>>> fast = sw.compile(model, sizes=[1, 8, 64], ranges=[(65, 4096)], splitting_ops=["sdpa"])
>>> runnable = sw.Pipeline([sw.Split(ops=["sdpa"]), sw.Concretize(sizes=[1, 8]), sw.Lower()]).run(gm)
"""

from shapewise import display  # noqa: F401 - registers the HTML and picture renderers of the IR
from shapewise.concretize import AnalyzeShapes, Concretize
from shapewise.dispatch import BuildDispatch, DispatchTable, Runnable
from shapewise.errors import (
    BindingError,
    CompileError,
    ConfigError,
    DispatchMiss,
    GuardViolation,
    InputMismatch,
    ShapewiseError,
)
from shapewise.graph_split import Split, draw_split, register_alias, split_graph
from shapewise.instruments import Dump, Verify
from shapewise.ir import Binding, Program, Report, format_graph, format_program
from shapewise.lower import Lower
from shapewise.passes import (
    GraphPass,
    InductorPass,
    Instrument,
    Pass,
    PassResult,
    Pipeline,
    PrintAfter,
    Timing,
    parse_spec,
)
from shapewise.rewrite import Rewrite
from shapewise.version import __version__  # noqa: F401 - shapewise.__version__

__all__ = [
    "AnalyzeShapes", "Binding", "BindingError", "BuildDispatch", "CompileError", "Concretize", "ConfigError",
    "DispatchMiss", "DispatchTable", "Dump", "GraphPass", "GuardViolation", "InductorPass", "InputMismatch",
    "Instrument", "Lower", "Pass", "PassResult", "Pipeline", "PrintAfter", "Program", "Report", "Rewrite", "Runnable",
    "ShapewiseError", "Split", "Timing", "Verify", "compile", "compile_generate", "draw_split", "format_graph",
    "format_program", "parse_spec", "plan_sizes", "register_alias", "split_graph",
]


def __getattr__(name: str):
    # Lazy: the backend imports Dynamo, the planner numpy; neither is needed for the passes. The
    # library (built-in passes and kernels) registers custom ops: imported when first named.
    if name == "library":
        import importlib

        return importlib.import_module("shapewise.library")
    if name == "compile":
        from shapewise.module import compile

        return compile
    if name == "compile_generate":
        from shapewise.generate import compile_generate

        return compile_generate
    if name == "plan_sizes":
        from shapewise.planner import plan_sizes

        return plan_sizes
    raise AttributeError(f"module 'shapewise' has no attribute {name!r}")
