"""Run-time dispatch: the plan (data, made by the BuildDispatch and CudaGraphs passes), the
runtime the Runnable builds from it (table, guards, compiles, graphs), and the Runnable."""

from shapewise.dispatch.copies import borrowed_outputs
from shapewise.dispatch.plan import BuildDispatch, DispatchPlan, GraphPlan, GraphSize
from shapewise.dispatch.runnable import Runnable
from shapewise.dispatch.runtime import DispatchRuntime, build_runtime
from shapewise.dispatch.table import DispatchTable, key_function

__all__ = ["BuildDispatch", "DispatchPlan", "DispatchRuntime", "DispatchTable", "GraphPlan", "GraphSize", "Runnable",
           "borrowed_outputs", "build_runtime", "key_function"]
