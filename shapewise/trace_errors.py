"""What a failed trace tells the user: Dynamo's and the backend's errors turned into a
``ShapewiseError`` that names the cause and the fix (``trace_error``)."""

from __future__ import annotations

from typing import Any

from shapewise import _compat
from shapewise.errors import ShapewiseError

__all__ = ["trace_error"]


def trace_error(e: BaseException, model: Any) -> ShapewiseError | None:
    """The error to raise for ``e``, raised by a call of ``model`` through Dynamo, with its
    ``__cause__`` set; None: raise ``e`` as it is (the model's own code failed)."""
    inner = _compat.backend_error_cause(e)
    if isinstance(inner, ShapewiseError):
        return inner  # the backend's own error, without Dynamo's wrapper; its own cause kept
    name = getattr(model, "__qualname__", type(model).__name__)
    if _compat.is_graph_break(e):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        err = ShapewiseError(
            f"Dynamo cannot trace {name} as one graph, which shapewise needs (it traces with "
            f"fullgraph=True): {first}. Make that code traceable or move it out of the forward (e.g. a "
            "logging call, a data-dependent Python branch); Dynamo's full message is the cause below")
    elif inner is not None or _compat.is_internal_dynamo_error(e):
        # A compile below the backend, or Dynamo itself, failed (not the model's own code, whose
        # errors pass as they are): say so, with the first line of what failed.
        what = inner if inner is not None else e
        first = (str(what).strip().splitlines() or [type(what).__name__])[0][:300]
        if "data-dependent" not in str(what):
            hint = ""
        elif inner is not None:  # the graph was traced; a compile of it failed
            hint = (" The model reads a tensor's value (a data-dependent size or .item()): register the op that "
                    "does it as a splitting op, or pass on_compile_error='fallback' to run that piece eagerly.")
        else:  # Dynamo could not trace past it
            hint = (" The model reads a tensor's value (a data-dependent size or .item()) where Dynamo needs a "
                    "size: put that code in a torch.library.custom_op (Dynamo does not trace inside one) and name "
                    "the op in splitting_ops, or tell Dynamo what holds with torch._check.")
        err = ShapewiseError(f"shapewise could not trace and compile {name}: {type(what).__name__}: {first}.{hint} "
                             "The full error is the cause below")
    else:
        return None
    err.__cause__ = e
    return err
