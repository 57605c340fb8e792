"""The library above the framework: built-in graph passes and the kernels they put into graphs.

In: nothing until a name is used. ``sw.library.DecodeGemv`` (``decode_gemv.py``: linear layers at
decode sizes -> the ``shapewise::gemv`` op of ``kernels/gemv.py``) and ``sw.library.OverlapAllReduce``
(``overlap.py``: all-reduces overlapped with compute in row slices) and ``sw.library.FuseProjections``
with ``sw.library.pack_projections`` (``fuse_projections.py``: linear layers reading one activation ->
one matmul over their packed weights, the ``shapewise::linear_group`` op) and
``sw.library.GroupedDecodeAttention`` (``grouped_decode.py``: one query token's grouped-query attention
over the unrepeated keys and values) and ``sw.library.BatchInputUpdates`` (``batch_updates.py``: in-place
additions to a piece's inputs, a KV cache's token counters, in one launch at the end) are imported on first use, so
``import shapewise`` registers no custom op. Out: ``GraphPass``es, registered by name, to hand to
``sw.compile(graph_passes=[...])``, ``sw.Rewrite`` or a ``Pipeline``.

The framework and the stages never import this package, nor does the user layer but for
``compile_generate``, inside the call (the import-linter contracts in pyproject.toml).

    >>> fast = sw.compile(model, sizes=[1, 2, 4, 8, 64], graph_passes=[sw.library.DecodeGemv(max_tokens=8)])
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BatchInputUpdates", "DecodeGemv", "FuseProjections", "GroupedDecodeAttention", "OverlapAllReduce",
           "pack_projections"]

_WHERE = {"BatchInputUpdates": "shapewise.library.batch_updates",
          "DecodeGemv": "shapewise.library.decode_gemv", "OverlapAllReduce": "shapewise.library.overlap",
          "FuseProjections": "shapewise.library.fuse_projections",
          "GroupedDecodeAttention": "shapewise.library.grouped_decode",
          "pack_projections": "shapewise.library.fuse_projections"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'shapewise.library' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
