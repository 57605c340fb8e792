"""``shapewise::decode_attention``: the attention of a few query rows per key/value head over a
KV cache, as a Triton split-KV ("flash-decoding") kernel.

    out = decode_attention(q, k, v, mask, scale)
    # q [B, H, n, D], k [B, H, S, D], v [B, H, S, Dv], mask None or [B | 1, 1, 1, S] -> [B, H, n, Dv]

It is ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`` (no dropout, not
causal) with the mask one row shared by the query rows: what ``GroupedDecodeAttention`` makes of a
decode step's grouped-query attention (the n query heads that share a key/value head as n query
rows of it, over the unrepeated cache). At that shape SDPA's backends are slow: on the H200 at
Llama-3.2-1B shapes (8 KV heads, 4 rows each, 384 cached tokens) cuDNN takes 9.0 µs a call and a
memset (benchmarks/results/decode_h200/decode_options), where the cache is 0.8 MB.

The kernel: one program per (batch, head, slice of S); each streams its slice of the keys and
values once, in tiles of ``BLOCK_S`` tokens, with an online softmax over its rows (padded to 16
for the tensor cores). The slices are as many as fill the GPU's multiprocessors (about one
program each); with more than one, their partial sums (each slice's max, sum and weighted values,
in float32) are combined by the last program of the head to finish: each program counts itself
done on the head's counter (an atomic add, after its partial sums are stored), and the one that
counts last reads them all, writes the output and sets the counter back to 0. One launch a call,
where a second kernel combined: at 1B shapes on the H200 16 launches a step fewer, but only ~7 µs
of kernel time (attend 5.2 µs a layer, against attend 3.1 + combine 2.6; the combine's cost was its
work, not its launch: benchmarks/results/decode_h200_20261204b). The counters (``_Counters``)
are zeros kept per device: a launch captured into a CUDA graph takes counters of its own, for
good (a graph's launches never overlap another graph's use of them); other launches share one set
per stream (launches on one stream run one after another). Where no counters are free (a capture
before any launch outside one, or the set used up), the second kernel combines, as before. A
boolean mask is True where a token is attended; a float mask is added to the scores.

The fast path: CUDA, bf16 or fp16 (the same for q, k and v), head dims of at most 256, inner
dimensions contiguous, every offset within 32 bits (a layer's cache under 2^31 elements), Triton
importable. Anything else runs SDPA itself, so the op is right on
any input. Its fake implementation lets Dynamo, AOTAutograd and Inductor trace it. No backward:
it is for inference (decode).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from typing import Any

import torch
import torch.nn.functional as F

from shapewise.library.kernels.gemv import triton_gemv_available
from shapewise.library.kernels.pdl import pdl_supported

log = logging.getLogger("shapewise")

__all__ = ["decode_attention", "decode_attention_plan"]

_FAST_DTYPES = (torch.bfloat16, torch.float16)
BLOCK_S = 64  # tokens per tile
_MAX_DIM = 256
_MAX_PARTS = 64  # slices of S per head, at most


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_attention_plan(batch: int, heads: int, tokens: int, sms: int = 132) -> tuple[int, int]:
    """(slices of S, tokens per slice) for ``batch * heads`` programs over ``tokens`` cached
    tokens on a GPU of ``sms`` multiprocessors: enough slices for about one program per
    multiprocessor (at most 64 a head), each a whole number of ``BLOCK_S`` tiles, none empty."""
    tiles = max(1, _cdiv(tokens, BLOCK_S))
    want = min(_MAX_PARTS, max(1, _cdiv(sms, batch * heads)))
    per = _cdiv(tiles, want)
    return _cdiv(tiles, per), per * BLOCK_S


@functools.cache
def _kernels():
    from shapewise.library.kernels._decode_attention_jit import attend_slices, combine_slices

    return attend_slices, combine_slices


def _fast_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    if not (q.is_cuda and q.dim() == k.dim() == v.dim() == 4 and q.dtype in _FAST_DTYPES
            and k.dtype == v.dtype == q.dtype and k.device == v.device == q.device):
        return False
    (b, h, n, d), (s, dv) = q.shape, (k.shape[2], v.shape[3])
    if k.shape != (b, h, s, d) or v.shape[:3] != (b, h, s) or not (1 <= n <= 128 and s >= 1):
        return False
    if not (16 <= d <= _MAX_DIM and 16 <= dv <= _MAX_DIM) or q.stride(-1) != 1 or k.stride(-1) != 1 \
            or v.stride(-1) != 1:
        return False
    if max(_span(t) for t in (q, k, v)) >= 2**31:  # the kernels' offsets are 32-bit
        return False
    if mask is not None and not (mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] == mask.shape[2] == 1
                                 and mask.shape[3] in (1, s) and mask.device == q.device
                                 and (mask.dtype == torch.bool or mask.dtype.is_floating_point)):
        return False
    return triton_gemv_available()


def _span(t: torch.Tensor) -> int:
    """The largest element offset ``t`` reaches from its data pointer, plus one (0: no elements)."""
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))


@torch.library.custom_op("shapewise::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     scale: float | None = None, pdl: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`` for a mask shared
    by the query rows, through the Triton kernel where it runs (module docstring); ``pdl``: launched
    with programmatic dependent launch where the GPU has it (``kernels/pdl.py``)."""
    if not _fast_path(q, k, v, mask):
        # Contiguous, as the fake says: SDPA's CUDA backends return [B, n, H, D]-ordered memory, and
        # Inductor lays out what reads the op's output by the fake's strides.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).contiguous()
    with torch.cuda.device(q.device):
        return _launch(q, k, v, mask, scale, _sms(q.device.index if q.device.index is not None
                                                  else torch.cuda.current_device()), pdl=pdl)


