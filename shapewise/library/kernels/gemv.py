"""``shapewise::gemv``: ``y = x @ weight.T (+ bias)`` for a few rows (decode), as a Triton kernel
that streams the weight once, tuned per weight and row count on the first call.

At one to sixty-four rows a linear layer is a read of its weight: the arithmetic is small, and
the time is the weight's bytes over memory bandwidth. cuBLAS picks GEMM tilings for these
shapes that leave a third to half of the bandwidth unused (see
``benchmarks/results/gemv_h200``). Two Triton kernels (``gemv_launch.py``) stream the weight once:
``dot`` pads the rows to a tile of 16, 32 or 64 for the tensor cores (split-K for weights of few
rows, partials summed with float32 atomics); ``rows``, at one to four rows, sums in float32 on the
CUDA cores in small programs of whole weight rows.

The op runs the kernel where it can (CUDA, bf16/fp16, a weight whose rows are contiguous, at
most ``MAX_ROWS`` rows, Triton importable) and ``torch.nn.functional.linear`` everywhere else,
so it is right on any input. Its fake implementation lets Dynamo, AOTAutograd and Inductor
trace it, and its backward is the usual one, so it trains.

Tuning has two levels, each read from memory, then disk (``shapewise.library.kernels.store``:
``<shapewise cache>/gemv-tuning/``, one JSON file per GPU model, torch and Triton versions, kernel
source and shape, shared by every process and rank; ``rm -r`` the folder to clear it,
``SHAPEWISE_CACHE=0`` to keep it in memory only), else timed (``gemv_timing.time_calls``: CUDA-graph replays of
calls over copies of the weight past the L2, as a decode step's graph runs them) and written to
disk. Per weight (N, K, dtype, bias; under ``weights/``), every config of
``gemv_configs`` is timed once per row tile, at the tile's rows: the kernel computes the whole
tile, so one config is fastest at every row count of a tile. Per row count, only that config and ``F.linear``
are timed, at the real rows, and the faster kept (whether cuBLAS wins does depend on the rows).
``tune()`` does this ahead of time on random tensors (``DecodeGemv`` calls it at compile time).
Inside a CUDA graph capture nothing is timed: a shape missing from memory and disk takes its
weight's config when known, else the first that fits, untimed and not remembered.
``SHAPEWISE_GEMV_TUNE=0`` turns the timing off (first config, never written to disk).
A split-K config sums its K slices with float32 atomics, whose order varies: the last bits of
the result can differ from run to run (bf16 rounding of a float32 sum, well inside tolerance).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import logging
import marshal
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from shapewise.library.kernels import gemv_timing
from shapewise.library.kernels.gemv_launch import MAX_ROWS, ROW_TILES, GemvConfig, _launch, gemv_configs, row_tile
from shapewise.library.kernels.pdl import pdl_supported
from shapewise.library.kernels.store import MISSING, TuningStore

__all__ = ["GemvConfig", "MAX_ROWS", "ROW_TILES", "gemv", "gemv_config", "gemv_configs", "glu_pays", "kernel_always",
           "row_tile", "run_kernel", "triton_gemv_available", "tune", "tuning_stats"]

log = logging.getLogger("shapewise")
_FAST_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def triton_gemv_available() -> bool:
    """Whether the Triton kernel can run here (Triton importable and a CUDA device present)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_TUNED: dict[tuple, GemvConfig | None] = {}  # (rows, N, K, dtype, bias, device index) -> config or None
# (row tile, N, K, dtype, bias, device index) -> the weight's fastest config at that tile
_WINNERS: dict[tuple, GemvConfig | None] = {}
_TUNE_LOCK = threading.Lock()
_STATS_LOCK = threading.Lock()
_BUSY = object()  # with wait=False: another process holds the file lock of the tune we need


def _shape_key(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, index: int | None, glu: bool) -> tuple:
    return (rows, n, k, dtype, bias, index, *(("glu",) if glu else ()))  # "glu": the kernel of silu(x) * up


