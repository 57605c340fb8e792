"""The Triton kernels behind ``shapewise::gemv`` (``_gemv_jit.py``), their launch
configurations and their launch; ``gemv.py`` holds the op and the tuner that picks a config.

- ``dot`` (``gemv_kernel``): the rows padded to a tile of 16, 32 or 64 for the tensor cores, each
  program ``block_n`` weight rows and one K slice (split-K for weights of few rows, summed with
  float32 atomics), the weight staged through shared memory in ``num_stages`` steps.
- ``wdot`` (``gemv_kernel`` with ``SWAP``): the same with the product turned round, ``w @ x.T``:
  64 or 128 weight rows are the tensor-core product's M side, so that on Hopper Triton emits
  wgmma, which reads the weight from shared memory where ``dot``'s mma.sync loads it into registers
  first (``ldmatrix``). Timed by the tuner beside ``dot`` (``SHAPEWISE_GEMV_WDOT=0`` leaves it out). On
  the H100 (``benchmarks/results/wdot_20261207``) the tuner took it for three of the 7B stack's four
  weights at 5-16 rows and for gate-up at 64, and the stack's forward went 687 -> 662 µs at 5 tokens,
  693 -> 670 at 8, 696 -> 672 at 16 and 732 -> 717 at 64.
- ``rows`` (``gemv_rows_kernel``), for one to four rows: no tensor cores and no split-K. Each program
  takes 1-8 whole weight rows, loads ``[block_n, block_k]`` tiles with 16-byte vector loads and sums
  in float32: small programs (~32 registers), many on each multiprocessor, so that the bytes in
  flight come from the number of programs, and no partial sums cross programs (no memset, atomics
  or conversion).

Tuning times every kind per weight and row tile (``gemv_configs``); neither is assumed faster.
``SHAPEWISE_GEMV_ROWS=0`` leaves the ``rows`` kernel out (tiles 1 and 4 then time the dot configs alone).
On the H100 (``benchmarks/results/h100_20261206_rows``) it won the tuning on every 1B weight at one row.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from shapewise.library.kernels.pdl import pdl_supported, prefetch_elements

__all__ = ["GemvConfig", "MAX_ROWS", "ROW_TILES", "gemv_configs", "row_tile"]

#: The tuner's row tiles: a row count is tuned as the first tile that holds it (one config serves all
#: of a tile). The ``rows`` kernel computes as many rows as the tile (1 or 4); ``dot`` pads to 16 or more.
ROW_TILES = (1, 4, 16, 32, 64)
#: The most rows the kernel takes; more rows go to ``F.linear``.
MAX_ROWS = ROW_TILES[-1]
#: The most rows the ``rows`` kernel takes.
MAX_ROWS_KERNEL_ROWS = 4
#: Under PDL, where a kernel lets the one behind it launch: after its main loop (default), or right
#: after its wait (``SHAPEWISE_GEMV_PDL_TRIGGER=early``, as before 2026-12-06). On an H100 a 16-layer
#: chain of the 1B's GEMVs took 63.1 µs a layer late, 67.0 early, 51.1 without PDL (one run, one set of
#: configs; benchmarks/results/h100_20261206_default): PDL loses either way. Read once, at import.
PDL_TRIGGER_EARLY = os.environ.get("SHAPEWISE_GEMV_PDL_TRIGGER", "late") == "early"


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration: the kernel (``dot``, ``wdot`` or ``rows``), weight rows and K per step, K
    slices, warps, pipeline stages (``rows``: always 1 slice and 1 stage)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    kernel: str = "dot"

    def __str__(self) -> str:
        if self.kernel == "rows":
            return f"rows.n{self.block_n}.k{self.block_k}.w{self.num_warps}"
        kind = "wdot." if self.kernel == "wdot" else ""
        return f"{kind}n{self.block_n}.k{self.block_k}.split{self.split_k}.w{self.num_warps}.s{self.num_stages}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_tile(rows: int) -> int:
    """The row tile ``rows`` rows (at most ``MAX_ROWS``) are tuned as: the first of ``ROW_TILES`` that holds them."""
    return next(t for t in ROW_TILES if rows <= t)


# Shared memory a dot config's pipeline may take (its stages of x and weight tiles, 2-byte elements):
# Hopper gives a block 227 KiB; Triton's own needs come on top.
_SMEM_BUDGET = 192 << 10
# The dot tilings (block_n, block_k, warps, stages); the 64-wide ones are for row tiles above 16.
_DOT_TILINGS = ((16, 256, 4, 4), (16, 256, 4, 6), (16, 512, 4, 3), (16, 512, 8, 4), (32, 128, 4, 8), (32, 256, 4, 4),
                (32, 256, 4, 6), (32, 512, 8, 3), (64, 256, 8, 3), (64, 128, 4, 4), (32, 64, 4, 4), (64, 64, 4, 3))
# The wdot tilings (block_n, block_k, warps, stages): 64 or 128 weight rows, the M side of Hopper's
# wgmma (m64nNk16: the rows are its N, 16-64), which reads both operands from shared memory: the weight
# goes global -> shared (cp.async) -> tensor cores, where ``dot``'s mma.sync also moves it through the
# registers (ldmatrix). Checked by compiling for sm_90a on a CPU machine (Triton 3.6): wgmma, no ldmatrix.
_WDOT_TILINGS = ((64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (64, 256, 4, 4), (128, 128, 4, 3),
                 (128, 128, 8, 4))
# More wdot tilings, timed only where ``SHAPEWISE_GEMV_WDOT_MORE=1`` (an experiment, 2026-12-07): at a
# row tile of 64 the shared-memory budget leaves two of the tilings above, and cuBLAS kept the 7B stack's
# qkv, o and down weights at 64 rows (75-88% of the bandwidth, against wdot's 90% on gate-up). Timed on an H100
# (benchmarks/results/norm_h100_20261207): no gain (the 7B stack 668 / 717 against 655 / 705 µs at 16 / 64 rows),
# so it stays off; the kernel tests still run them against float64 (they set it).
_WDOT_MORE_TILINGS = ((64, 64, 4, 8), (128, 64, 4, 6), (128, 64, 8, 6), (64, 128, 4, 5), (128, 128, 8, 3),
                      (256, 64, 8, 4))
# The rows tilings (block_n, block_k, warps): weight tiles of 2-8K elements (4-16 KiB in bf16).
_ROWS_TILINGS = ((1, 2048, 4), (2, 1024, 4), (2, 2048, 4), (4, 512, 4), (4, 1024, 4), (4, 2048, 8), (8, 512, 4),
                 (8, 1024, 8))
# A rows program holds tile x block_n x block_k float32 products: at most this many (ptxas for sm_90a: 32-69
# registers a thread, no spills, for every tiling kept).
_ROWS_PRODUCTS = 8192


def gemv_configs(n: int, k: int, sms: int = 132, tile: int = 16, glu: bool = False) -> list[GemvConfig]:
    """The candidates tuning times for an [n, k] weight on a GPU of ``sms`` multiprocessors, at
    row tile ``tile``: the dot tilings whose pipeline fits the shared memory at that tile (at least
    16 rows), each with one K slice and, where it has fewer tiles than two per multiprocessor, with
    enough K slices for that (a power of two, at most 8); then, at tiles of at most
    ``MAX_ROWS_KERNEL_ROWS`` rows (unless ``SHAPEWISE_GEMV_ROWS=0``), the rows tilings whose
    products fit the registers. ``glu``: the kernel of ``silu(x) * up``, whose pipeline also stages
    the ``up`` tiles (a second x tile a stage: on a CPU machine, ptxas for sm_90a, Triton 3.6)."""
    dot_tile = max(16, tile)
    out = []
    tilings = [(t, "dot") for t in _DOT_TILINGS]
    if os.environ.get("SHAPEWISE_GEMV_WDOT", "1") != "0":
        tilings += [(t, "wdot") for t in _WDOT_TILINGS]
        if os.environ.get("SHAPEWISE_GEMV_WDOT_MORE") == "1":
            tilings += [(t, "wdot") for t in _WDOT_MORE_TILINGS]
    for (bn, bk, warps, stages), kernel in tilings:
        if ((1 + glu) * dot_tile + bn) * bk * 2 * stages > _SMEM_BUDGET or (dot_tile == 16 and bk == 64):
            continue
        splits = [1]
        want = _cdiv(2 * sms, _cdiv(n, bn))
        if want > 1:
            split = min(8, 1 << (want - 1).bit_length())
            if k >= split * bk:
                splits.append(split)
        out.extend(GemvConfig(bn, bk, s, warps, stages, kernel) for s in splits)
    if tile <= MAX_ROWS_KERNEL_ROWS and os.environ.get("SHAPEWISE_GEMV_ROWS", "1") != "0":
        out.extend(GemvConfig(bn, bk, 1, warps, 1, "rows") for bn, bk, warps in _ROWS_TILINGS
                   if tile * bn * bk <= _ROWS_PRODUCTS)
    return out


@functools.cache
def _kernels():
    from shapewise.library.kernels._gemv_jit import gemv_kernel, gemv_rows_kernel

    return {"dot": gemv_kernel, "wdot": gemv_kernel, "rows": gemv_rows_kernel}


def _launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: GemvConfig, *,
            warmup: bool = False, pdl: bool = False, up: torch.Tensor | None = None,
            norm: tuple[torch.Tensor, float] | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run ``cfg`` on (x, w, b); ``warmup=True`` only compiles its binary (nothing runs).
    ``pdl``: with programmatic dependent launch where the device has it (``kernels/pdl.py``).
    ``up`` (x's shape and strides): the product of ``silu(x) * up`` and ``w`` (a gated MLP's down
    projection, its activation computed as the kernel loads it). ``norm`` (g [k], contiguous; eps): the
    product of ``rms_norm(x) * g`` (each row's sum of squares taken as the kernel loads it; the rows'
    1 / rms scale the product). ``residual`` ([m, n], contiguous, x's dtype): added to the result."""
    m, k = x.shape
    n = w.shape[0]
    tile = row_tile(m)
    pdl = pdl and pdl_supported(x.device)
    rows = cfg.kernel == "rows"
    if rows and tile > MAX_ROWS_KERNEL_ROWS:
        raise ValueError(f"shapewise gemv: config {cfg} takes at most {MAX_ROWS_KERNEL_ROWS} rows, got {m}")
    if cfg.split_k == 1 or warmup:  # a warm-up launches nothing: its output need not be zeroed
        y = torch.empty((m, n), dtype=x.dtype if cfg.split_k == 1 else torch.float32, device=x.device)
    else:
        y = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    grid = (_cdiv(n, cfg.block_n), cfg.split_k)
    chunk = k if rows else _cdiv(k, cfg.split_k * cfg.block_k) * cfg.block_k  # each program's slice of K
    ahead = prefetch_elements(w, cfg.split_k, chunk) if pdl else 0  # 0: no prefetch
    strides = (x.stride(0), x.stride(1), w.stride(0), w.stride(1))
    args = (x, up if up is not None else x, w, b if b is not None else w, y, m, n, k,
            *(() if rows else (chunk,)), ahead, *strides, norm[0] if norm is not None else w,
            residual if residual is not None else w, float(norm[1]) if norm is not None else 0.0)
    meta = dict(HAS_BIAS=b is not None, BLOCK_M=tile if rows else max(16, tile), BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, EVEN_K=k % (cfg.block_k * cfg.split_k) == 0, PDL=pdl, PREFETCH=ahead > 0,
                ELEM=w.element_size(), PF=max(1, 32 * cfg.num_warps // cfg.block_n), GLU=up is not None,
                EARLY=PDL_TRIGGER_EARLY, **({"SWAP": True} if cfg.kernel == "wdot" else {}),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({} if rows else {"SPLIT": cfg.split_k > 1}),
                **({"launch_pdl": True} if pdl else {}), **({"NORM": True} if norm is not None else {}),
                **({"RES": True} if residual is not None else {}))
    kernel = _kernels()[cfg.kernel]
    if warmup:
        kernel.warmup(*args, grid=grid, **meta)
        return None
    kernel[grid](*args, **meta)
    return y if cfg.split_k == 1 else y.to(x.dtype)
