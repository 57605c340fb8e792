"""What ``shapewise.compile`` marks dynamic in a call's arguments: the ``dynamic_dims`` spec read
(``dims_spec``), the tensors an argument holds (``tensors_of``: a tensor, a tuple/list, or an
object such as a KV cache) and the int attributes an object argument holds (``int_paths``)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

from shapewise.backend import DEFAULT_DIM_NAME
from shapewise.errors import ConfigError

__all__ = ["UnmarkedChanges", "dims_spec", "held_tensors", "int_paths", "int_sources", "members", "parse_dynamic_dims",
           "tensors_of"]

log = logging.getLogger("shapewise")


def members(value: Any, attrs: Collection[str] = ()) -> Iterator[tuple[str, str | None, Any]]:
    """The tensors an object argument holds, through its attributes, lists and dicts (a
    transformers ``DynamicCache``: ``cache.layers[i].keys`` / ``.values``), in attribute order, and
    its int attributes named ``attrs``: (path in Dynamo's spelling after the argument, the
    attribute the leaf is held at, the tensor or int)."""
    seen: set[int] = set()

    def walk(v: Any, path: str, attr: str | None, depth: int) -> Iterator[tuple[str, str | None, Any]]:
        if isinstance(v, torch.Tensor):
            yield path, attr, v
            return
        if depth > 4 or id(v) in seen or v is None or isinstance(v, (bool, int, float, str, torch.device,
                                                                      torch.dtype, torch.nn.Module)):
            return
        seen.add(id(v))
        if isinstance(v, (tuple, list)):
            for i, item in enumerate(v):
                yield from walk(item, f"{path}[{i}]", attr, depth + 1)
        elif isinstance(v, Mapping):
            for k, item in v.items():
                if isinstance(k, str):
                    yield from walk(item, f"{path}[{k!r}]", attr, depth + 1)
        else:
            for k, item in getattr(v, "__dict__", {}).items():
                if k in attrs and type(item) is int:
                    yield f"{path}.{k}", k, item
                else:
                    yield from walk(item, f"{path}.{k}", k, depth + 1)

    yield from walk(value, "", None, 0)


def tensors_of(value: Any, deep: bool = False) -> list[torch.Tensor]:
    """A tensor argument, or the tensors of a tuple/list argument (one level). ``deep``: also
    the tensors held by an object argument (``members``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and not deep:
        return [v for v in value if isinstance(v, torch.Tensor)]
    if not deep:
        return []
    return [t for _, _, t in members(value)]


def held_tensors(value: Any) -> list[tuple[torch.Tensor, str | None]]:
    """The tensors an object argument holds, each with the attribute it is held at."""
    return [(t, attr) for _, attr, t in members(value) if isinstance(t, torch.Tensor)]


def dims_spec(spec: Any, arg: str) -> dict[int | str, Any]:
    """``1`` / ``[0, 1]`` / ``{0: "batch", 1: "seq"}`` → {dim: name}. In the dict form a string key
    names an attribute inside an object argument: an int one, traced as a size, by a name
    (``{2: "kv", "cumulative_length": "pos"}``: a KV cache's tensors' dim 2, and the token counters
    its layers keep as Python ints), or the tensors held at it, by their own dims, in place of
    the argument's (``"indexer_keys": {1: "kv"}``: a sparse-attention indexer's keys grow along
    dim 1)."""
    if isinstance(spec, bool):
        raise ConfigError(f"dynamic_dims[{arg!r}] must be a dim, a list of dims or {{dim: name}}, got {spec!r}")
    if isinstance(spec, int):
        return {spec: DEFAULT_DIM_NAME}
    if isinstance(spec, Mapping):
        out: dict[int | str, Any] = {}
        for d, name in spec.items():
            if isinstance(d, str) and d.isidentifier() and not isinstance(name, str):
                out[d] = dims_spec(name, f"{arg}.{d}")  # the dims of the tensors held at that attribute
                if any(isinstance(k, str) for k in out[d]):
                    raise ConfigError(f"dynamic_dims[{arg!r}][{d!r}] gives the dims of the tensors held at {d!r}; "
                                      f"it cannot name attributes itself, got {name!r}")
                continue
            if not (isinstance(d, int) and not isinstance(d, bool) or isinstance(d, str) and d.isidentifier()) or \
                    not isinstance(name, str) or not name:
                raise ConfigError(f"dynamic_dims[{arg!r}] maps dims (ints) or int attributes of an object argument "
                                  f"(identifiers) to names (strings), got {d!r}: {name!r}")
            out[d] = name
        return out
    if isinstance(spec, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in spec):
        return {d: DEFAULT_DIM_NAME for d in spec}
    raise ConfigError(f"dynamic_dims[{arg!r}] must be a dim, a list of dims or {{dim: name}}, got {spec!r}")


def parse_dynamic_dims(dynamic_dims: Mapping[str, Any] | None, fn: Any, params: Mapping[str, Any]
                       ) -> tuple[dict[str, dict[int, str]] | None, dict[str, dict[str, str]],
                                  dict[str, dict[str, dict[int, str]]]]:
    """``shapewise.compile``'s ``dynamic_dims`` (over the arguments ``params`` of ``fn``) as three
    maps: {argument: {dim: name}} (None when not given), {object argument: {int attribute: name}}
    and {object argument: {attribute: {dim: name}}} (the tensors held there)."""
    if dynamic_dims is None:
        return None, {}, {}
    dims: dict[str, dict[int, str]] = {}
    int_attrs: dict[str, dict[str, str]] = {}
    tensor_attrs: dict[str, dict[str, dict[int, str]]] = {}
    for arg, spec in dynamic_dims.items():
        if arg not in params:
            raise ConfigError(f"dynamic_dims names {arg!r}, which is not an argument of "
                              f"{getattr(fn, '__qualname__', fn)}; its arguments: {list(params)}")
        full = dims_spec(spec, arg)
        dims[arg] = {d: n for d, n in full.items() if isinstance(d, int)}
        if ints := {d: n for d, n in full.items() if isinstance(d, str) and isinstance(n, str)}:
            int_attrs[arg] = ints
        if held := {d: n for d, n in full.items() if isinstance(d, str) and not isinstance(n, str)}:
            tensor_attrs[arg] = held
    return dims, int_attrs, tensor_attrs


def int_paths(value: Any, attrs: Collection[str]) -> list[tuple[str, int]]:
    """The int attributes named ``attrs`` inside an object argument, as (path in Dynamo's spelling
    after the argument, value): ``[(".layers[0].cumulative_length", 12), ...]``."""
    return [(path, v) for path, _, v in members(value, attrs) if not isinstance(v, torch.Tensor)]


class UnmarkedChanges:
    """Per compiled model: each trace's input sizes, to warn (once per dim) when a trace exists
    because a dim no mark covers changed size since an earlier trace: every new size of it will
    trace and compile again (a transformers model called with ``input_ids`` [1, n] under the
    default marks, dim 0, traces per n)."""

    def __init__(self) -> None:
        self.sizes: list[dict[str, tuple[str | None, list[int | None]]]] = []  # per trace, per input source
        self.warned: set[tuple[str, int]] = set()

    def check(self, sizes: dict[str, tuple[str | None, list[int | None]]], arg_dims: Mapping[str, Mapping[int, str]],
              trace: int) -> None:
        """``sizes``: this trace's {input source: (argument, its static sizes)}; ``trace``: its number."""
        for source, (arg, shape) in sizes.items():
            before = next((t[source][1] for t in self.sizes if source in t and len(t[source][1]) == len(shape)),
                          None)
            for d, (was, now) in enumerate(zip(before or (), shape)):
                if None in (was, now) or was == now or (arg, d) in self.warned or \
                        any(m % len(shape) == d for m in arg_dims.get(arg, {})):
                    continue
                self.warned.add((arg, d))
                marked = ", ".join(f"{a!r}: {sorted(m)}" for a, m in arg_dims.items()) or "none"
                log.warning("shapewise: trace %d: dim %d of %r was %d in an earlier trace and is %d now, but it is "
                            "not a dynamic dim (marked: {%s}), so Dynamo traced again and every new size of it will "
                            "trace and compile again; name it: dynamic_dims={%r: %d}", trace, d, arg,
                            was, now, marked, arg, d)
        self.sizes.append(sizes)


def int_sources(bound: inspect.BoundArguments, int_attrs: Mapping[str, Mapping[str, str]],
                fixed: Mapping[str, int] | None, source_positional: list[str]) -> list[str]:
    """The sources of the int attributes ``dynamic_dims`` names in object arguments, as Dynamo
    spells them, for this call: each is traced as a symbol (a sliding-window layer's token
    count, which would otherwise be a constant guarded per value: a trace per decode step). A
    counter at 0 (an empty cache's layer) stays a constant, as do names in ``fixed``.
    ``source_positional``: the names of ``L['args'][i]`` in the traced frame."""
    out: list[str] = []
    for arg, attrs in int_attrs.items():
        value = bound.arguments.get(arg)
        if value is None:
            continue
        if isinstance(value, (torch.Tensor, tuple, list, int, float, str)):
            raise ConfigError(f"dynamic_dims names int attributes {sorted(attrs)} of {arg!r}, but it is a "
                              f"{type(value).__name__}; attributes are read inside an object argument (a KV cache)")
        paths = [p for p, v in int_paths(value, attrs)
                 if v != 0 and attrs[p.rsplit(".", 1)[1]] not in (fixed or {})]
        if not paths:
            continue
        bases = [f"L[{arg!r}]", f"L['kwargs'][{arg!r}]"]
        names = list(bound.signature.parameters)
        i = names.index(arg)
        if i < len(bound.args):  # passed by position: L['args'][i] in a (*args, **kwargs) wrapper's frame
            bases.append(f"L['args'][{source_positional.index(arg)}]")
        out.extend(b + p for b in bases for p in paths)
    return out