def gemv_config(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
                linear: bool = True, up: torch.Tensor | None = None) -> GemvConfig | None:
    """The config the op uses for these arguments (memory, then disk, then tuned on them; None:
    ``F.linear`` wins or no config compiled). ``linear=False``: the weight's fastest config, never
    ``F.linear`` (as with ``pdl=True``). ``up``: for the product of ``silu(x) * up`` (``gemv_glu``), tuned
    apart from the plain product, the activation in the kernel, against ``F.linear(F.silu(x) * up)``."""
    key = _shape_key(x.shape[0], w.shape[0], w.shape[1], x.dtype, b is not None, x.device.index, up is not None)
    return _config(key, x.device, lambda: (x, w, b, up), linear=linear)


def tune(rows: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, bias: bool = False,
         device: torch.device | str = "cuda", *, wait: bool = True, linear: bool = True,
         glu: bool = False) -> GemvConfig | None:
    """Tune ``x[rows, k] @ w[n, k].T (+ b[n])`` ahead of the op's first call, on random tensors
    (made with a generator of their own): the config the op will use, from memory or disk when
    some process tuned it already, else timed here and written to disk for the others. With
    ``wait=False`` a shape (or its weight) that another process is tuning right now is left to
    it (None, at once). ``linear=False``: the weight's config alone, never ``F.linear`` (what
    ``pdl=True`` runs). Needs the kernel's device (CUDA with Triton); a shape the kernel does not
    take (other dtypes, more rows, K < 16) is not timed: None, ``F.linear``. ``glu``: the product of
    ``silu(x) * up`` (``gemv_glu``'s kernel), tuned apart from the plain one."""
    if dtype not in _FAST_DTYPES or not 1 <= rows <= MAX_ROWS or k < 16 or n * k > _MAX_OFFSET:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    on = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with torch.no_grad(), on:
        return _config(_shape_key(rows, n, k, dtype, bias, device.index, glu), device,
                       functools.partial(_random_tensors, rows, n, k, dtype, bias, device, glu), wait, linear)


def _random_tensors(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, device: torch.device,
                    glu: bool = False) -> tuple:
    """(x, w, b, up) to time on, from a generator of their own (b None without bias, up without glu)."""
    g = torch.Generator(device).manual_seed(0)
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=device, generator=g)
    return make(rows, k), make(n, k), make(n) if bias else None, make(rows, k) if glu else None


def _config(key: tuple, device: torch.device, tensors: Callable[[], tuple], wait: bool = True,
            linear: bool = True) -> GemvConfig | None:
    """Memory, then disk (under the key's file lock), then ``_tune`` of the weight's config (the
    same three steps, ``_tune_weight`` last) against ``F.linear`` on ``tensors()``. ``linear=False``:
    the weight's config alone (the kernel runs even where ``F.linear`` would time faster alone)."""
    wkey = (row_tile(key[0]), *key[1:])
    memo, memo_key = (_TUNED, key) if linear else (_WINNERS, wkey)
    cfg = memo.get(memo_key, False)
    if cfg is not False:
        return cfg
    gpu, sms = _device_info(device)
    configs = gemv_configs(key[1], key[2], sms, row_tile(key[0]), glu="glu" in key[6:])
    if os.environ.get("SHAPEWISE_GEMV_TUNE", "1") == "0":
        memo[memo_key] = configs[0]  # untimed, by request
        return configs[0]
    store = TuningStore.default("gemv")
    weights = TuningStore(store.folder / "weights") if store is not None else None  # ``rm -r`` clears both
    fields, wfields = _fields(key, gpu, sms, configs), _weight_fields(wkey, gpu, sms, configs)

    made_once = functools.cache(tensors)  # the random tensors: made once, and only when something is timed

    def winner() -> GemvConfig | None:
        return _recall(_WINNERS, wkey, weights, wfields, configs, wait, lambda: _tune_weight(*made_once(), configs))

    def decide() -> GemvConfig | None:  # under the row count's file lock, then the weight's: always that order
        best = winner()
        return best if best is None or best is _BUSY else _tune(*made_once(), best)  # None: no config ran

    with _TUNE_LOCK:
        if memo_key in memo:
            return memo[memo_key]
        if _capturing():  # no timing inside a capture: what memory or disk has, else untimed and not remembered
            cfg = _load(store, fields, configs) if linear else MISSING
            if cfg is not MISSING:
                return _TUNED.setdefault(key, cfg)
            best = _WINNERS[wkey] if wkey in _WINNERS else _load(weights, wfields, configs)
            return configs[0] if best is MISSING else _WINNERS.setdefault(wkey, best)
        try:
            cfg = _recall(_TUNED, key, store, fields, configs, wait, decide) if linear else winner()
        finally:
            gemv_timing.drop_copies()  # the timing's weight copies
    return None if cfg is _BUSY else cfg  # _BUSY: another process is tuning it; the op's first call waits


