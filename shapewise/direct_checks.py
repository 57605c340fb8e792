"""The checks a direct call (``shapewise.direct``) makes of what it reads inside an object
argument, generated as Python source lines: they stand in for Dynamo's guards on the objects a
model reads (a KV cache, its list of layers, a layer).

Each object on the way to a tensor the graph reads is checked for its type; a list's or tuple's
length; a dict's keys; and every attribute it holds (its ``__dict__`` and ``__slots__``), as the
arming call found them: constants (numbers, strings, None, dtypes, devices, enums, tuples of
them) by value and type, tensors by identity where the trace read the same tensor elsewhere (an
alias) and else by type, dtype, device, shape and grad, anything else by identity. Attributes
the forward sets are checked as they were *before* the traced call (the arming call has changed
them by then): absent, a constant, or a tensor's metadata. Plain objects held off the path (a
config) are checked the same way, two levels deep; class attributes that hold constants, by value.
"""

from __future__ import annotations

import enum
import itertools
import operator
import re
from collections.abc import Sequence
from typing import Any

import sympy
import torch

from shapewise import _compat
from shapewise.dispatch.guards import python_expr

__all__ = ["CONSTANT_TYPES", "before_value", "check_object", "check_objects", "check_tensor", "dict_served", "distinct",
           "memo", "merge_checks", "pattern", "seen", "tensor_meta", "versioned"]

CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def tensor_meta(t: torch.Tensor) -> tuple:
    """What a tensor's checks compare (the tensor itself is not held)."""
    return (type(t), t.dtype, t.device, tuple(t.shape), t.requires_grad)


def _is_constant(v: Any) -> bool:
    if isinstance(v, (tuple, frozenset)):
        return all(_is_constant(x) for x in v)
    return type(v) in CONSTANT_TYPES or isinstance(v, enum.Enum)


