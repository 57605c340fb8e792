"""Shared fixtures and helpers: Dynamo reset, dtype tolerances, eager comparison."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import zlib

import pytest
import torch

import shapewise.models  # noqa: F401 - registers the toy custom ops

# Inductor compiles on 2 CI cores: keep them from competing with each other.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# compile_workers="auto" (the default) starts worker processes on a machine of 8 CPUs or more (the GPU
# machine: 4 per test process): the tests of workers ask for them by number; the rest compile here.
os.environ.setdefault("SHAPEWISE_COMPILE_WORKERS", "1")

# shapewise's artifact cache: one fresh folder per test session, never the user's ~/.cache.
_CACHE_DIR = tempfile.mkdtemp(prefix="shapewise-test-cache-")
os.environ["SHAPEWISE_CACHE_DIR"] = _CACHE_DIR
os.environ.pop("SHAPEWISE_CACHE", None)
atexit.register(shutil.rmtree, _CACHE_DIR, True)

@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with empty Dynamo caches and counters (trace counts are per test)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


# The suite's longest tests (CI's --durations, 2026-12-07: 200, 47, 43, 41 and 36 s on 2 cores) run first:
# with pytest-xdist's work stealing the other worker takes the short ones meanwhile, and no long test is
# left to run alone at the end while a core idles.
LONG_FIRST = ("tests/distributed/test_tp.py::test_transformers_tp_plan_dtensor_weights",
              "tests/models/test_generate.py::test_sliding_window_decode_is_a_fixed_number_of_traces",
              "tests/test_fuzz.py::test_compile_equals_eager",
              "tests/models/test_training_zoo.py::test_training_matches_eager[t5]",
              "tests/models/test_zoo.py::test_t5_source_and_target_lengths")


def pytest_collection_modifyitems(config, items):
    _keep_shard(config, items)
    items.sort(key=lambda it: not it.nodeid.startswith(LONG_FIRST))  # (stable: the rest keep their order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _keep_shard(config, items) -> None:
    """``SHAPEWISE_TEST_SHARD=i/n`` (0 <= i < n) keeps the tests whose id hashes to i of n: a suite
    too long for one device call runs as n calls (benchmarks/device/session_suite.sh)."""
    shard = os.environ.get("SHAPEWISE_TEST_SHARD")
    if not shard:
        return
    try:
        i, n = (int(x) for x in shard.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"SHAPEWISE_TEST_SHARD={shard!r}: expected 'i/n' with 0 <= i < n, e.g. 0/2") from None
    keep = [it for it in items if zlib.crc32(it.nodeid.encode()) % n == i]
    config.hook.pytest_deselected(items=[it for it in items if it not in keep])
    items[:] = keep
