"""``shapewise::gemv``'s tuning results on disk (``shapewise.library.kernels.store``): round trips, keys,
broken files, the cache switch, concurrent writers, the two tuning levels (candidates timed once
per weight, the winner against F.linear per row count), and ``DecodeGemv`` tuning at compile time.

On the CPU a stand-in GPU replaces the timing (``gemv_timing.time_calls``), the launch and the device query, so
the real lookup and tuner run; the GPU test (marker ``gpu``) tunes a real shape."""

from __future__ import annotations

import gc
import importlib
import json
import logging
import multiprocessing
import threading
import time
import types
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shapewise as sw
from shapewise.library.kernels import gemv_timing
from shapewise.library.kernels.store import MISSING, TuningStore

gemv = importlib.import_module("shapewise.library.kernels.gemv")  # the package's ``gemv`` is the op
decode_gemv = importlib.import_module("shapewise.library.decode_gemv")
SHAPE = dict(rows=10, n=64, k=256, dtype=torch.bfloat16, bias=True)


class StandInGpu:
    """Times ``fastest`` at 1 ms, other configs at 2 ms (or ``kernel_ms(cfg, rows)``) and F.linear
    at ``linear_ms`` (a number, or a function of the rows); counts tunes (F.linear timings) and,
    in ``benched``, every timing by (config or "linear", rows)."""

    def __init__(self, monkeypatch, name: str = "Stand-in GPU", linear_ms=5.0, delay: float = 0.0, kernel_ms=None,
                 silu_ms: float = 0.5):
        self.name, self.linear_ms, self.delay, self.kernel_ms, self.silu_ms = name, linear_ms, delay, kernel_ms, silu_ms
        self.fastest = gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132)[3]
        self.tunes, self._last, self.benched, self._silu_first = 0, None, Counter(), False
        monkeypatch.setattr(gemv, "_device_info", lambda device: (self.name, 132))
        monkeypatch.setattr(gemv, "_capturing", lambda: False)  # no CUDA query (a forked child cannot make one)
        monkeypatch.setattr(gemv, "_launch", self._launch)
        monkeypatch.setattr(gemv, "F", types.SimpleNamespace(linear=self._linear, silu=self._silu))
        monkeypatch.setattr(gemv_timing, "time_calls", self._bench)

    def _launch(self, x, w, b, cfg, up=None):  # with up (silu(x) * up's product): ("glu", cfg)
        self._last = (cfg if up is None else ("glu", cfg), x.shape[0])
        if self._silu_first:  # silu, then this product, in one timed call: timed as both
            self._last, self._silu_first = (("silu", cfg), x.shape[0]), False

    def _linear(self, x, w, b=None):
        self._last = ("linear", x.shape[0])

    def _silu(self, x):
        self._silu_first = True
        return x

    def _bench(self, fn, w) -> float:
        fn(w)
        time.sleep(self.delay)
        self.benched[self._last] += 1
        what, rows = self._last
        if isinstance(what, tuple) and what[0] == "silu":  # the activation's kernel, then the plain product
            return self.silu_ms + (1.0 if what[1] == self.fastest else 2.0)
        if what == "linear":
            self.tunes += 1  # F.linear is timed once per tune
            return self.linear_ms(rows) if callable(self.linear_ms) else self.linear_ms
        if self.kernel_ms is not None:
            return self.kernel_ms(what, rows)
        return 1.0 if what == self.fastest else 2.0


@pytest.fixture
def store(tmp_path, monkeypatch) -> TuningStore:
    monkeypatch.setenv("SHAPEWISE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SHAPEWISE_GEMV_TUNE", raising=False)
    _forget(monkeypatch)
    return TuningStore.default("gemv")


def _forget(monkeypatch) -> None:
    """Empty the tuner's memory (both levels), as in a process started later."""
    monkeypatch.setattr(gemv, "_TUNED", {})
    monkeypatch.setattr(gemv, "_WINNERS", {})


def _files(store: TuningStore) -> list:
    return sorted(store.folder.glob("*.json")) if store.folder.is_dir() else []


