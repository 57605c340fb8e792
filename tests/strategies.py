"""Hypothesis strategies shared by the property tests: integer size expressions over three
symbols with torch's FloorDiv, CeilDiv, Mod, Max and Min, as trees (``_exprs``) and as sympy
(``to_sympy``)."""

from __future__ import annotations

import sympy
from hypothesis import strategies as st

from shapewise._compat import CeilDiv, FloorDiv, Max, Min, Mod

SYMS = sympy.symbols("s0 s1 s2", integer=True, positive=True)


def _exprs():
    leaves = st.one_of(
        st.sampled_from([("sym", i) for i in range(3)]),
        st.integers(1, 9).map(lambda c: ("const", c)),
    )

    def extend(children):
        const = st.integers(1, 7)
        return st.one_of(
            st.tuples(st.sampled_from(["add", "mul", "max", "min"]), children, children),
            st.tuples(st.sampled_from(["floordiv", "ceildiv", "mod"]), children, const),
        )

    return st.recursive(leaves, extend, max_leaves=8)


def to_sympy(tree):
    kind = tree[0]
    if kind == "sym":
        return SYMS[tree[1]]
    if kind == "const":
        return sympy.Integer(tree[1])
    a = to_sympy(tree[1])
    if kind in ("floordiv", "ceildiv", "mod"):
        c = sympy.Integer(tree[2])
        return {"floordiv": FloorDiv, "ceildiv": CeilDiv, "mod": Mod}[kind](a, c)
    b = to_sympy(tree[2])
    return {"add": lambda: a + b, "mul": lambda: a * b, "max": lambda: Max(a, b), "min": lambda: Min(a, b)}[kind]()
