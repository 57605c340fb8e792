"""Tests for shapewise.planner: optimality, validation, CLI, and speed."""

from __future__ import annotations

import io
import itertools
import math
import random
import time
from bisect import bisect_left

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shapewise.plan_cli import main
from shapewise.planner import Plan, plan_sizes

# --------------------------------------------------------------------- helpers


def padding_of(hist: dict[int, int], sizes: tuple[int, ...]) -> int:
    """Padding of a ladder, computed independently of the planner."""
    total = 0
    for x, n in hist.items():
        total += (sizes[bisect_left(sizes, x)] - x) * n
    return total


def brute_force(hist, k, cost=lambda s: 0, candidates=None):
    """Best (padding + cost) over every subset of candidates that covers all."""
    top_obs = max(hist)
    cands = sorted(set(candidates if candidates is not None else hist))
    top = min(c for c in cands if c >= top_obs)
    rest = [c for c in cands if c < top]
    best = math.inf
    for r in range(min(k - 1, len(rest)) + 1):
        for combo in itertools.combinations(rest, r):
            sizes = (*combo, top)
            value = padding_of(hist, sizes) + sum(cost(s) for s in sizes)
            best = min(best, value)
    return best


def naive_dp(hist, k):
    """Plain O(k n^2) DP over distinct observed sizes (no compile cost)."""
    xs = sorted(hist)
    n = len(xs)
    seg = [[0] * (n + 1) for _ in range(n + 1)]
    for j in range(1, n + 1):
        for i in range(j):
            seg[i][j] = sum((xs[j - 1] - x) * hist[x] for x in xs[i:j])
    g = [0] + [math.inf] * n
    for _ in range(k):
        g = [0] + [min(g[i] + seg[i][j] for i in range(j)) for j in range(1, n + 1)]
    return g[n]


def check_plan(plan: Plan, hist: dict[int, int], k: int) -> None:
    """Invariants every plan must satisfy."""
    assert list(plan.sizes) == sorted(set(plan.sizes))
    assert 1 <= len(plan.sizes) <= k
    assert plan.sizes[-1] >= max(hist)
    assert plan.padding == padding_of(hist, plan.sizes)
    assert plan.total == sum(x * n for x, n in hist.items())
    assert plan.waste == pytest.approx(plan.padding / (plan.total + plan.padding))
    assert sum(plan.served) == sum(hist.values())
    assert sum(plan.bucket_padding) == plan.padding
    assert len(plan.served) == len(plan.bucket_padding) == len(plan.sizes)


histograms = st.dictionaries(
    st.integers(min_value=1, max_value=60),
    st.integers(min_value=1, max_value=9),
    min_size=1,
    max_size=8,
)
small_k = st.integers(min_value=1, max_value=9)


# ------------------------------------------------------------ optimality


@settings(max_examples=150, deadline=None)
@given(hist=histograms, k=small_k)
def test_matches_brute_force_without_cost(hist, k):
    plan = plan_sizes(hist, k)
    check_plan(plan, hist, k)
    assert plan.sizes[-1] == max(hist)
    assert set(plan.sizes) <= set(hist)
    assert plan.padding == brute_force(hist, k)
    assert plan.compile_cost == 0.0


@settings(max_examples=150, deadline=None)
@given(hist=histograms, k=small_k, cost=st.integers(min_value=0, max_value=80))
def test_matches_brute_force_with_constant_cost(hist, k, cost):
    plan = plan_sizes(hist, k, compile_cost=cost)
    check_plan(plan, hist, k)
    assert plan.sizes[-1] == max(hist)
    assert plan.compile_cost == cost * len(plan.sizes)
    assert plan.objective == brute_force(hist, k, lambda s: cost)