def test_a_tuned_shape_is_written_once_and_read_back_by_a_fresh_process(store, monkeypatch):
    gpu = StandInGpu(monkeypatch)
    assert gemv.tune(**SHAPE, device="cpu") == gpu.fastest and gpu.tunes == 1
    (path,) = _files(store)
    data = json.loads(path.read_text())
    assert data["value"] == {"block_n": gpu.fastest.block_n, "block_k": gpu.fastest.block_k,
                             "split_k": gpu.fastest.split_k, "num_warps": gpu.fastest.num_warps,
                             "num_stages": gpu.fastest.num_stages, "kernel": gpu.fastest.kernel}
    assert {k: data["key"][k] for k in ("gpu", "rows", "n", "k", "dtype", "bias")} == {
        "gpu": "Stand-in GPU", "rows": 10, "n": 64, "k": 256, "dtype": "bfloat16", "bias": True}
    assert gemv.tune(**SHAPE, device="cpu") == gpu.fastest and gpu.tunes == 1  # memory
    monkeypatch.setattr(gemv, "_TUNED", {})  # a process started later: memory empty, disk has it
    x, w, b = torch.randn(10, 256, dtype=torch.bfloat16), torch.randn(64, 256, dtype=torch.bfloat16), torch.ones(64)
    assert gemv.gemv_config(x, w, b) == gpu.fastest and gpu.tunes == 1
    gpu.linear_ms = 0.5  # F.linear wins a shape of its own: None is stored and read back as None
    assert gemv.tune(**{**SHAPE, "rows": 11}, device="cpu") is None and gpu.tunes == 2
    monkeypatch.setattr(gemv, "_TUNED", {})
    assert gemv.tune(**{**SHAPE, "rows": 11}, device="cpu") is None and gpu.tunes == 2
    assert len(_files(store)) == 2


def test_the_key_holds_everything_that_changes_the_answer(store, monkeypatch):
    configs = gemv.gemv_configs(64, 256, 132)

    def path(key=(2, 64, 256, torch.bfloat16, True, 0), gpu="H200", sms=132, cfgs=configs):
        return store.path(gemv._fields(key, gpu, sms, cfgs))

    base = path()
    assert path(key=(2, 64, 256, torch.bfloat16, True, 1)) == base  # ranks on other GPUs of the model share it
    other = [path(gpu="A100"), path(sms=108), path(cfgs=configs[:-1]), path(key=(1, 64, 256, torch.bfloat16, True, 0)),
             path(key=(2, 65, 256, torch.bfloat16, True, 0)), path(key=(2, 64, 512, torch.bfloat16, True, 0)),
             path(key=(2, 64, 256, torch.float16, True, 0)), path(key=(2, 64, 256, torch.bfloat16, False, 0))]
    for module, name in ((gemv, "_triton_version"), (torch, "__version__"), (gemv, "_source_hash")):
        with monkeypatch.context() as m:
            real = getattr(module, name)
            m.setattr(module, name, (lambda: "9.9.9") if callable(real) else "9.9.9")
            other.append(path())
    assert base not in other and len(set(other)) == len(other)


@pytest.mark.parametrize("broken", ["{not json", "", '{"format": 1, "key": {"rows": 1}, "value": null}',
                                    '{"format": 1, "key": KEY, "value": {"block_n": 7, "block_k": 3}}',
                                    '{"format": 1, "key": KEY, "value": {"tile": 1}}'])
def test_a_broken_file_warns_once_is_tuned_again_and_rewritten(store, monkeypatch, caplog, broken):
    gpu = StandInGpu(monkeypatch)
    gemv.tune(**SHAPE, device="cpu")
    (path,) = _files(store)
    key = json.dumps(json.loads(path.read_text())["key"])
    path.write_text(broken.replace("KEY", key))
    monkeypatch.setattr(gemv, "_TUNED", {})
    with caplog.at_level(logging.WARNING, logger="shapewise"):
        assert gemv.tune(**SHAPE, device="cpu") == gpu.fastest
    assert gpu.tunes == 2
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"shapewise: ignoring the tuning file {path}"]
    assert json.loads(path.read_text())["value"]["block_n"] == gpu.fastest.block_n


def test_with_the_cache_off_or_timing_off_nothing_is_written(store, monkeypatch):
    gpu = StandInGpu(monkeypatch)
    monkeypatch.setenv("SHAPEWISE_CACHE", "0")
    assert TuningStore.default("gemv") is None
    assert gemv.tune(**SHAPE, device="cpu") == gpu.fastest and gpu.tunes == 1  # tuned, in memory only
    monkeypatch.delenv("SHAPEWISE_CACHE")
    monkeypatch.setenv("SHAPEWISE_GEMV_TUNE", "0")
    first = gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132)[0]
    assert gemv.tune(**{**SHAPE, "rows": 5}, device="cpu") == first and gpu.tunes == 1  # untimed
    assert not store.folder.exists()


