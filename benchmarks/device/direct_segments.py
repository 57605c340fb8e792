"""Where a direct call's own host time goes, segment by segment of its generated source.

``segments(direct, args, kwargs)`` builds functions of the first k statements of the direct
call's source (inside its ``try`` block too), each returning before the compiled program runs,
times each on ``(args, kwargs)``, and gives the cost of each run of statements between two cut
points: the difference of neighbouring prefixes' medians. The compiled program is not run: the
call's ``run`` is a stub handing back the outputs of one real call (made first, after
``rewind()``), so the last row is the call's output rebuild. Used by ``host_breakdown.py``.
"""

from __future__ import annotations

import ast
import statistics
import time
from typing import Any


def _statements(fn_def: ast.FunctionDef) -> list[tuple[int, int | None]]:
    """(top-level index, index inside the try body or None) for each statement, in order."""
    out = []
    for i, stmt in enumerate(fn_def.body):
        if isinstance(stmt, ast.Try):
            out += [(i, j) for j in range(len(stmt.body))]
        else:
            out.append((i, None))
    return out


def _prefix(fn_def: ast.FunctionDef, upto: tuple[int, int | None]) -> ast.FunctionDef:
    i, j = upto
    body = [s for s in fn_def.body[:i]]
    stmt = fn_def.body[i]
    if j is None:
        body.append(stmt)
    else:
        cut = ast.Try(body=stmt.body[:j + 1], handlers=stmt.handlers, orelse=[], finalbody=[])
        body.append(cut)
    body.append(ast.Return(value=ast.Constant(value=None)))
    return ast.FunctionDef(name="direct", args=fn_def.args, body=body, decorator_list=[], returns=None,
                           type_params=[], lineno=1, col_offset=0)


def segments(direct: Any, args: tuple, kwargs: dict, rewind: Any, cuts: int = 12, calls: int = 2000) -> list[dict]:
    """Rows of (first statement, last statement, µs) for about ``cuts`` runs of statements."""
    tree = ast.parse(direct.source)
    fn_def = tree.body[0]
    stmts = _statements(fn_def)
    env = dict(direct.fn.__globals__)
    real, got = env["run"], {}

    def spy(*a: Any) -> Any:
        got["out"] = real(*a)
        return got["out"]

    env["run"] = spy
    whole = {}
    exec(compile(tree, "<direct>", "exec"), whole.update(env) or whole)  # noqa: S102 - the call's own source
    rewind()
    whole["direct"](args, kwargs)
    env["run"] = lambda *a: got["out"]
    whole["run"] = env["run"]
    step = max(1, len(stmts) // cuts)
    points = list(range(step - 1, len(stmts) - 1, step))
    funcs = []
    for p in points:
        mod = ast.Module(body=[_prefix(fn_def, stmts[p])], type_ignores=[])
        ast.fix_missing_locations(mod)
        scope = dict(env)
        exec(compile(mod, "<direct prefix>", "exec"), scope)  # noqa: S102 - the call's own source, cut
        funcs.append(scope["direct"])
    funcs.append(whole["direct"])

    def median_us(fn) -> float:
        for _ in range(50):
            fn(args, kwargs)
        samples = []
        for _ in range(calls):
            t = time.perf_counter()
            fn(args, kwargs)
            samples.append(time.perf_counter() - t)
        return 1e6 * statistics.median(samples)

    times = [median_us(f) for f in funcs]
    lines = direct.source.splitlines()
    rows, before, start = [], 0.0, 0
    for p, t in zip(points + [len(stmts) - 1], times):
        first = _line(fn_def, stmts[start])
        last = _line(fn_def, stmts[p])
        rows.append({"from": lines[first - 1].strip()[:80], "to": lines[last - 1].strip()[:80],
                     "statements": p - start + 1, "us": round(t - before, 2)})
        before, start = t, p + 1
    return rows


def _line(fn_def: ast.FunctionDef, at: tuple[int, int | None]) -> int:
    i, j = at
    stmt = fn_def.body[i]
    return stmt.body[j].lineno if j is not None else stmt.lineno


def statement_costs(direct: Any, args: tuple, kwargs: dict, rewind: Any, calls: int = 2000,
                    top: int = 15) -> list[dict]:
    """The costliest statements of the direct call's checks, each timed alone: its expression (an
    ``if ...: return MISS``'s condition, an assignment's value) evaluated ``calls`` times in the
    variables of one real call (taken when it calls ``run``), less an empty expression's time.
    Statements inside a branch the call did not take (the dict-version memo's checks on a hit) are
    timed too: their rows say so. ``top`` rows, costliest first."""
    import sys

    env = dict(direct.fn.__globals__)
    real, seen = env["run"], {}

    def spy(*a: Any) -> Any:
        seen["locals"] = dict(sys._getframe(1).f_locals)
        return real(*a)

    env["run"] = spy
    scope: dict[str, Any] = {}
    exec(compile(direct.source, "<direct>", "exec"), scope.update(env) or scope)  # noqa: S102 - its own source
    rewind()
    scope["direct"](args, kwargs)
    if "locals" not in seen:
        return []
    ns = {**env, **seen["locals"]}
    empty = compile("None", "<e>", "eval")

    def median_us(code: Any) -> float:
        for _ in range(50):
            eval(code, ns)  # noqa: S307 - the call's own expressions
        samples = []
        for _ in range(calls):
            t = time.perf_counter()
            eval(code, ns)  # noqa: S307
            samples.append(time.perf_counter() - t)
        return 1e6 * statistics.median(samples)

    base = median_us(empty)
    rows = []
    for node in ast.walk(ast.parse(direct.source)):
        expr = node.test if isinstance(node, ast.If) else node.value if isinstance(node, ast.Assign) else None
        if expr is None:
            continue
        text = ast.unparse(expr)
        if "run(" in text:
            continue
        try:
            us = median_us(compile(ast.Expression(expr), "<stmt>", "eval")) - base
        except Exception as e:  # noqa: BLE001 - a variable this call did not set (a branch not taken)
            us, text = float("nan"), f"{text} ({type(e).__name__})"
        rows.append({"statement": text[:100], "us": round(us, 2)})
    rows.sort(key=lambda r: -r["us"] if r["us"] == r["us"] else 0)
    return rows[:top]