class _Counters:
    """The heads' counters of the last-program combine (module docstring): int32 zeros, which
    each launch leaves at zero. A launch captured into a CUDA graph takes its own from a pool set
    aside per device (made by the device's first launch outside a capture: memory made during a
    capture is the graph's), never given back (a graph may be replayed for as long as it lives, and
    nothing says when it dies); other launches use their stream's. A capture that finds the pool
    used up combines with the second kernel, as before, said once in the log."""

    CAPTURED = 1 << 20  # counters set aside per device for captured launches (4 MiB)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._captured: dict[Any, list] = {}  # device -> [pool, next free]
        self._streams: dict[tuple, torch.Tensor] = {}  # (device, stream) -> its counters
        self._old: list[torch.Tensor] = []  # outgrown sets (a launch in flight may still use one)
        self._said = False  # the pool's end logged

    def take(self, device: torch.device, n: int) -> torch.Tensor | None:
        """``n`` counters for a launch on ``device``'s current stream, or None (combine with the second kernel)."""
        cuda = device.type == "cuda"
        if cuda and torch.cuda.is_current_stream_capturing():
            with self._lock:
                pool = self._captured.get(device)
                if pool is None or pool[1] + n > pool[0].numel():
                    if pool is not None and not self._said:
                        self._said = True
                        log.info("shapewise: decode_attention's counters for captured launches on %s are used up "
                                 "(%d, %d per launch): launches captured from now on combine their slices in a "
                                 "second kernel (one more launch a layer)", device, pool[0].numel(), n)
                    return None
                pool[1] += n
                return pool[0][pool[1] - n:pool[1]]
        key = (device, torch.cuda.current_stream(device).cuda_stream if cuda else 0)
        counters = self._streams.get(key)
        if counters is None or counters.numel() < n:
            with self._lock:
                if device not in self._captured:
                    self._captured[device] = [torch.zeros(self.CAPTURED, dtype=torch.int32, device=device), 0]
                if counters is not None:
                    self._old.append(counters)
                counters = self._streams[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        return counters


_COUNTERS = _Counters()


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
            sms: int, parts: int | None = None, last_combines: bool = True, pdl: bool = False) -> torch.Tensor:
    """The kernels on arguments ``_fast_path`` took (on the current device; or on the CPU under
    ``TRITON_INTERPRET=1``). ``parts``: so many slices of S instead of the plan's (benchmarks).
    ``last_combines``: the last program of a head combines its slices where counters are free
    (else, or False, a second kernel does). ``pdl``: the attention kernel launched with
    programmatic dependent launch where the device has it (``kernels/pdl.py``)."""
    pdl = pdl and pdl_supported(q.device)
    b, h, n, d = q.shape
    s, dv = k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    block_n = max(16, _next_pow2(n))
    dv_p2 = _next_pow2(dv)
    out = torch.empty((b, h, n, dv), dtype=q.dtype, device=q.device)
    if mask is not None:
        mask = mask.expand(b, 1, 1, s)
    if parts is None:
        parts, chunk = decode_attention_plan(b, h, s, sms)
    else:
        if parts < 1:
            raise ValueError(f"decode_attention: parts must be >= 1 (slices of the cache), got {parts}")
        chunk = _cdiv(_cdiv(s, BLOCK_S), parts) * BLOCK_S
        parts = _cdiv(s, chunk)
    attend, combine = _kernels()
    split = parts > 1
    ml = torch.empty((b * h * parts * block_n * 2) if split else 1, dtype=torch.float32, device=q.device)
    acc = torch.empty((b * h * parts * block_n * dv_p2) if split else 1, dtype=torch.float32, device=q.device)
    counts = _COUNTERS.take(q.device, b * h) if split and last_combines else None
    m_args = (mask, mask.stride(0), mask.stride(3)) if mask is not None else (q, 0, 0)
    attend[(b * h, parts)](
        q, k, v, m_args[0], out, ml, acc, counts if counts is not None else ml, h, s, chunk, scale, n,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), m_args[1], m_args[2], out.stride(0), out.stride(1), out.stride(2),
        HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.bool, SPLIT=split,
        LAST_COMBINES=counts is not None, PARTS_P2=_next_pow2(parts),
        BLOCK_N=block_n, BLOCK_S=BLOCK_S, D=d, D_P2=_next_pow2(d), DV=dv, DV_P2=dv_p2, PDL=pdl,
        num_warps=4, num_stages=2, **({"launch_pdl": True} if pdl else {}))
    if split and counts is None:
        combine[(b * h,)](ml, acc, out, h, parts, n, out.stride(0), out.stride(1), out.stride(2),
                          PARTS_P2=_next_pow2(parts), BLOCK_N=block_n, DV=dv, DV_P2=dv_p2, num_warps=4)
    return out


@decode_attention.register_fake
def _(q, k, v, mask=None, scale=None, pdl=False):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: f"shapewise::decode_attention: q, k, v must be 4-D, got {q.dim()}, {k.dim()}, {v.dim()}")
    torch._check(q.shape[-1] == k.shape[-1],
                 lambda: f"shapewise::decode_attention: q's head dim {q.shape[-1]} != k's {k.shape[-1]}")
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