def test_threads_writing_one_key_leave_a_whole_file(tmp_path, caplog):
    store = TuningStore(tmp_path)
    key = {"kernel": "test", "rows": 1}
    values = [{"writer": i, "pad": "x" * 4000} for i in range(8)]
    seen = []

    def write(v):
        for _ in range(30):
            store.save(key, v)
            seen.append(store.load(key))

    with caplog.at_level(logging.WARNING, logger="shapewise"):
        threads = [threading.Thread(target=write, args=(v,)) for v in values]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not caplog.records and all(v in values for v in seen) and store.load(key) in values
    assert [p.name for p in tmp_path.iterdir()] == [store.path(key).name]  # no temp files left
    assert TuningStore(tmp_path / "missing").load(key) is MISSING


def _tune_in_child(conn) -> None:
    gemv.tune(**SHAPE, device="cpu")
    conn.send(gemv_timing.time_calls.__self__.tunes)


def test_processes_sharing_the_folder_tune_a_shape_once(store, monkeypatch):
    gpu = StandInGpu(monkeypatch, delay=0.01)  # ~0.2 s a tune: the second process waits on the lock
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_tune_in_child, args=(child,)) for _, child in pipes]
    for p in procs:
        p.start()
    for _, child in pipes:
        child.close()  # so that a child that dies is an EOFError here, not a hang
    tunes = [parent.recv() if parent.poll(60) else None for parent, _ in pipes]
    for p in procs:
        p.join(timeout=30)
    assert sorted(tunes) == [0, 1] and len(_files(store)) == 1
    assert gemv.tune(**SHAPE, device="cpu") == gpu.fastest and gpu.tunes == 0  # this process reads it too


ROWS = (9, 10, 12, 16)  # one row tile (16): the weight is tuned once for all


def _row(rows: int) -> dict:
    return {**SHAPE, "rows": rows}


def _weight_files(store: TuningStore) -> list:
    return _files(TuningStore(store.folder / "weights"))


def _delta(before: dict) -> dict:
    return {name: value - before[name] for name, value in gemv.tuning_stats().items() if not name.endswith("_s")}


def test_a_weights_candidates_are_timed_once_and_each_row_count_times_two(store, monkeypatch):
    gpu = StandInGpu(monkeypatch)
    configs = gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132)
    before = gemv.tuning_stats()
    assert [gemv.tune(**_row(r), device="cpu") for r in ROWS] == [gpu.fastest] * len(ROWS)
    # every candidate once, at the kernel's full tile; then per row count its winner and F.linear, at the real rows
    want = Counter({(cfg, 16): 1 for cfg in configs})  # the 16-row tile's
    want.update({(what, r): 1 for r in ROWS for what in (gpu.fastest, "linear")})
    assert gpu.benched == want
    assert _delta(before) == {"weights": 1, "weight_timings": len(configs), "shapes": 4, "shape_timings": 8}
    assert len(_files(store)) == 4 and len(_weight_files(store)) == 1


def test_one_row_and_two_to_four_rows_are_tuned_at_tiles_of_their_own_with_the_rows_kernel(store, monkeypatch):
    monkeypatch.setenv("SHAPEWISE_GEMV_ROWS", "1")
    gpu = StandInGpu(monkeypatch)
    assert [gemv.tune(**_row(r), device="cpu") for r in (1, 2, 3, 4, 16)] == [gpu.fastest] * 5
    for tile in (1, 4, 16):  # every candidate of each tile, once, at the tile's rows (the winner once more:
        configs = gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132, tile)  # against F.linear at as many rows)
        assert {cfg: gpu.benched[(cfg, tile)] for cfg in configs} == {cfg: 1 + (cfg == gpu.fastest) for cfg in configs}
        assert any(c.kernel == "rows" for c in configs) == (tile <= 4)  # the rows kernel runs at 1-4 rows only
    assert len(_weight_files(store)) == 3 and len(_files(store)) == 5


