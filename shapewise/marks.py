"""What ``shapewise.compile`` marks dynamic in a call's arguments: the ``dynamic_dims`` spec read
(``dims_spec``), the tensors an argument holds (``tensors_of``: a tensor, a tuple/list, or an
object such as a KV cache) and the int attributes an object argument holds (``int_paths``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from shapewise.backend import DEFAULT_DIM_NAME
from shapewise.errors import ConfigError

__all__ = ["dims_spec", "int_paths", "tensors_of"]


def tensors_of(value: Any, deep: bool = False) -> list[torch.Tensor]:
    """A tensor argument, or the tensors of a tuple/list argument (one level). ``deep``: also
    the tensors held by an object argument, through its attributes, lists and dicts (a
    transformers ``DynamicCache``: ``cache.layers[i].keys`` / ``.values``), in attribute order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and not deep:
        return [v for v in value if isinstance(v, torch.Tensor)]
    if not deep:
        return []
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(v: Any, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
            return
        if depth > 4 or id(v) in seen or v is None or isinstance(v, (bool, int, float, str, torch.device,
                                                                      torch.dtype, torch.nn.Module)):
            return
        seen.add(id(v))
        if isinstance(v, (tuple, list)):
            items = list(v)
        elif isinstance(v, Mapping):
            items = list(v.values())
        else:
            items = list(getattr(v, "__dict__", {}).values())
        for item in items:
            walk(item, depth + 1)

    walk(value, 0)
    return out


def dims_spec(spec: Any, arg: str) -> dict[int | str, str]:
    """``1`` / ``[0, 1]`` / ``{0: "batch", 1: "seq"}`` → {dim: name}. In the dict form a string key
    names an int attribute of an object argument (``{2: "kv", "cumulative_length": "pos"}``: a KV
    cache's tensors' dim 2, and the token counters its layers keep as Python ints)."""
    if isinstance(spec, bool):
        raise ConfigError(f"dynamic_dims[{arg!r}] must be a dim, a list of dims or {{dim: name}}, got {spec!r}")
    if isinstance(spec, int):
        return {spec: DEFAULT_DIM_NAME}
    if isinstance(spec, Mapping):
        out: dict[int | str, str] = {}
        for d, name in spec.items():
            if not (isinstance(d, int) and not isinstance(d, bool) or isinstance(d, str) and d.isidentifier()) or \
                    not isinstance(name, str) or not name:
                raise ConfigError(f"dynamic_dims[{arg!r}] maps dims (ints) or int attributes of an object argument "
                                  f"(identifiers) to names (strings), got {d!r}: {name!r}")
            out[d] = name
        return out
    if isinstance(spec, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in spec):
        return {d: DEFAULT_DIM_NAME for d in spec}
    raise ConfigError(f"dynamic_dims[{arg!r}] must be a dim, a list of dims or {{dim: name}}, got {spec!r}")


def int_paths(value: Any, attrs: Collection[str]) -> list[tuple[str, int]]:
    """The int attributes named ``attrs`` inside an object argument, as (path in Dynamo's spelling
    after the argument, value): ``[(".layers[0].cumulative_length", 12), ...]``."""
    out: list[tuple[str, int]] = []
    seen: set[int] = set()

    def walk(v: Any, path: str, depth: int) -> None:
        if depth > 4 or id(v) in seen or v is None or isinstance(v, (bool, int, float, str, torch.Tensor,
                                                                      torch.device, torch.dtype, torch.nn.Module)):
            return
        seen.add(id(v))
        if isinstance(v, (tuple, list)):
            for i, item in enumerate(v):
                walk(item, f"{path}[{i}]", depth + 1)
            return
        if isinstance(v, Mapping):
            for k, item in v.items():
                if isinstance(k, str):
                    walk(item, f"{path}[{k!r}]", depth + 1)
            return
        for k, item in getattr(v, "__dict__", {}).items():
            if k in attrs and type(item) is int:
                out.append((f"{path}.{k}", item))
            else:
                walk(item, f"{path}.{k}", depth + 1)

    walk(value, "", 0)
    return out