@settings(max_examples=100, deadline=None)
@given(
    hist=histograms,
    k=small_k,
    costs=st.lists(st.floats(min_value=0, max_value=50), min_size=61, max_size=61),
    use_callable=st.booleans(),
)
def test_matches_brute_force_with_per_size_cost(hist, k, costs, use_callable):
    table = dict(enumerate(costs))
    cost = table.__getitem__ if use_callable else table
    plan = plan_sizes(hist, k, compile_cost=cost)
    check_plan(plan, hist, k)
    assert plan.compile_cost == pytest.approx(sum(table[s] for s in plan.sizes))
    expected = brute_force(hist, k, table.__getitem__)
    assert plan.objective == pytest.approx(expected, rel=1e-9, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    hist=histograms,
    k=small_k,
    extra=st.lists(st.integers(min_value=1, max_value=80), max_size=6),
    cost=st.sampled_from([None, 0, 5, 40]),
)
def test_matches_brute_force_with_candidates(hist, k, extra, cost):
    candidates = [*extra, 75]  # always something above the largest observation
    plan = plan_sizes(hist, k, candidates=candidates, compile_cost=cost)
    check_plan(plan, hist, k)
    assert set(plan.sizes) <= set(candidates)
    assert plan.sizes[-1] == min(c for c in candidates if c >= max(hist))
    expected = brute_force(hist, k, lambda s: cost or 0, candidates=candidates)
    assert plan.objective == expected


@settings(max_examples=40, deadline=None)
@given(
    hist=st.dictionaries(
        st.integers(min_value=1, max_value=500),
        st.integers(min_value=1, max_value=20),
        min_size=1,
        max_size=45,
    ),
    k=st.integers(min_value=1, max_value=12),
)
def test_matches_naive_dp_on_larger_inputs(hist, k):
    # Deeper divide-and-conquer recursion than the brute-force tests reach.
    plan = plan_sizes(hist, k)
    check_plan(plan, hist, k)
    assert plan.padding == naive_dp(hist, k)


def test_known_example():
    plan = plan_sizes([1, 2, 3, 10, 11, 12], 2)
    assert plan.sizes == (3, 12)
    assert plan.padding == (2 + 1) + (2 + 1)
    assert plan.total == 39
    assert plan.waste == pytest.approx(6 / 45)
    assert plan.served == (3, 3)
    assert plan.bucket_padding == (3, 3)


def test_more_sizes_than_distinct_values_gives_zero_padding():
    plan = plan_sizes([5, 7, 7, 9], 10)
    assert plan.sizes == (5, 7, 9)
    assert plan.padding == 0
    assert plan.waste == 0.0


def test_high_compile_cost_chooses_fewer_sizes():
    hist = {10: 1, 11: 1, 100: 1}
    assert plan_sizes(hist, 3).sizes == (10, 11, 100)
    cheap = plan_sizes(hist, 3, compile_cost=0.5)
    assert cheap.sizes == (10, 11, 100)
    # Adding 10 costs 5 but saves only 1 padded element; 11 saves 89.
    mid = plan_sizes(hist, 3, compile_cost=5)
    assert mid.sizes == (11, 100)
    assert mid.padding == 1
    assert mid.compile_cost == 10.0
    assert plan_sizes(hist, 3, compile_cost=1000).sizes == (100,)


def test_zero_counts_are_ignored():
    plan = plan_sizes({4: 3, 50: 0, 8: 1}, 1)
    assert plan.sizes == (8,)
    assert plan.padding == 12


def test_huge_sizes_are_exact():
    big = 10**30
    hist = {big + 1: 3, big + 5: 1, big + 100: 2, 3: 4}
    plan = plan_sizes(hist, 2)
    check_plan(plan, hist, 2)
    assert plan.padding == brute_force(hist, 2)
    assert plan.sizes == (3, big + 100)


def test_numpy_inputs_are_accepted():
    data = np.array([4, 4, 9, 2], dtype=np.int32)
    assert plan_sizes(data, 2).sizes == plan_sizes([4, 4, 9, 2], 2).sizes
    assert plan_sizes({np.int64(4): np.int64(2), 9: 1}, 1).padding == 10


