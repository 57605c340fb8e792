"""Dynamo traces refused before they start: ``no_new_trace()``.

A call of a compiled forward that fails every trace's guards makes Dynamo trace the model again, with
this call's tensors, which carry none of shapewise's dynamic marks; ``ShapewiseModule`` refuses that
trace (its backend raises) and traces again itself, marked. Refused in the backend, the whole Dynamo
trace before it was wasted: on this project's CPU a 16-layer Llama's decode step, the second trace of
every ``compile_generate``, took 2.3 s of Dynamo for nothing (benchmarks/results/trace_cost_cpu).
Dynamo's compile-start callbacks (``torch._dynamo.callback``) run before it traces: inside
``no_new_trace(frames)`` a trace that starts on this thread, of one of those frames (Dynamo's ids of the code
objects the module traced, ``current_frame_id()`` at its trace), is refused there, at no cost. Another frame's
(a ``torch.compile``d function the model calls as it runs, such as transformers' flex attention) traces as always.
"""

from __future__ import annotations

import threading
from collections.abc import Collection

__all__ = ["TraceRefused", "current_frame_id", "no_new_trace"]


class TraceRefused(Exception):
    """Raised (and wrapped by Dynamo) where ``no_new_trace()`` refused a trace."""


class _Refusal:
    """The context ``no_new_trace()`` returns; ``refused``: whether a Dynamo trace tried to start inside it (and
    was refused)."""

    __slots__ = ("active", "frames", "outer", "refused")

    def __init__(self, frames: Collection[int]) -> None:
        self.refused, self.active, self.outer, self.frames = False, False, None, frames

    def __enter__(self) -> _Refusal:
        if self.frames and _install():
            self.active, self.outer = True, getattr(_LOCAL, "refusal", None)
            _LOCAL.refusal = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            _LOCAL.refusal = self.outer


_LOCAL = threading.local()
_HANDLER: list = []  # [Dynamo's callback handler], or [None] where this torch has none
_INSTALL_LOCK = threading.Lock()


def _on_start(args: object) -> None:
    refusal = getattr(_LOCAL, "refusal", None)
    if refusal is None:
        return
    from torch._dynamo.callback import CallbackTrigger

    if getattr(args, "callback_trigger", None) is CallbackTrigger.DYNAMO and current_frame_id() in refusal.frames:
        refusal.refused = True
        raise TraceRefused("shapewise refuses an unmarked Dynamo trace (it traces again with its marks)")


def _install() -> bool:
    """Whether the callback is registered (again, where ``torch._dynamo.reset()`` cleared Dynamo's callbacks)."""
    if not _HANDLER:
        try:
            from torch._dynamo.callback import CallbackTrigger, callback_handler  # noqa: F401

            _HANDLER.append(callback_handler)
        except (ImportError, AttributeError):  # a torch without compile-start callbacks: refused as before
            _HANDLER.append(None)
    handler = _HANDLER[0]
    if handler is None:
        return False
    if _on_start not in handler.start_callbacks:
        with _INSTALL_LOCK:
            if _on_start not in handler.start_callbacks:
                handler.register_start_callback(_on_start)
    return True


def no_new_trace(frames: Collection[int]) -> _Refusal:
    """Within ``with no_new_trace(frames) as refusal:``, a Dynamo trace of one of ``frames`` (ids from
    ``current_frame_id()``) that starts on this thread is refused before it runs: the call raises (Dynamo's wrapper
    around ``TraceRefused``) and ``refusal.refused`` is True. Where torch has no compile-start callback, or
    ``frames`` is empty, nothing is refused here (the backend refuses, as before). (A class, not a generator: it
    sits on every call that goes through Dynamo's frame.)"""
    return _Refusal(frames)


def current_frame_id() -> int | None:
    """Dynamo's id of the code object it is compiling now (the same for every trace of it), or None."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except (ImportError, AttributeError):
        return None
    return getattr(compile_id, "frame_id", None)
