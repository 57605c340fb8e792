"""transformers' generation internals shapewise relies on (imported only when used: transformers
is not a dependency of shapewise itself).

``deferred_stop_checks()``: inside it, transformers' ``generate()`` on a CUDA model checks whether
to stop one step late (its own ``DeferredStopCheck``, which it turns on only for MPS), so the host
queues step t+1 while the GPU runs step t instead of waiting for step t's ``unfinished.max() == 0``
at every token. Where the stop comes from the model (an EOS token), one extra forward runs, and
transformers drops its token (``_undo_generation_steps``); a stop at the length limit is known on
the host and is never late. Only where the cache is not returned (transformers rolls a returned one
back with ``crop``, per step), and not for an assistant model.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import threading
from collections.abc import Iterator, Sequence

import torch

__all__ = ["deferred_stop_checks"]

_log = logging.getLogger("shapewise")
_DEVICES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("shapewise_deferred_stops", default=())
_PARAMS = ("device", "cache", "cache_is_returned", "is_assistant")
_lock = threading.Lock()
_why_not: list[str | None] = []  # filled once: None where the gate is installed, else why it cannot be


def _install() -> str | None:
    """Wrap ``DeferredStopCheck.is_supported`` once, so that it says yes inside
    ``deferred_stop_checks()`` and whatever transformers says outside it; returns why it cannot."""
    try:
        import transformers
        from transformers.generation import utils as generation
    except ImportError:
        return "transformers is not installed"
    check = getattr(generation, "DeferredStopCheck", None)
    original = getattr(check, "is_supported", None)
    if original is None:
        return (f"transformers {transformers.__version__} has no DeferredStopCheck: its generate() waits for "
                "each step's stop check")
    if getattr(original, "shapewise_gate", False):
        return None
    try:
        params = tuple(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        params = ()
    if params != _PARAMS:
        return (f"transformers {transformers.__version__}'s DeferredStopCheck.is_supported takes {params}, "
                f"not {_PARAMS} as shapewise knows it")

    def is_supported(device: torch.device, cache: object, cache_is_returned: bool, is_assistant: bool) -> bool:
        devices = _DEVICES.get()
        if devices and torch.device(device).type in devices and not is_assistant and not cache_is_returned:
            return True
        return original(device, cache, cache_is_returned, is_assistant=is_assistant)

    is_supported.shapewise_gate = True
    check.is_supported = staticmethod(is_supported)
    return None


@contextlib.contextmanager
def deferred_stop_checks(devices: Sequence[str] = ("cuda",)) -> Iterator[bool]:
    """transformers' ``generate()`` inside checks for a stop one step late on ``devices`` (its
    ``DeferredStopCheck``, which needs device events: CUDA's); yields whether it can here (a
    transformers without it logs why, once, and generates as before)."""
    with _lock:
        if not _why_not:
            _why_not.append(_install())
            if _why_not[0] is not None:
                _log.info("shapewise: generate() keeps its stop check at every step: %s", _why_not[0])
    if _why_not[0] is not None:
        yield False
        return
    token = _DEVICES.set(tuple(dict.fromkeys((*_DEVICES.get(), *devices))))  # nested: both contexts' devices
    try:
        yield True
    finally:
        _DEVICES.reset(token)