# -------------------------------------------------- histogram vs list forms


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=60),
    k=st.integers(min_value=1, max_value=6),
    cost=st.sampled_from([None, 3, 12.5]),
)
def test_histogram_and_list_forms_agree(data, k, cost):
    hist: dict[int, int] = {}
    for x in data:
        hist[x] = hist.get(x, 0) + 1
    from_list = plan_sizes(data, k, compile_cost=cost)
    from_hist = plan_sizes(hist, k, compile_cost=cost)
    from_iter = plan_sizes(iter(data), k, compile_cost=cost)
    assert from_list == from_hist == from_iter


# ------------------------------------------------------------------ Plan


def test_bucket_of():
    plan = plan_sizes([3, 8, 8, 20], 3)
    assert plan.sizes == (3, 8, 20)
    assert [plan.bucket_of(s) for s in (1, 3, 4, 8, 9, 20)] == [3, 3, 8, 8, 20, 20]
    with pytest.raises(
        ValueError, match=r"size 21 is larger than the largest bucket 20"
    ):
        plan.bucket_of(21)
    with pytest.raises(ValueError, match="positive"):
        plan.bucket_of(0)
    with pytest.raises(TypeError, match="must be an integer"):
        plan.bucket_of(2.5)


def test_plan_is_frozen():
    plan = plan_sizes([1, 2], 1)
    with pytest.raises(AttributeError):
        plan.sizes = (5,)


def test_table_lists_each_bucket():
    plan = plan_sizes({3: 2, 5: 3, 9: 4}, 2, compile_cost=1.5)
    text = str(plan)
    assert text == plan.table()
    lines = text.splitlines()
    assert lines[0].split() == ["bucket", "served", "padding", "waste"]
    assert lines[1].split()[:3] == ["5", "5", "4"]
    assert lines[2].split()[:3] == ["9", "4", "0"]
    assert "2 sizes" in lines[-1]
    assert "padding 4" in lines[-1]
    assert "compile cost 3" in lines[-1]
    assert f"{plan.waste:.2%}" in lines[-1]