def test_f_linear_can_win_at_some_row_counts_and_the_config_is_chosen_at_the_full_tile(store, monkeypatch):
    configs = gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132)
    other = configs[0]  # fastest at one row (never timed there), slower than ``fastest`` at the full tile
    gpu = StandInGpu(monkeypatch, linear_ms=lambda rows: 0.5 if rows == 16 else 5.0,
                     kernel_ms=lambda cfg, rows: {gpu.fastest: 1.0, other: 0.1 if rows == 9 else 3.0}.get(cfg, 2.0))
    assert gemv.tune(**_row(16), device="cpu") is None  # cuBLAS wins at 16 rows...
    assert gemv.tune(**_row(9), device="cpu") == gpu.fastest  # ...not at 9, where the weight's config runs
    assert gpu.benched[(other, 9)] == 0 and gpu.benched[(other, 16)] == 1
    _forget(monkeypatch)
    benched = sum(gpu.benched.values())
    assert gemv.tune(**_row(16), device="cpu") is None and gemv.tune(**_row(9), device="cpu") == gpu.fastest
    assert sum(gpu.benched.values()) == benched  # read back from disk


def _tune_rows_in_child(conn) -> None:
    for r in ROWS:
        gemv.tune(**_row(r), device="cpu")
    conn.send(sum(gemv_timing.time_calls.__self__.benched.values()))


def test_a_second_process_times_nothing_and_a_new_row_count_times_only_two(store, monkeypatch):
    gpu = StandInGpu(monkeypatch)
    configs = gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132)
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_tune_rows_in_child, args=(child,))
    proc.start()
    child.close()
    assert (parent.recv() if parent.poll(60) else None) == len(configs) + 2 * len(ROWS)
    proc.join(timeout=30)
    assert [gemv.tune(**_row(r), device="cpu") for r in ROWS] == [gpu.fastest] * len(ROWS) and not gpu.benched
    assert gemv.tune(**_row(11), device="cpu") == gpu.fastest  # the weight's config from disk
    assert gpu.benched == Counter({(gpu.fastest, 11): 1, ("linear", 11): 1})


@pytest.mark.parametrize("broken", ["{not json", "", '{"format": 1, "key": KEY, "value": {"block_n": 7, "block_k": 3}}',
                                    '{"format": 1, "key": ROWKEY, "value": null}'])
def test_a_broken_weight_file_warns_is_timed_again_and_rewritten(store, monkeypatch, caplog, broken):
    gpu = StandInGpu(monkeypatch)
    gemv.tune(**SHAPE, device="cpu")
    ((path,), (row,)) = _weight_files(store), _files(store)
    key, row_key = (json.dumps(json.loads(p.read_text())["key"]) for p in (path, row))
    path.write_text(broken.replace("ROWKEY", row_key).replace("KEY", key))  # a row record in a weight's place
    _forget(monkeypatch)
    gpu.benched.clear()
    with caplog.at_level(logging.WARNING, logger="shapewise"):
        assert gemv.tune(**_row(5), device="cpu") == gpu.fastest
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"shapewise: ignoring the tuning file {path}"]
    assert sum(n for (what, rows), n in gpu.benched.items() if rows == 16) == len(
        gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132))
    assert json.loads(path.read_text())["value"]["block_n"] == gpu.fastest.block_n


def test_records_of_the_one_level_tuner_are_not_read(store, monkeypatch):
    gpu = StandInGpu(monkeypatch)
    configs = gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132)
    fields = gemv._fields((10, 64, 256, torch.bfloat16, True, None), "Stand-in GPU", 132, configs)
    old = {k: v for k, v in fields.items() if k != "level"}  # a key as the one-level tuner wrote it
    store.save(old, {"block_n": configs[0].block_n, "block_k": configs[0].block_k, "split_k": configs[0].split_k,
                     "num_warps": configs[0].num_warps, "num_stages": configs[0].num_stages})
    assert gemv.tune(**SHAPE, device="cpu") == gpu.fastest and gpu.tunes == 1