def _recall(memo: dict, key: tuple, store: TuningStore | None, fields: dict, configs: list[GemvConfig], wait: bool,
            compute: Callable[[], GemvConfig | None]) -> GemvConfig | None:
    """``memo[key]``, else the stored record (under its file lock), else ``compute()``, written to
    disk; ``_BUSY`` (nothing kept) when ``wait`` is False and another process holds the lock."""
    if key in memo:
        return memo[key]
    with store.locked(fields, wait) if store is not None else contextlib.nullcontext(True) as held:
        if not held:
            return _BUSY
        cfg = _load(store, fields, configs)
        if cfg is MISSING:
            cfg = compute()
            if cfg is _BUSY:
                return _BUSY
            if store is not None:
                store.save(fields, None if cfg is None else dataclasses.asdict(cfg))
    memo[key] = cfg
    return cfg


def _load(store: TuningStore | None, fields: dict, configs: list[GemvConfig]):
    return store.load(fields, functools.partial(_parse, configs=configs)) if store is not None else MISSING


def _device_info(device: torch.device) -> tuple[str, int]:
    """(GPU model, multiprocessors): what a stored result is valid for."""
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@functools.cache
def _source_hash() -> str:
    """A hash of the code whose timing a stored result records (kernel, launch, tuner)."""
    # (the kernel's file is read, not imported: importing it imports Triton)
    h = hashlib.sha256(_JIT_SOURCE.read_bytes())
    for fn in _TIMED_CODE:
        try:
            h.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):  # no source shipped: the bytecode stands in
            h.update(marshal.dumps(fn.__code__))
    h.update(repr((gemv_timing.ROUNDS, gemv_timing.REPLAYS, gemv_timing.MAX_COPIES)).encode())
    return h.hexdigest()[:16]


@functools.cache
def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _weight_fields(wkey: tuple, gpu: str, sms: int, configs: list[GemvConfig]) -> dict:
    """A stored winner's key: everything that changes which config is fastest for the weight."""
    tile, n, k, dtype, bias = wkey[:5]  # not the device index: ranks on other GPUs of the model share it
    return {"kernel": "gemv", "level": "weight", "timed_rows": tile, "gpu": gpu, "sms": sms,
            "torch": torch.__version__, "triton": _triton_version(), "source": _source_hash(),
            "configs": hashlib.sha256(repr(configs).encode()).hexdigest()[:16],
            "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "bias": bool(bias),
            **({"glu": True} if "glu" in wkey[6:] else {})}


def _fields(key: tuple, gpu: str, sms: int, configs: list[GemvConfig]) -> dict:
    """A stored result's key: the weight's (``_weight_fields``) and the rows. The ``level`` field
    keeps the two kinds of record apart, and records of the one-level tuner (no ``level``) unread."""
    return {**_weight_fields((row_tile(key[0]), *key[1:]), gpu, sms, configs), "level": "rows", "rows": key[0]}


def _parse(value, configs: list[GemvConfig]) -> GemvConfig | None:
    """A stored config (None: ``F.linear``); one not among ``configs`` is refused."""
    if value is None:
        return None
    cfg = GemvConfig(**value)
    if cfg not in configs:
        raise ValueError(f"{cfg} is not one of the configs for this shape")
    return cfg


