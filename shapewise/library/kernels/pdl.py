"""Programmatic dependent launch (PDL, Hopper and later): a kernel that starts before the one ahead
of it on the stream has finished.

A decode step is a chain of small kernels, each reading what the one before wrote. Each pays a
near-constant ~3 µs beyond its bytes over bandwidth (benchmarks/results/gemv_h200): the launch, the
ramp-up of its first loads, the drain of its last. With PDL (CUDA's programmatic stream
serialization, which CUDA graphs keep as programmatic edges) a kernel launched with the attribute
may start as soon as every program of the kernel ahead has called ``griddepcontrol.launch_dependents``
(or exited); it must call ``griddepcontrol.wait`` before it reads anything the kernels ahead wrote,
or writes anything they read: that waits for the kernel ahead to finish and its memory to be
visible. What it does before the wait overlaps the kernel ahead.

shapewise's kernels (``gemv``, ``decode_attention``) take ``pdl=True`` as: launched with the
attribute, ``griddepcontrol.wait`` before any load or store of activations, then
``launch_dependents`` at once (the kernel after may take the multiprocessors this one leaves
free and prefetch while this one streams). ``gemv`` also prefetches the first part of its weight
slice into L2 before its wait: weights are written by nothing in a step, so reading them early is
safe, and the memory system streams them while the kernel ahead finishes. Inductor's own kernels
do the same with ``torch._inductor.config.triton.enable_pdl`` (a wait before the first load that
depends on the kernel ahead); cuBLAS's kernels do not take part (a kernel after one starts when
it ends, as without PDL).

``pdl_supported(device)``: a CUDA device of compute capability >= 9.0, Triton with
``tl.extra.cuda.gdc_wait``, and ``SHAPEWISE_PDL`` not ``0``. Elsewhere ``pdl=True`` launches as
``pdl=False`` does (the instructions are no-ops without the attribute, but the interpreter and
older GPUs do not know them).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["can_prefetch", "pdl_supported", "prefetch_elements"]

# At most this share of the L2 is prefetched by one kernel (the rest of its weight streams as
# usual): a kernel prefetches while the one ahead streams its own weight through the same L2.
_L2_SHARE = 1 / 3


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` may be launched with programmatic dependent launch."""
    if device.type != "cuda" or os.environ.get("SHAPEWISE_PDL", "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capable(index: int) -> bool:
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        import triton.language as tl

        return hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")
    except (ImportError, AttributeError):
        return False


@functools.cache
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def can_prefetch(w: torch.Tensor) -> bool:
    """Whether a kernel may bulk-prefetch ``w``'s rows: 16-byte units from 16-byte aligned addresses."""
    es = w.element_size()
    return w.stride(1) == 1 and (w.shape[1] * es) % 16 == 0 and w.data_ptr() % 16 == 0 and (w.stride(0) * es) % 16 == 0


def prefetch_elements(w: torch.Tensor, slices: int, chunk: int) -> int:
    """Elements of each of weight ``w``'s rows' K slices (``chunk`` long, ``slices`` of them) that a
    kernel prefetches into L2 before its wait: 0 where it cannot (``can_prefetch``), all of the slice
    where the weight fits in a third of the L2, else the same leading part of every slice (a
    multiple of 8 elements: the bulk prefetch moves 16-byte units), at least 8."""
    if not can_prefetch(w):
        return 0
    index = w.device.index if w.device.index is not None else torch.cuda.current_device()
    budget = int(_l2_bytes(index) * _L2_SHARE)
    per_row = budget // max(1, w.shape[0] * slices * w.element_size())
    return max(8, min(chunk, per_row // 8 * 8))
