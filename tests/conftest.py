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

TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def assert_same(actual, expected, what: str = "") -> None:
    """Compare outputs (tensors or nested tuples of them) with tolerances set by dtype."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{what}[{i}]")
        return
    if not isinstance(expected, torch.Tensor):
        assert actual == expected, what
        return
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}, expected a tensor"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.is_floating_point():
        rtol, atol = TOLERANCES.get(expected.dtype, (1e-4, 1e-5))
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), what


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
