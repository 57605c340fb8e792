"""What a CUDA-graph replay copies: the fresh inputs in (``CopyIn``: one launch for all of them)
and the outputs out of the graph pool (``copy_out``, ``clone_tensors``), but inside
``borrowed_outputs()``, where the caller takes the graphs' own buffers."""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["CopyIn", "borrowed_outputs", "clone_tensors", "copy_out", "outputs_borrowed"]


class CopyIn:
    """The fresh inputs of a replay (a decode step's token ids, positions and mask) copied into
    their static buffers, ``slots`` = (input, static buffer) rows. Several go in one launch: one
    ``torch._foreach_copy_`` over their bytes (uint8 views; a foreach copy launches once per
    dtype, and those three inputs are int64, int64 and bool). Where the bytes cannot be viewed
    so (a complex dtype, a 0-d tensor, an int64 source whose last dimension is strided), each is
    copied on its own, as before. A copy of bytes is the copy of values: each source has its
    buffer's shape (the dispatch is by shape) and dtype (Dynamo's guards)."""

    def __init__(self, slots: Sequence[tuple[int, torch.Tensor]]) -> None:
        self.slots = list(slots)
        get = operator.itemgetter(*(i for i, _ in self.slots)) if self.slots else None
        self._get = get if len(self.slots) > 1 else None
        dst = [_bytes(static) for _, static in self.slots]
        self._bytes = dst if len(dst) > 1 and all(d is not None for d in dst) else None

    def __call__(self, args: Sequence[Any]) -> None:
        if self._bytes is not None:
            try:
                src = [a.view(torch.uint8) for a in self._get(args)]
            except RuntimeError:  # not viewable as bytes after all: one by one from now on
                self._bytes = None
            else:
                torch._foreach_copy_(self._bytes, src)
                return
        for i, static in self.slots:
            static.copy_(args[i])


def _bytes(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as a uint8 view, or None where there is none (or its values are not its bytes)."""
    if t.dim() == 0 or t.is_complex() or t.is_conj() or t.is_neg():
        return None
    try:
        return t.view(torch.uint8)
    except RuntimeError:
        return None


class _Borrowing(threading.local):
    on = False


_BORROWING = _Borrowing()


@contextlib.contextmanager
def borrowed_outputs():
    """Inside this context (in this thread), a call that replays CUDA graphs returns the graphs'
    own output buffers, not copies of them (``copy_outputs``): one copy and ~15 µs of host time
    less per call. Each output is overwritten by the next call at its size, so this is for a
    caller that is done with a call's outputs before it makes the next one, as transformers'
    ``generate()`` is (it copies the logits it keeps; ``compile_generate`` borrows inside the
    ``generate()`` calls that keep no other output)."""
    was = _BORROWING.on
    _BORROWING.on = True
    try:
        yield
    finally:
        _BORROWING.on = was


def outputs_borrowed() -> bool:
    """Whether this thread is inside ``borrowed_outputs()``."""
    return _BORROWING.on


def copy_out(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` with its outputs cloned out of the graph pool, but inside ``borrowed_outputs()``."""
    borrowing = _BORROWING

    def run_and_copy(*args: Any) -> Any:
        out = run(*args)
        return out if borrowing.on else clone_tensors(out)

    return run_and_copy


def clone_tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, tuple):
        return tuple(clone_tensors(t) for t in tree)
    if isinstance(tree, list):
        return [clone_tensors(t) for t in tree]
    if isinstance(tree, dict):
        return {k: clone_tensors(v) for k, v in tree.items()}
    return tree
