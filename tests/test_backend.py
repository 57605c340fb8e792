"""The "shapewise" torch.compile backend (``shapewise/backend.py``), end to end: the entry point,
a first static trace, symbol names, the general variant."""

from __future__ import annotations

import pytest
import torch

import shapewise as sw
from shapewise.models import MLP
from tests.helpers import PerRow, assert_same, dynamo_graph


def _installed_backend() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "shapewise" for ep in entry_points(group="torch_dynamo_backends"))


@pytest.mark.skipif(not _installed_backend(), reason="shapewise is not pip-installed here (run from a checkout with "
                    "PYTHONPATH), so its torch_dynamo_backends entry point is not registered")
def test_torch_compile_backend_entry_point():
    model = MLP()
    compiled = torch.compile(model, backend="shapewise", dynamic=True,
                             options={"sizes": [3, 8], "ranges": [(9, 64)], "backend": "eager"})
    for n in (3, 8, 20):
        x = torch.randn(n, 32)
        assert_same(compiled(x), model(x))


@pytest.mark.parametrize("dynamic", [True, None])
def test_backend_entry_size_one_and_a_first_static_trace(dynamic, caplog):
    # Dynamo (not shapewise) traces here: with dynamic=True it specialises 1 (the trace allows
    # [2, inf]); without, its first trace fixes every size. Size 1 is skipped in the symbolic
    # trace with a warning and served by the trace Dynamo makes when it is called; a trace with
    # no dynamic size compiles as it is. (The README's example failed on both.)
    torch._dynamo.reset()
    model = PerRow()
    compiled = torch.compile(model, backend="shapewise", dynamic=dynamic,
                             options={"sizes": [1, 8], "ranges": [(9, 512)], "backend": "aot_eager"})
    with caplog.at_level("WARNING", logger="shapewise"):
        for n in (8, 1, 100, 8, 1):
            x = torch.randn(n, 16)
            assert_same(compiled(x), model(x), f"n={n}")
    if dynamic:
        assert "skipping {s" in caplog.text and "=1} in this trace" in caplog.text
    with pytest.raises(sw.DispatchMiss):
        compiled(torch.randn(5, 16))  # neither a size nor in a range


def test_backend_symbol_names_by_name_and_a_first_static_trace():
    # symbol_names={"s77": "n"} (a name, not the Symbol) was ignored: the miss said {s77=5}. The
    # first trace is static: it has no symbol to name, and is not refused for it.
    model = PerRow()
    (s,) = sw.AnalyzeShapes()(dynamo_graph(model, torch.randn(8, 16))).shapes.symbols
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="shapewise",
                             options={"sizes": [2, 8], "backend": "eager", "symbol_names": {str(s): "n"}})
    for n in (8, 2, 8):
        x = torch.randn(n, 16)
        assert_same(compiled(x), model(x), f"n={n}")
    with pytest.raises(sw.DispatchMiss, match=r"size \{n=5\}: compiled sizes: \{n=2\}, \{n=8\}"):
        compiled(torch.randn(5, 16))


def test_backend_entry_general_variant_is_dynamic():
    model = PerRow()
    fast = torch.compile(model, backend="shapewise", dynamic=True,
                         options={"sizes": [2], "ranges": [(3, 16)], "backend": "aot_eager", "on_miss": "dynamic"})
    for n in (2, 5, 16, 20, 31):
        x = torch.randn(n, 16)
        assert_same(fast(x), model(x), f"n={n}")
