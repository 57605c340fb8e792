"""Run-time dispatch: the table, the runnable, and the pass that builds them."""

from shapewise.dispatch.runnable import BuildDispatch, DispatchRuntime, Runnable
from shapewise.dispatch.table import DispatchTable, key_function

__all__ = ["BuildDispatch", "DispatchRuntime", "DispatchTable", "Runnable", "key_function"]