# ------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    ("observed", "k", "kwargs", "exc", "pattern"),
    [
        ([], 2, {}, ValueError, "no observations"),
        ({}, 2, {}, ValueError, "no observations"),
        ({5: 0}, 2, {}, ValueError, "positive count"),
        ([3, 0, 4], 2, {}, ValueError, r"positive integers, got 0 \(at position 1\)"),
        ([3, -2], 2, {}, ValueError, "positive integers, got -2"),
        ({0: 1}, 2, {}, ValueError, "positive integers, got size 0"),
        ([3, 4.5], 2, {}, TypeError, r"observed size #1 must be an integer, got 4\.5"),
        ([3, "4"], 2, {}, TypeError, "must be an integer, got '4'"),
        ([True], 2, {}, TypeError, "must be an integer, got True"),
        ({3: 1.5}, 2, {}, TypeError, "count for size 3 must be an integer"),
        ({3: -1}, 2, {}, ValueError, "counts must be >= 0, got count -1 for size 3"),
        ("123", 2, {}, TypeError, "not a string"),
        (5, 2, {}, TypeError, "iterable of integer sizes"),
        ([3], 0, {}, ValueError, "max_sizes must be >= 1, got 0"),
        ([3], 2.0, {}, TypeError, "max_sizes must be an integer"),
        ([3, 9], 2, {"candidates": [1, 8]}, ValueError, "largest observed size 9"),
        ([3], 2, {"candidates": []}, ValueError, "candidates is empty"),
        ([3], 2, {"candidates": [0, 4]}, ValueError, "positive integers, got 0"),
        ([3], 2, {"candidates": [3.5]}, TypeError, "candidate size must be an integer"),
        ([3], 2, {"compile_cost": -1}, ValueError, "finite number >= 0, got -1"),
        ([3], 2, {"compile_cost": math.nan}, ValueError, "finite number >= 0"),
        ([3], 2, {"compile_cost": "x"}, TypeError, "compile_cost must be a number"),
        ([3, 5], 2, {"compile_cost": {3: 1}}, ValueError, "no entry for size 5"),
        (
            [3],
            2,
            {"compile_cost": {3: -2}},
            ValueError,
            "size 3 must be finite and >= 0",
        ),
        ([3], 2, {"compile_cost": lambda s: None}, TypeError, "must be a real number"),
    ],
)
def test_bad_input_messages(observed, k, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        plan_sizes(observed, k, **kwargs)


# ------------------------------------------------------------------- CLI


def write(tmp_path, text: str):
    path = tmp_path / "sizes.txt"
    path.write_text(text)
    return str(path)


def test_cli_reads_mixed_formats(tmp_path, capsys):
    path = write(
        tmp_path,
        "# sequence lengths\n3\n\n5,1   # one more\n9 4\n  3 , 1\n",
    )
    assert main([path, "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert out == str(plan_sizes({3: 2, 5: 1, 9: 4}, 2)) + "\n"
    assert "waste" in out


def test_cli_compile_cost_changes_the_ladder(tmp_path, capsys):
    path = write(tmp_path, "10\n11\n100\n")
    assert main([path, "--max-sizes", "3", "--compile-cost", "1000"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[0] == "100"
    assert "1 size:" in out
    assert "compile cost 1000" in out


def test_cli_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("4\n4\n16\n"))
    assert main(["-", "-k", "1"]) == 0
    out = capsys.readouterr().out
    assert "padding 24" in out


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("4\nabc\n", ":2: size must be a positive integer, got 'abc'"),
        ("4\n\n# c\n0\n", ":4: size must be a positive integer, got 0"),
        ("4\n5,-1\n", ":2: count must be a non-negative integer, got -1"),
        ("4\n5,x\n", ":2: count must be a non-negative integer, got 'x'"),
        ("4\n3.5\n", ":2: size must be a positive integer, got '3.5'"),
        ("1 2 3\n", ":1: expected 'size' or 'size,count'"),
        ("4,\n", ":1: expected 'size' or 'size,count'"),
        ("# nothing\n\n", "no sizes found"),
        ("4,0\n", "no positive counts found"),
    ],
)
def test_cli_bad_file_content(tmp_path, capsys, text, pattern):
    path = write(tmp_path, text)
    assert main([path, "-k", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("shapewise plan: error: ")
    assert pattern in captured.err


def test_cli_missing_file(tmp_path, capsys):
    missing = str(tmp_path / "nope.txt")
    assert main([missing, "-k", "2"]) == 1
    err = capsys.readouterr().err
    assert "cannot read" in err
    assert "nope.txt" in err


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["-k", "0"], "-k/--max-sizes must be >= 1, got 0"),
        (["-k", "2", "--compile-cost", "-3"], "--compile-cost must be a finite"),
        (["-k", "2", "--compile-cost", "nan"], "--compile-cost must be a finite"),
        (["-k", "two"], "invalid int value: 'two'"),
        ([], "required: -k/--max-sizes"),
    ],
)
def test_cli_usage_errors(tmp_path, capsys, args, pattern):
    path = write(tmp_path, "4\n")
    assert main([path, *args]) == 2
    err = capsys.readouterr().err
    assert "shapewise plan" in err
    assert pattern in err


def test_cli_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shapewise plan")
    assert "--max-sizes" in out


# ------------------------------------------------------------- performance


def test_large_input_is_fast():
    rng = random.Random(1234)
    sizes = rng.sample(range(1, 10**7), 100_000)
    hist = {s: rng.randint(1, 50) for s in sizes}
    start = time.perf_counter()
    plan = plan_sizes(hist, 32)
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"plan_sizes took {elapsed:.1f}s for 10^5 sizes, K=32"
    assert len(plan.sizes) == 32
    assert plan.sizes[-1] == max(sizes)
    assert plan.padding == padding_of(hist, plan.sizes)
    # Optimal ladders only improve with more sizes.
    assert plan.padding < plan_sizes(hist, 16).padding