def _precompile(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, up: torch.Tensor | None,
                configs: list[GemvConfig]) -> None:
    """Compile every config's binary before any is timed, several at once: Triton's compile is
    mostly native passes and ``ptxas``, which run outside the GIL, so the compiles of one shape
    take about as long as its slowest. A config that fails here fails again when timed (skipped there)."""
    workers = min(len(configs), _compile_threads())
    if workers <= 1:
        return

    def compile_one(cfg: GemvConfig) -> None:
        try:
            with torch.cuda.device(x.device):  # Triton compiles for, and caches under, the current device
                _launch(x, w, b, cfg, warmup=True, up=up)
        except Exception as e:  # noqa: BLE001 - reported when the config is timed
            log.debug("shapewise gemv: config %s did not compile for x=%s weight=%s: %s", cfg, tuple(x.shape),
                      tuple(w.shape), e)

    with ThreadPoolExecutor(workers, thread_name_prefix="shapewise-gemv-compile") as pool:
        list(pool.map(compile_one, configs))


def _compile_threads() -> int:
    """Threads for ``_precompile``: ``SHAPEWISE_GEMV_COMPILE_THREADS``, else the CPUs this
    process may use (at most 16)."""
    env = os.environ.get("SHAPEWISE_GEMV_COMPILE_THREADS")
    if env:
        return max(1, int(env))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(16, cpus))


def _time(fn: Callable[[torch.Tensor], object], what: object, w: torch.Tensor) -> float:
    """``gemv_timing.time_calls(fn, w)``; infinite (logged) when ``what`` (a config that does not
    compile or fit) fails."""
    try:
        return gemv_timing.time_calls(fn, w)
    except Exception as e:  # noqa: BLE001 - a config that fails is skipped, never a run
        log.debug("shapewise gemv: %s failed for weight=%s: %s", what, tuple(w.shape), e)
        return float("inf")


def _tune_weight(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, up: torch.Tensor | None,
                 configs: list[GemvConfig]) -> GemvConfig | None:
    """The fastest of ``configs`` for ``w`` (None: none ran), timed at as many random rows as
    ``x``'s row tile holds. One row count stands for all of a tile: the kernel pads the rows to its
    tile (masked loads and stores), so every row count of a tile streams the same weight in the
    same tiles and one config is fastest for all (up to noise); the full tile is the most work any
    of them does. With ``up``, the configs of ``silu(x) * up``'s product (the activation in the kernel)."""
    tile = row_tile(x.shape[0])
    if x.shape[0] != tile:
        g = torch.Generator(x.device).manual_seed(0)
        x = torch.randn(tile, x.shape[1], dtype=x.dtype, device=x.device, generator=g)
        up = None if up is None else torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=g)
    t0 = time.perf_counter()
    _precompile(x, w, b, up, configs)
    t1 = time.perf_counter()
    best, best_ms = None, float("inf")
    for cfg in configs:
        ms = _time(lambda w_, cfg=cfg: _launch(x, w_, b, cfg, up=up), cfg, w)
        if ms < best_ms:
            best, best_ms = cfg, ms
    t2 = time.perf_counter()
    _count(weights=1, weight_timings=len(configs), compile_s=t1 - t0, weight_timing_s=t2 - t1, timing_s=t2 - t1)
    if best is None:
        log.warning("shapewise gemv: no kernel config ran for weight=%s; using F.linear", tuple(w.shape))
    return best


def _tune(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, up: torch.Tensor | None,
          best: GemvConfig) -> GemvConfig | None:
    """``best`` (the weight's winner, ``_tune_weight``) against ``F.linear`` at ``x``'s rows:
    the faster (None: ``F.linear``); whether cuBLAS wins changes with the row count. With ``up``:
    against what ``gemv_glu`` runs without the kernel, ``F.linear(F.silu(x) * up)``."""
    t0 = time.perf_counter()
    best_ms = _time(lambda w_: _launch(x, w_, b, best, up=up), best, w)
    linear_ms = _time(lambda w_: F.linear(x if up is None else F.silu(x) * up, w_, b), "F.linear", w)
    dt = time.perf_counter() - t0
    _count(shapes=1, shape_timings=2, shape_timing_s=dt, timing_s=dt)
    if linear_ms < best_ms:
        log.info("shapewise gemv: F.linear (%.1f us) beats the kernel (%.1f us, %s) at rows=%d weight=%s",
                 linear_ms * 1e3, best_ms * 1e3, best, x.shape[0], tuple(w.shape))
        return None
    return best if best_ms < float("inf") else None


