"""Pass specs as text: ``concretize{sizes=1,8 refused=skip}``, and back.

In: a pass's dataclass fields and their values (``format_fields``), or a spec's text and the
pass class's field types (``split_top``, ``parse_value``). Out: the text, or the values, typed
by the fields' annotations (as xDSL's ``from_pass_spec``): a ``tuple[str, ...]`` field reads
``cuda`` as ``("cuda",)``, a ``str`` field reads ``1`` as ``"1"``, a field of passes reads
``a{x=1},b`` as two passes. A field typed ``Any`` reads a Python literal where there is one,
else a comma list, else the text itself. Fields are separated by spaces, list items by commas,
both outside brackets, braces and quotes. A callable value prints by its name: it does not
parse back.
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Union

from shapewise.errors import ConfigError

__all__ = ["format_fields", "format_value", "parse_value", "split_top"]

_NONE = type(None)
_SPECIAL = set(" ,{}[]()='\"=")


def split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` where it is outside brackets, braces and quotes (empty parts dropped
    when ``sep`` is a space)."""
    out, cur, depth, quote = [], [], 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0 and not quote:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [p for p in out if p] if sep == " " else out


def _compact(text: str) -> str:
    """A repr without the spaces outside its quotes (``{'a': [1, 2]}`` -> ``{'a':[1,2]}``)."""
    out, quote = [], ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == " ":
            continue
        out.append(ch)
    return "".join(out)


def _is_literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def format_value(v: Any) -> str:
    """One field's value as spec text."""
    if hasattr(v, "spec") and callable(v.spec) and hasattr(v, "apply"):  # a pass
        return v.spec()
    if isinstance(v, str):
        return v if v and not (_SPECIAL & set(v)) and not _is_literal(v) else repr(v)
    if isinstance(v, (list, tuple)) and v and all(
            hasattr(x, "spec") and hasattr(x, "apply") for x in v):
        return ",".join(x.spec() for x in v)
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in v):
        items = [format_value(x) for x in v]
        if not any("," in x for x in items):
            return ",".join(items)
    if callable(v) and not isinstance(v, type):
        return getattr(v, "__name__", type(v).__name__)
    return _compact(repr(dict(v) if isinstance(v, collections.abc.Mapping) else v))


def format_fields(obj: Any, every_field: bool = False) -> list[str]:
    """``["name=value", ...]`` for a dataclass's shown fields (``repr=True``), those that differ
    from their defaults unless ``every_field``."""
    out = []
    for f in dataclasses.fields(obj):
        if not f.repr:
            continue
        value = getattr(obj, f.name)
        if not every_field:
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = dataclasses.MISSING
            if default is not dataclasses.MISSING and value == default:
                continue
        out.append(f"{f.name}={format_value(value)}")
    return out


def _untyped(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    parts = split_top(text, ",")
    if len(parts) > 1:
        return tuple(_untyped(p) for p in parts)
    return text


def parse_value(text: str, tp: Any, parse_pass: Callable[[str], Any], is_pass_type: Callable[[Any], bool]) -> Any:
    """Spec text as a value of the annotation ``tp`` (see the module docstring). A text that is not
    a ``tp`` raises ``ConfigError``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is None or isinstance(tp, (str, typing.TypeVar)):
        return _untyped(text)
    if origin is Union or origin is types.UnionType:
        if text == "None" and _NONE in args:
            return None
        for a in args:
            if a is _NONE:
                continue
            try:
                return parse_value(text, a, parse_pass, is_pass_type)
            except ConfigError:
                continue
        raise ConfigError(f"{text!r} is none of {tp}")
    if origin is typing.ClassVar:
        return _untyped(text)
    if is_pass_type(tp):
        return parse_pass(text)
    if origin in (tuple, list, collections.abc.Sequence, collections.abc.Iterable):
        elem = args[0] if args and (len(args) == 1 or (len(args) == 2 and args[1] is Ellipsis)) else Any
        if text in ("()", "[]"):
            return ()
        if text[:1] in "([" and not is_pass_type(elem):
            value = _literal(text, tp)
            if isinstance(value, (tuple, list)):
                return tuple(value)
        return tuple(parse_value(p, elem, parse_pass, is_pass_type) for p in split_top(text, ","))
    if tp is bool:
        if text in ("True", "False"):
            return text == "True"
        raise ConfigError(f"{text!r} is not True or False")
    if tp in (int, float):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (tp is int and not isinstance(value, int)):
            raise ConfigError(f"{text!r} is not {'an int' if tp is int else 'a number'}")
        return value
    if tp is str:
        return _literal(text, tp) if text[:1] in "'\"" else text
    if tp in (dict, collections.abc.Mapping) or origin in (dict, collections.abc.Mapping):
        value = _literal(text, tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{text!r} is not a dict")
        return value
    return _untyped(text)


def _literal(text: str, tp: Any) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ConfigError(f"{text!r} is not a {getattr(tp, '__name__', tp)} literal") from e
