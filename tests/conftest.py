"""Shared fixtures and helpers: Dynamo reset, dtype tolerances, eager comparison."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

import shapewise.models  # noqa: F401 - registers the toy custom ops

# Inductor compiles on 2 CI cores: keep them from competing with each other.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