def test_inside_a_capture_nothing_is_timed_and_a_known_weight_gives_its_config(store, monkeypatch):
    gpu = StandInGpu(monkeypatch)
    assert gemv.tune(**_row(16), device="cpu") == gpu.fastest
    _forget(monkeypatch)
    gpu.benched.clear()
    monkeypatch.setattr(gemv, "_capturing", lambda: True)
    assert gemv.tune(**_row(11), device="cpu") == gpu.fastest  # the weight's config, from disk, untimed...
    assert gemv.tune(**{**SHAPE, "n": 128}, device="cpu") == gemv.gemv_configs(128, SHAPE["k"], 132)[0]
    assert not gpu.benched and not gemv._TUNED  # ...and not remembered for the row count
    assert len(_files(store)) == 1 and len(_weight_files(store)) == 1


def test_wait_false_leaves_a_weight_another_process_is_tuning_to_it(store, monkeypatch):
    gpu = StandInGpu(monkeypatch)
    configs = gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132)
    weights = TuningStore(store.folder / "weights")
    with weights.locked(gemv._weight_fields((16, 64, 256, torch.bfloat16, True, None), "Stand-in GPU", 132, configs)):
        t0 = time.perf_counter()
        made, randn = [], torch.randn
        with monkeypatch.context() as m:
            m.setattr(torch, "randn", lambda *a, **kw: made.append(a) or randn(*a, **kw))
            assert gemv.tune(**SHAPE, device="cpu", wait=False) is None  # at once, and not remembered
        assert time.perf_counter() - t0 < 5 and not gpu.benched and not _files(store)
        assert not made  # nor were its random tensors made (an lm_head's would be a GiB)
    assert gemv.tune(**SHAPE, device="cpu", wait=False) == gpu.fastest


def test_decode_gemv_hands_each_rewritten_shape_to_the_tuner(monkeypatch):
    seen = []
    monkeypatch.setattr(decode_gemv, "_tune_ahead", lambda shapes, pdl=False: seen.append(shapes))
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16, bias=False)).to(torch.bfloat16)
    fast = sw.compile(model, sizes=[1, 4, 32], backend="aot_eager",
                      graph_passes=[sw.library.DecodeGemv(max_tokens=4, devices=("cpu",))])
    fast(torch.randn(4, 32, dtype=torch.bfloat16))
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert sorted(s for shapes in seen for s in shapes) == [
        (1, 16, 64, bf16, False, cpu), (1, 64, 32, bf16, True, cpu), (4, 16, 64, bf16, False, cpu),
        (4, 64, 32, bf16, True, cpu)]