def pattern(seq: Any) -> tuple[int, ...]:
    """Which items of a list are one object: each item's index of first appearance."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(x), i) for i, x in enumerate(seq))


def _plain_object(v: Any) -> bool:
    return (hasattr(v, "__dict__") and not isinstance(v, (type, torch.nn.Module, torch.Tensor))
            and not callable(v) and type(v).__module__ not in ("builtins", "types"))


def _class_constants(cls: type) -> list[str]:
    names = set()
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        names.update(a for a, v in vars(klass).items() if not a.startswith("__") and _is_constant(v))
    return sorted(names)


def _attributes(value: Any) -> dict[str, Any]:
    out = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                out[name] = getattr(value, name)
    return out


def check_object(lines: list[str], env: dict, var: str, value: Any, before: dict[str, Any], walked: set[str],
                 aliases: dict[int, str], depth: int = 0, always: list[str] | None = None,
                 items_settled: bool = False) -> None:
    """Append the checks of one object the call reads inside.

    ``before``: the attributes the forward sets, with their values before the traced call (or
    ``_compat.NOT_SET``); ``walked``: attributes that lead on to something the graph reads (checked
    where they are read); ``aliases``: id of a tensor the graph reads -> the variable the call
    reads it into. ``always``: where the checks go that an unchanged ``__dict__`` does not settle
    (the object's type, class attributes, tensors' metadata, aliases, what hangs off it); the
    checks of its attributes' values and identities go to ``lines``. None: all to ``lines``. A list
    or tuple whose items are each such an object (``items_settled``): its items' distinctness goes
    to ``lines`` (the same objects are as distinct as they were), its length to ``always``."""
    always = lines if always is None else always
    n = len(env)
    env[f"XT{n}"] = type(value)
    always.append(f"if type({var}) is not XT{n}: return MISS")
    if isinstance(value, (list, tuple)):  # its length, and which of its items are one object
        seq = pattern(value)
        distinct = seq == tuple(range(len(value)))
        if distinct and items_settled and always is not lines:
            always.append(f"if len({var}) != {len(value)}: return MISS")
            lines.append(f"if len(set(map(id, {var}))) != {len(value)}: return MISS")
        elif distinct:  # all distinct (a cache's layers): one C pass, not a Python loop
            always.append(f"if len({var}) != {len(value)} or len(set(map(id, {var}))) != {len(value)}: return MISS")
        else:
            env[f"XP{n}"] = seq
            always.append(f"if len({var}) != {len(value)} or pattern({var}) != XP{n}: return MISS")
        return
    if isinstance(value, dict):
        env[f"XK{n}"] = list(value)
        always.append(f"if len({var}) != {len(value)} or list({var}) != XK{n}: return MISS")
        return
    constants, tensors, others = [], [], []
    for name, v in sorted(_attributes(value).items()):
        if name in before or name in walked:
            continue
        if _is_constant(v):
            constants.append((name, v))
        elif isinstance(v, torch.Tensor):
            tensors.append((name, v))
        else:
            others.append((name, v))
    if constants:
        env[f"XG{n}"] = operator.attrgetter(*(a for a, _ in constants))
        env[f"XW{n}"] = tuple(v for _, v in constants)
        env[f"XY{n}"] = tuple(type(v) for _, v in constants)
        got = f"XG{n}({var})" if len(constants) > 1 else f"(XG{n}({var}),)"
        lines.append(f"v = {got}")
        lines.append(f"if v != XW{n} or tuple(map(type, v)) != XY{n}: return MISS")
    for k, (name, v) in enumerate(tensors):
        if id(v) in aliases:  # the trace read this very tensor elsewhere: Dynamo guards the alias
            always.append(f"if {var}.{name} is not {aliases[id(v)]}: return MISS")
        else:
            env[f"XM{n}_{k}"] = tensor_meta(v)
            always.append(f"if meta({var}.{name}) != XM{n}_{k}: return MISS")
    for k, (name, v) in enumerate(others):
        env[f"XO{n}_{k}"] = v
        lines.append(f"if {var}.{name} is not XO{n}_{k}: return MISS")
        if depth < 2 and _plain_object(v):  # a config hanging off the cache: what it holds too
            check_object(always, env, f"{var}.{name}", v, {}, set(), aliases, depth + 1)
    cls = [(a, getattr(type(value), a)) for a in _class_constants(type(value)) if a not in _attributes(value)]
    if cls:  # class attributes read through the instance (a layer class's is_sliding)
        env[f"XC{n}"] = operator.attrgetter(*(a for a, _ in cls))
        env[f"XZ{n}"] = tuple(v for _, v in cls) if len(cls) > 1 else cls[0][1]
        always.append(f"if XC{n}(XT{n}) != XZ{n}: return MISS")
    for k, (name, v) in enumerate(sorted(before.items(), key=lambda kv: kv[0])):
        if v is _compat.NOT_SET:
            always.append(f"if hasattr({var}, {name!r}): return MISS")
        elif isinstance(v, tuple) and v and v[0] is _TENSOR:
            env[f"XB{n}_{k}"] = v[1]
            always.append(f"if meta({var}.{name}) != XB{n}_{k}: return MISS")
        else:
            env[f"XB{n}_{k}"] = v
            always.append(f"if {var}.{name} != XB{n}_{k} or type({var}.{name}) is not type(XB{n}_{k}): return MISS")


def check_objects(lines: list[str], env: dict, objects: dict[tuple, Any], tensors: Sequence[tuple],
                  spelled: dict[tuple, str], named: dict[str, Any], stored: dict[tuple, Any],
                  aliases: dict[int, str]) -> None:
    """Append the checks of the objects the call reads inside (``check_object``: place -> object)
    and that they, and the tensors read (``tensors``: their places), are as distinct as the arming
    call's. Where no attribute of them is set by the forward, the checks that an unchanged
    ``__dict__`` settles are made only when a dict changed (``memo``)."""
    by_dict = [p for p, v in objects.items() if not stored and versioned(v)]

    def settled(place: tuple) -> bool:  # the same object while the dicts of by_dict are unchanged
        parent = (place[0], place[1][:-1])
        return place in by_dict or (bool(place[1]) and place[1][-1][0] == "attr" and parent in by_dict
                                    and dict_served(follow(named, parent), place[1][-1][1]))

    skip: list[str] = []
    for place, value in objects.items():
        # Attributes the forward sets, as they were before the traced call (those the graph also
        # reads are checked where they are read, dynamic sizes and all).
        before = {a: v for (p, a), v in stored.items() if p == place and (p[0], (*p[1], ("attr", a))) not in spelled}
        walked = {p[1][len(place[1])][1] for p in spelled
                  if len(p[1]) > len(place[1]) and p[:1] == place[:1] and p[1][:len(place[1])] == place[1]}
        items = isinstance(value, (list, tuple)) and all(
            (place[0], (*place[1], ("item", i))) in by_dict for i in range(len(value)))
        check_object(skip if place in by_dict or items else lines, env, spelled[place], value, before, walked,
                     aliases, always=lines, items_settled=items)
    apart = distinct({p: follow(named, p) for p in tensors}, spelled)
    stable = [p for p in tensors if settled(p)]
    if not stable or any(" is not " in line for line in apart):  # (aliased tensors: checked every call)
        lines += distinct(objects, spelled) + skip + apart
        return
    (skip if all(map(settled, objects)) else lines).extend(distinct(objects, spelled))
    lines += memo(env, [spelled[p] for p in by_dict], [spelled[p] for p in stable],
                  [spelled[p] for p in tensors if p not in stable], merge_checks(skip + apart, env))


def versioned(value: Any) -> bool:
    """Whether a dict version of ``value.__dict__`` tells that none of its attributes changed: a
    plain object (not a container, module, tensor or class) whose attributes all live in its
    ``__dict__`` (no ``__slots__`` values) and are read by the default ``__getattribute__``."""
    return (_compat.dict_version is not None and hasattr(value, "__dict__") and type(vars(value)) is dict
            and not isinstance(value, (type, list, tuple, dict, torch.nn.Module, torch.Tensor))
            and type(value).__getattribute__ is object.__getattribute__
            and _attributes(value).keys() == vars(value).keys())


def dict_served(obj: Any, key: str) -> bool:
    """Whether ``obj.key`` is read from ``obj.__dict__`` (no property or other data descriptor)."""
    return key in vars(obj) and not hasattr(getattr(type(obj), key, None), "__set__")


def memo(env: dict, objects: Sequence[str], stable: Sequence[str], fresh: Sequence[str],
         checks: list[str]) -> list[str]:
    """``checks`` (of the attributes of the plain objects ``objects``, and that the tensors read
    are distinct) made only when something changed since the last call that passed them: one of
    those objects' ``__dict__`` (its dict version; a new object's dict has a version no other had),
    or a tensor read fresh (``fresh``: an argument itself) that is one of the tensors read from
    their dicts (``stable``) or another fresh one. A decode step's KV cache and its layers: ~17
    dict versions, not ~120 attributes and the aliasing of ~50 tensors."""
    env["MEMO"], env["DV"] = [None], _compat.dict_version
    versions = f"tuple(map(DV, map(vars, ({', '.join(objects)},))))"
    miss = ["m is None", f"{versions} != m[0]"]
    if len(fresh) == 1:
        miss.append(f"id({fresh[0]}) in m[1]")
    elif fresh:
        ids = f"({', '.join(f'id({v})' for v in fresh)},)"
        miss.append(f"not m[1].isdisjoint(f := {ids}) or len(set(f)) != {len(fresh)}")
    return ["m = MEMO[0]", f"if {' or '.join(miss)}:", *("    " + line for line in checks),
            f"    MEMO[0] = ({versions}, frozenset(map(id, ({', '.join(stable)},))))"]


#: Marks a tensor's metadata among ``before`` values: ``(_TENSOR, tensor_meta(t))``.
_TENSOR = object()


def before_value(v: Any) -> Any:
    """How ``check_object`` takes an attribute's value before the traced call (a tensor by its
    metadata: the tensor is not held)."""
    return (_TENSOR, tensor_meta(v)) if isinstance(v, torch.Tensor) else v


def tensor_before(meta: tuple) -> tuple:
    """``before_value`` of a tensor of ``tensor_meta`` ``meta`` (a saved trace's)."""
    return _TENSOR, meta


def seen(t: torch.Tensor) -> tuple:
    """What a tensor's checks need of the tensor the trace saw (not the tensor itself)."""
    return tensor_meta(t), t.is_contiguous()


def distinct(objects: dict[tuple, Any], spelled: dict[tuple, str]) -> list[str]:
    """Checks that the objects the call reads inside are as distinct as the arming call's (the
    same layer object at two places of a list is another trace for Dynamo)."""
    groups: dict[int, list[str]] = {}
    for place, value in objects.items():
        groups.setdefault(id(value), []).append(spelled[place])
    lines = [f"if {a} is not {b}: return MISS" for same in groups.values() for a, b in zip(same, same[1:])]
    if len(groups) > 1:  # map(id, ...) in C: ~30 ns an object, not a Python call's ~60
        firsts = ", ".join(same[0] for same in groups.values())
        lines.append(f"if len(set(map(id, ({firsts},)))) != {len(groups)}: return MISS")
    return lines


_CONSTANTS = re.compile(r"^v = \(?XG(\d+)\((\w+)\),?\)?$")
_CLASS = re.compile(r"^if XC(\d+)\(XT\d+\) != XZ\d+: return MISS$")


def merge_checks(lines: list[str], env: dict) -> list[str]:
    """The same checks in fewer Python steps: the constant attributes of objects that hold the
    same names with the same values (a cache's layers) read by one ``map`` of one getter over all
    of them and compared at once, where the last of them was checked (every object's variable is
    assigned by then); a class's attributes checked once, not once per object of the class."""
    groups: dict[tuple, list[int]] = {}
    for i, line in enumerate(lines):
        m = _CONSTANTS.match(line)
        compare = m and f"if v != XW{m[1]} or tuple(map(type, v)) != XY{m[1]}: return MISS"
        if m and i + 1 < len(lines) and lines[i + 1] == compare:
            n = m[1]
            key = (repr(env[f"XG{n}"]), env[f"XW{n}"], env[f"XY{n}"])  # attrgetter('a', 'b'): its names
            try:
                hash(key)
            except TypeError:
                continue
            groups.setdefault(key, []).append(i)
    drop, at = set(), {}
    for members in groups.values():
        if len(members) < 2:
            continue
        n = _CONSTANTS.match(lines[members[0]])[1]
        single = lines[members[0]].startswith("v = (")  # one attribute: the getter gives the value itself
        objs = ", ".join(_CONSTANTS.match(lines[i])[2] for i in members)
        env[f"XWS{n}"] = tuple(env[f"XW{n}"][0] for _ in members) if single else tuple(env[f"XW{n}"] for _ in members)
        env[f"XYS{n}"] = env[f"XY{n}"] * len(members)
        env["chain"] = itertools.chain
        flat = "v" if single else "chain.from_iterable(v)"
        at[members[-1]] = [f"v = tuple(map(XG{n}, ({objs},)))",
                           f"if v != XWS{n} or tuple(map(type, {flat})) != XYS{n}: return MISS"]
        drop.update(i for k in members for i in (k, k + 1))
    seen_classes = set()
    out = []
    for i, line in enumerate(lines):
        if i in at:
            out += at[i]
        if i in drop:
            continue
        m = _CLASS.match(line)
        if m:
            n = m[1]
            key = (env[f"XT{n}"], repr(env[f"XC{n}"]), env[f"XZ{n}"])
            try:
                if key in seen_classes:
                    continue
                seen_classes.add(key)
            except TypeError:
                pass
        out.append(line)
    return out


def interior_guards(runnable: Any) -> list[sympy.Basic]:
    """The trace's guards on its sizes that a range's ends do not decide for the sizes inside it
    (``Eq(Mod(s0, 2), 0)``, ``Ne(s0, 5)``; not a bound ``s0 >= 2``), where the trace has ranges:
    a single size's guards were checked when it was compiled, a range's only at its ends."""
    program = getattr(runnable, "program", None)
    if program is None or all(b.is_static for b in program.bindings):
        return []
    return [g for g, _ in program.shapes.guards if g.free_symbols and not _is_bound(g)]


def _is_bound(guard: sympy.Basic) -> bool:
    """``s0 >= 2`` and the like: one size against a number."""
    return isinstance(guard, (sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge)) and (
        (guard.lhs.is_Symbol and guard.rhs.is_Integer) or (guard.lhs.is_Integer and guard.rhs.is_Symbol))


_RELATIONS = ((sympy.Eq, "=="), (sympy.Ne, "!="), (sympy.Lt, "<"), (sympy.Le, "<="), (sympy.Gt, ">"), (sympy.Ge, ">="))


def spell_bool(guard: sympy.Basic, names: dict[sympy.Symbol, str]) -> str:
    """Python source for a guard over the call's sizes (``names``: where the call shows each)."""
    if guard is sympy.true:
        return "True"
    if isinstance(guard, (sympy.And, sympy.Or)):
        joiner = " and " if isinstance(guard, sympy.And) else " or "
        return "(" + joiner.join(spell_bool(a, names) for a in guard.args) + ")"
    if isinstance(guard, sympy.Not):
        return f"(not {spell_bool(guard.args[0], names)})"
    for relation, op in _RELATIONS:
        if isinstance(guard, relation):
            return f"({python_expr(guard.lhs, names)} {op} {python_expr(guard.rhs, names)})"
    raise NotImplementedError(f"no Python spelling for {guard}")


def follow(named: dict[str, Any], place: tuple) -> Any:
    value = named[place[0]]
    for kind, key in place[1]:
        value = getattr(value, key) if kind == "attr" else value[key]
    return value


def spell_place(place: tuple) -> str:
    return place[0] + "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in place[1])


def check_tensor(body: list[str], env: dict, var: str, seen: tuple, label: str, symbols: dict[sympy.Symbol, str],
                 traced: tuple, strides: tuple | None, batch: list[tuple] | None = None,
                 example: torch.Tensor | None = None) -> str | None:
    """Append the checks Dynamo's guards make of a tensor: type, dtype, device, grad, rank,
    contiguity, its fixed sizes, and one value per dynamic size (``seen``: ``_seen`` of the
    tensor the trace saw; ``traced``: its sizes as the trace has them, symbols or ints; ``strides``:
    a view's, as Dynamo guards them). Why not, if it cannot. ``batch``: a contiguous tensor's type,
    dtype, device, grad, rank, fixed sizes and (all of them fixed) strides go there, to one
    C++ check of them all (``_compat.tensor_checks``), with ``example``, a tensor like it."""
    (cls, dtype, device, shape, grad), contiguous = seen
    if cls is not torch.Tensor:
        return f"{label} is a {cls.__name__}, not a plain tensor"
    if not contiguous and strides is None:
        return f"{label} is not contiguous"
    fixed = [(d, int(e)) for d, e in enumerate(traced) if e.is_Integer]
    n = len(env)
    if batch is not None and contiguous and example is not None and type(example) is torch.Tensor and (
            example.dtype, example.device, example.requires_grad) == (dtype, device, grad):
        sizes = [int(e) if e.is_Integer else None for e in traced]
        static = None not in sizes and 0 not in sizes
        batch.append((var, example, sizes, _contiguous_strides(sizes) if static else [None] * len(sizes)))
        if not static:
            body.append(f"if not {var}.is_contiguous(): return MISS")
        fixed = []
    else:
        env[f"D{n}"], env[f"V{n}"] = dtype, device
        body.append(f"if type({var}) is not Tensor or {var}.dtype is not D{n} or {var}.device != V{n} "
                    f"or {var}.requires_grad is not {grad} or {var}.dim() != {len(shape)}"
                    + (f" or not {var}.is_contiguous(): return MISS" if contiguous else ": return MISS"))
    if fixed:
        env[f"S{n}"] = operator.itemgetter(*(d for d, _ in fixed))
        want = tuple(v for _, v in fixed) if len(fixed) > 1 else fixed[0][1]
        body.append(f"if S{n}({var}.shape) != {want!r}: return MISS")
    for d, e in enumerate(traced):
        if e.is_Integer:
            continue
        if not e.is_Symbol:
            return f"dim {d} of {label} is sized {e}, an expression of dynamic sizes"
        if e in symbols:
            body.append(f"if {var}.shape[{d}] != {symbols[e]}: return MISS")
        else:
            symbols[e] = f"{var}.shape[{d}]"
    if not contiguous:  # a view: its strides and offset as Dynamo guards them (symbols, or as traced)
        for d, e in enumerate(strides):
            read = f"{var}.stride({d})" if d < len(shape) else f"{var}.storage_offset()"
            if e.is_Symbol and e not in symbols:
                symbols[e] = read
                continue
            try:
                body.append(f"if {read} != {python_expr(e, symbols)}: return MISS")
            except (NotImplementedError, KeyError):
                return f"the layout of {label} is {strides}, which a direct call cannot check"
    return None


def _contiguous_strides(sizes: Sequence[int]) -> list[int | None]:
    """A contiguous tensor's strides, None at a size-1 dim (any stride there is contiguous)."""
    out: list[int | None] = []
    step = 1
    for size in reversed(sizes):
        out.append(None if size == 1 else step)
        step *= size
    return out[::-1]
