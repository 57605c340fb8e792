"""The library above the framework: built-in graph passes and the kernels they put into graphs.

In: nothing until a name is used. ``sw.library.DecodeGemv`` (``decode_gemv.py``: linear layers at
decode sizes -> the ``shapewise::gemv`` op of ``kernels/gemv.py``) and ``sw.library.OverlapAllReduce``
(``overlap.py``: all-reduces overlapped with compute in row slices) are imported on first use, so
``import shapewise`` registers no custom op. Out: ``GraphPass``es, registered by name, to hand to
``sw.compile(graph_passes=[...])``, ``sw.Rewrite`` or a ``Pipeline``.

The framework, the stages and the user layer never import this package (the import-linter
contract in pyproject.toml); it imports them.

    >>> fast = sw.compile(model, sizes=[1, 2, 4, 8, 64], graph_passes=[sw.library.DecodeGemv(max_tokens=8)])
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DecodeGemv", "OverlapAllReduce"]

_WHERE = {"DecodeGemv": "shapewise.library.decode_gemv", "OverlapAllReduce": "shapewise.library.overlap"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'shapewise.library' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