def test_decode_gemv_tunes_ahead_only_on_cuda_with_triton_and_real_tensors(monkeypatch):
    tuned = []
    monkeypatch.setattr(decode_gemv, "tune", lambda *a, **kw: tuned.append((a, kw)))
    monkeypatch.setattr(decode_gemv, "triton_gemv_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cuda = (1, 64, 32, torch.bfloat16, True, torch.device("cuda", 0))
    decode_gemv._tune_ahead([(1, 64, 32, torch.bfloat16, True, torch.device("cpu")), cuda, cuda])
    assert tuned == [(cuda, {"wait": False, "linear": True})]
    monkeypatch.setattr(gemv, "pdl_supported", lambda device: True)  # (kernel_always asks it)
    decode_gemv._tune_ahead([cuda], pdl=True)  # with PDL the op runs the weight's config alone: tuned so
    assert tuned.pop() == (cuda, {"wait": False, "linear": False})
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        decode_gemv._tune_ahead([cuda])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    decode_gemv._tune_ahead([cuda])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(decode_gemv, "triton_gemv_available", lambda: False)
    decode_gemv._tune_ahead([cuda])
    assert len(tuned) == 1


@pytest.mark.gpu
def test_a_real_shape_tuned_on_the_gpu_is_read_back_without_timing(store, monkeypatch):
    m, n, k = 4, 4096 + 48, 4096  # a shape no other test tunes
    cfg = gemv.tune(m, n, k, torch.bfloat16, True, "cuda")
    (path,) = _files(store)
    assert json.loads(path.read_text())["key"]["gpu"] == torch.cuda.get_device_name()
    timed = []
    real = gemv._tune
    monkeypatch.setattr(gemv, "_tune", lambda *a: timed.append(a) or real(*a))
    monkeypatch.setattr(gemv, "_TUNED", {})
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert gemv.gemv_config(x, w, b) == cfg and not timed
    torch.testing.assert_close(torch.ops.shapewise.gemv(x, w, b), F.linear(x, w, b), rtol=2e-2, atol=2e-2)
    assert not timed


@pytest.mark.gpu
def test_decode_gemv_tunes_at_compile_time_and_a_restart_tunes_nothing(store, monkeypatch):
    real, timed = gemv._tune, []
    monkeypatch.setattr(gemv, "_tune", lambda *a: timed.append(a[0].shape[0]) or real(*a))
    hidden = 1024 + 48  # shapes of their own
    model = nn.Sequential(nn.Linear(512, hidden), nn.SiLU(), nn.Linear(hidden, 512)).cuda().to(torch.bfloat16)
    fast = sw.compile(model, sizes=[1, 2, 32], graph_passes=[sw.library.DecodeGemv(max_tokens=8)])
    with torch.no_grad():
        fast(torch.randn(1, 512, device="cuda", dtype=torch.bfloat16))
        assert sorted(timed) == [1, 1, 2, 2] and len(_files(store)) == 4  # both decode sizes, before their calls
        monkeypatch.setattr(gemv, "_TUNED", {})  # a restart: memory empty, disk full
        x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(fast(x), model(x), rtol=2e-2, atol=2e-2)
    assert len(timed) == 4


def test_without_f_linear_the_weights_config_runs_even_where_f_linear_times_faster(store, monkeypatch):
    gpu = StandInGpu(monkeypatch, linear_ms=0.1)
    assert gemv.tune(**SHAPE, device="cpu") is None  # F.linear is faster alone...
    assert gemv.tune(**SHAPE, device="cpu", linear=False) == gpu.fastest  # ...but asked for the kernel: its config
    assert gpu.tunes == 1
    _forget(monkeypatch)
    gpu.benched.clear()
    assert gemv.tune(**{**SHAPE, "rows": 13}, device="cpu", linear=False) == gpu.fastest and not gpu.benched  # disk


@pytest.mark.gpu
def test_the_timing_replays_a_graph_over_copies_past_the_l2_and_a_failure_is_infinite(tmp_path, monkeypatch):
    # time_calls: one CUDA graph of a call per copy of the weight (together >= 3x the L2, each read from
    # memory), its time per call; what fails, before the capture or inside it, is infinite (the stream not
    # left capturing); the copies go once the tuning is done.
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)  # 8 MiB
    seen = []
    ms = gemv_timing.time_calls(lambda w_: seen.append(w_) or F.linear(x, w_), w)
    copies = {t.data_ptr() for t in seen}
    assert 0 < ms < 1 and len(copies) * w.numel() * 2 >= min(3 * l2, gemv_timing.MAX_COPIES * w.numel() * 2)
    # in proportion to the bytes: a weight 4x as large takes about 4x as long (32 and 128 MiB, where
    # the fixed cost of a call is small beside the read)
    w1, w4 = (torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16) for n in (8192, 32768))
    ratio = (gemv_timing.time_calls(lambda w_: F.linear(x, w_), w4)
             / gemv_timing.time_calls(lambda w_: F.linear(x, w_), w1))
    assert 2.5 < ratio < 5.5, ratio

    def fails(w_):
        raise RuntimeError("this config does not fit")

    assert gemv._time(fails, "a config", w) == float("inf") and not torch.cuda.is_current_stream_capturing()

    def fails_in_the_capture(w_):  # passes the warm-up, then does what a capture does not allow
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return F.linear(x, w_)

    stream = torch.cuda.current_stream()
    abandoned = len(gemv_timing.ABANDONED)
    assert gemv._time(fails_in_the_capture, "a config", w) == float("inf")
    assert torch.cuda.current_stream() == stream and not torch.cuda.is_current_stream_capturing()
    # the failed capture's graph is kept, and the allocator's routing to its pool ended: left routed,
    # the allocator thought a capture underway for good, and a later collection aborted the process
    # (on an H100, twice); emptying the cache asserts no capture is underway (it raised, before)
    assert len(gemv_timing.ABANDONED) == abandoned + 1
    torch.cuda.empty_cache()
    gc.collect()
    assert 0 < gemv_timing.time_calls(lambda w_: F.linear(x, w_), w) < 1  # and the next timing works
    assert gemv_timing._COPIES  # the last timing's weight and its copies...
    gemv_timing.drop_copies()
    monkeypatch.setenv("SHAPEWISE_CACHE_DIR", str(tmp_path))  # an empty store: the tune below times
    monkeypatch.delenv("SHAPEWISE_GEMV_TUNE", raising=False)
    weights = gemv.tuning_stats()["weights"]
    gemv.tune(1, 2048 + 16, 2048, torch.bfloat16, False, "cuda")
    assert gemv.tuning_stats()["weights"] == weights + 1 and gemv_timing._COPIES == []  # ...and a tune's, dropped