_GLU_PAYS: dict[tuple, bool] = {}  # (rows, N, K, dtype, bias, device, linear) -> glu_pays' answer, in this process
_GLU_LOCK = threading.Lock()
GLU_DECISIONS: list[dict] = []  # glu_pays' timings in this process (what the benchmarks report), one a shape


def glu_pays(rows: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, bias: bool = False,
             device: torch.device | str = "cuda", *, linear: bool = True) -> bool:
    """Whether ``gemv_glu``'s kernel (``silu(x) * up`` computed as it loads x) takes less time than
    what runs without it: an activation kernel, then the plain product as its tuning chose it (the
    kernel or ``F.linear``; ``linear=False``: the weight's kernel config for both, as the ops run under
    PDL). Both timed as ``time_calls`` times the tuner's, in one call each (the activation as
    ``F.silu(x)``, one kernel, as Inductor fuses silu and the product into one), so a replay's launch
    cost weighs on both alike: timed apart, the activation's share of it was counted twice (an H100,
    2026-12-07: 6.5 µs for a 22 KB activation; a GLU kernel 3.5 µs slower taken, the forward 12 µs slower).
    Once per shape a process (memory only). False where the GLU kernel's tuning chose ``F.linear``, a timing
    failed, or ``SHAPEWISE_GEMV_TUNE=0``. Answers in ``GLU_DECISIONS``. Needs the kernel's device, as ``tune``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (rows, n, k, dtype, bias, device, linear)  # (_GLU_LOCK, then the tuner's lock: always that order)
    with _GLU_LOCK:
        if key not in _GLU_PAYS:
            _GLU_PAYS[key] = _time_glu(rows, n, k, dtype, bias, device, linear)
        return _GLU_PAYS[key]


def _time_glu(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, device: torch.device, linear: bool) -> bool:
    """``glu_pays``' answer, timed (under ``_GLU_LOCK``); recorded in ``GLU_DECISIONS``."""
    glu_cfg = plain_cfg = None
    glu_ms = unfused_ms = float("inf")
    if os.environ.get("SHAPEWISE_GEMV_TUNE", "1") != "0":
        glu_cfg = tune(rows, n, k, dtype, bias, device, glu=True, linear=linear)
        plain_cfg = tune(rows, n, k, dtype, bias, device, linear=linear)
    if glu_cfg is not None:
        x, w, b, up = _random_tensors(rows, n, k, dtype, bias, device, glu=True)

        def unfused(w_: torch.Tensor) -> object:
            act = F.silu(x)
            return F.linear(act, w_, b) if plain_cfg is None else _launch(act, w_, b, plain_cfg)

        on = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with torch.no_grad(), on, _TUNE_LOCK:
            try:
                glu_ms = _time(lambda w_: _launch(x, w_, b, glu_cfg, up=up), glu_cfg, w)
                unfused_ms = _time(unfused, "the activation, then the product", w)
            finally:
                gemv_timing.drop_copies()
    pays = math.isfinite(glu_ms) and math.isfinite(unfused_ms) and glu_ms <= unfused_ms  # (inf: not timed, or failed)
    GLU_DECISIONS.append({"rows": rows, "n": n, "k": k, "glu_us": round(glu_ms * 1e3, 2),
                          "glu_config": str(glu_cfg or "F.linear"), "unfused_us": round(unfused_ms * 1e3, 2),
                          "plain_config": str(plain_cfg or "F.linear"), "pays": pays})
    log.info("shapewise gemv: silu(x) * up in the kernel %s at rows=%d weight=[%d, %d]: %.1f us (%s) against %.1f us "
             "(the activation's kernel, then %s)", "pays" if pays else "does not pay", rows, n, k, glu_ms * 1e3,
             glu_cfg or "F.linear", unfused_ms * 1e3, plain_cfg or "F.linear")
    return pays


_STATS = {"weights": 0, "weight_timings": 0, "compile_s": 0.0, "weight_timing_s": 0.0,
          "shapes": 0, "shape_timings": 0, "shape_timing_s": 0.0, "timing_s": 0.0}


def _count(**add: float) -> None:
    with _STATS_LOCK:
        for name, value in add.items():
            _STATS[name] += value


