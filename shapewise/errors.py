"""Exceptions: every error a user can trip says what was wrong and what would be right."""

from __future__ import annotations

__all__ = [
    "BindingError",
    "CompileError",
    "ConfigError",
    "DispatchMiss",
    "GuardViolation",
    "InputMismatch",
    "ShapewiseError",
]


class ShapewiseError(Exception):
    """Base class of shapewise's errors."""


class ConfigError(ShapewiseError, ValueError):
    """Bad options: unknown op names, overlapping ranges, sizes <= 0, ..."""


class BindingError(ConfigError):
    """A size binding that does not fit the graph (unknown symbol, wrong arity, ...)."""


class GuardViolation(BindingError):
    """A requested size contradicts a guard of the trace (e.g. the model needs even sizes)."""


class DispatchMiss(ShapewiseError, LookupError):
    """A run-time size that no compiled size or range covers."""


class InputMismatch(ShapewiseError, TypeError):
    """A call whose tensors do not match what was compiled (dtype, device, rank, layout)."""


class CompileError(ShapewiseError, RuntimeError):
    """A variant failed to compile; names the piece, the binding and the cause. ``reads_values``: the
    cause is a read of a tensor's value into a size or into Python (``.item()``, ``nonzero``)."""

    def __init__(self, *args: object, reads_values: bool = False) -> None:
        super().__init__(*args)
        self.reads_values = reads_values