def test_a_failed_capture_is_kept_for_good_its_pool_routing_ended_and_released(monkeypatch):
    # On the CPU, torch's routing calls stood in: the graph is kept (torch's pinned host allocator stays
    # routed to it), the device allocator's routing to the pool time_calls named ended on its device and
    # the pool released (a failed capture_end does neither: left so, a later collection aborted an H100
    # test worker); where the routing was never begun (RuntimeError), nothing is released or raised.
    calls = []

    def end(device, pool):
        calls.append(("end", device, pool))
        if pool == (0, 9):
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda d, p: calls.append(("release", d, p)),
                        raising=False)
    monkeypatch.setattr(gemv_timing, "ABANDONED", [])
    first, second = object(), object()
    gemv_timing._abandon(first, torch.device("cuda", 1), (0, 7))
    gemv_timing._abandon(second, torch.device("cuda", 0), (0, 9))
    assert gemv_timing.ABANDONED == [first, second]
    assert calls == [("end", 1, (0, 7)), ("release", 1, (0, 7)), ("end", 0, (0, 9))]


@pytest.mark.parametrize("glu_ms, silu_ms, pays", [(1.4, 0.5, True), (1.5, 0.5, True), (1.6, 0.5, False),
                                                     (None, 0.5, False), (1.4, float("inf"), False)])
def test_silu_times_up_goes_into_the_kernel_only_where_it_beats_the_activation_and_the_plain_product(
        store, monkeypatch, glu_ms, silu_ms, pays):
    # The plain product's fastest config takes 1 ms, the activation's kernel silu_ms (timed with the product
    # after it, in one call): the kernel with the activation (its own fastest config, another one) must take
    # at most 1 + silu_ms. glu_ms None: every GLU config slower than F.linear(silu(x) * up) (5 ms), so its
    # own tuning chose F.linear: no kernel to time. silu_ms inf: that timing failed: never taken.
    def kernel_ms(what, rows):
        if isinstance(what, tuple):  # ("glu", config)
            return 9.0 if glu_ms is None else glu_ms if what[1] == glu_fastest else 3.0
        return 1.0 if what == gpu.fastest else 2.0

    gpu = StandInGpu(monkeypatch, kernel_ms=kernel_ms, silu_ms=silu_ms)
    glu_fastest = gemv.gemv_configs(SHAPE["n"], SHAPE["k"], 132, glu=True)[1]
    assert glu_fastest != gpu.fastest
    monkeypatch.setattr(gemv, "_GLU_PAYS", {})
    monkeypatch.setattr(gemv, "GLU_DECISIONS", [])
    assert gemv.glu_pays(**SHAPE, device="cpu") is pays
    timed = sum(gpu.benched.values())
    assert gemv.glu_pays(**SHAPE, device="cpu") is pays and sum(gpu.benched.values()) == timed  # asked once
    (decision,) = gemv.GLU_DECISIONS  # every answer recorded, the one without a GLU kernel too
    assert decision["pays"] is pays and (decision["glu_config"] == "F.linear") is (glu_ms is None)
    # the two tunings are kept apart: each product's own winner
    assert gemv.tune(**SHAPE, device="cpu") == gpu.fastest
    if glu_ms is not None:
        assert gemv.tune(**SHAPE, device="cpu", glu=True) == glu_fastest
        if silu_ms == 0.5:
            assert decision["unfused_us"] == 1500.0  # silu, then the plain kernel's winner, in one timed call
        assert gpu.benched[(("silu", gpu.fastest), SHAPE["rows"])] == 1


def test_with_tuning_off_the_activation_stays_a_kernel_of_its_own_untimed(store, monkeypatch):
    gpu = StandInGpu(monkeypatch)
    monkeypatch.setenv("SHAPEWISE_GEMV_TUNE", "0")
    monkeypatch.setattr(gemv, "_GLU_PAYS", {})
    assert gemv.glu_pays(**SHAPE, device="cpu") is False and not gpu.benched