def tuning_stats() -> dict[str, float]:
    """What this process's tuning did so far. Per weight: ``weights`` tuned, ``weight_timings``
    (configs timed), ``compile_s`` (``_precompile``'s wall time), ``weight_timing_s``. Per row
    count: ``shapes`` tuned, ``shape_timings`` (its weight's config and ``F.linear``: two a shape),
    ``shape_timing_s``. ``timing_s``: both levels. What memory or disk held counts nothing."""
    with _STATS_LOCK:
        return dict(_STATS)


# what ``_source_hash`` covers, bound at import
_TIMED_CODE = (_launch, _tune_weight, _tune, gemv_timing.time_calls, gemv_timing.weight_copies)
_JIT_SOURCE = Path(__file__).with_name("_gemv_jit.py")
_MAX_OFFSET = 2**31 - 1  # the kernel's pointer offsets are 32-bit


def _fast_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes these arguments; anything else (wrong shapes included: F.linear
    raises its own error for them) goes to ``F.linear``."""
    if not (x.is_cuda and x.dim() and weight.dim() == 2 and x.shape[-1] == weight.shape[1] >= 16):
        return False
    rows, (n, k) = x.numel() // x.shape[-1], weight.shape
    return (x.dtype in _FAST_DTYPES and weight.dtype == x.dtype and weight.device == x.device
            and weight.stride(1) == 1 and 1 <= rows <= MAX_ROWS and (n - 1) * weight.stride(0) + k <= _MAX_OFFSET
            and (bias is None or (bias.shape == (n,) and bias.dtype == x.dtype and bias.device == x.device
                                  and bias.is_contiguous()))
            and triton_gemv_available())


@torch.library.custom_op("shapewise::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the Triton kernel where it runs (module docstring);
    ``pdl``: launched with programmatic dependent launch where the GPU has it (``kernels/pdl.py``),
    and then the kernel wherever it runs, ``F.linear`` never chosen for its time alone."""
    y = run_kernel(x, weight, bias, pdl)
    return F.linear(x, weight, bias) if y is None else y


def kernel_always(pdl: bool, device: torch.device) -> bool:
    """Whether a call with ``pdl`` runs the weight's kernel config even where ``F.linear`` times
    faster (``linear=False`` to the tuner): with PDL where the GPU has it, since cuBLAS's kernels
    take no part in PDL, so one between two PDL kernels ends their overlap, which its time alone
    (what ``_tune`` compares) does not show. The op and ``DecodeGemv``'s tuning ahead both ask this."""
    return pdl and pdl_supported(device)


def run_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool = False,
               up: torch.Tensor | None = None) -> torch.Tensor | None:
    """The kernel's ``x @ weight.T (+ bias)`` (of ``silu(x) * up`` where ``up`` is given: x's shape,
    dtype and strides), or None where it does not run (``F.linear``'s to compute)."""
    if not _fast_path(x, weight, bias) or up is not None and (up.shape != x.shape or up.dtype != x.dtype
                                                               or up.device != x.device):
        return None
    x2, u2 = x.reshape(-1, x.shape[-1]), None if up is None else up.reshape(-1, up.shape[-1])
    if u2 is not None and u2.stride() != x2.stride():
        return None
    with torch.cuda.device(x.device):  # Triton launches on the current device
        cfg = gemv_config(x2, weight, bias, linear=not kernel_always(pdl, x.device), up=u2)
        return None if cfg is None else _launch(x2, weight, bias, cfg, pdl=pdl, up=u2).reshape(
            *x.shape[:-1], weight.shape[0])


@gemv.register_fake
def _(x, weight, bias=None, pdl=False):
    torch._check(weight.dim() == 2, lambda: f"shapewise::gemv: weight must be 2-D [N, K], got {tuple(weight.shape)}")
    torch._check(x.shape[-1] == weight.shape[1],
                 lambda: f"shapewise::gemv: x's last dim {x.shape[-1]} != weight's K {weight.shape[1]}")
    if bias is not None:
        torch._check(bias.dim() == 1 and bias.shape[0] == weight.shape[0],
                     lambda: f"shapewise::gemv: bias must be [N] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        gx = grad @ weight
    if ctx.needs_input_grad[1]:
        gw = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gb = grad.reshape(-1, grad.shape[-1]).sum(0)
    return gx, gw, gb, None


gemv.register_autograd(_backward, setup_context=_setup)
