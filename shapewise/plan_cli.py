"""``shapewise plan FILE -k K``: read observed sizes (one per line, or ``size,count``) and
print the bucket ladder ``plan_sizes`` chooses, with its padding waste."""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from typing import TextIO

from shapewise.planner import plan_sizes

__all__ = ["main"]


class _InputError(Exception):
    """Bad content in the sizes file (message names the file and line)."""


def _read_histogram(stream: TextIO, name: str) -> dict[int, int]:
    """Parse ``size`` / ``size,count`` / ``size count`` lines into a histogram."""
    hist: Counter[int] = Counter()
    seen = False
    for lineno, line in enumerate(stream, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = [p.strip() for p in text.split(",")] if "," in text else text.split()
        where = f"{name}:{lineno}"
        if len(parts) > 2 or not all(parts):
            raise _InputError(
                f"{where}: expected 'size' or 'size,count' (or 'size count'), "
                f"got {text!r}"
            )
        try:
            size = int(parts[0])
        except ValueError:
            raise _InputError(
                f"{where}: size must be a positive integer, got {parts[0]!r}"
            ) from None
        if size < 1:
            raise _InputError(f"{where}: size must be a positive integer, got {size}")
        count = 1
        if len(parts) == 2:
            try:
                count = int(parts[1])
            except ValueError:
                raise _InputError(
                    f"{where}: count must be a non-negative integer, got {parts[1]!r}"
                ) from None
            if count < 0:
                raise _InputError(
                    f"{where}: count must be a non-negative integer, got {count}"
                )
        seen = True
        if count:
            hist[size] += count
    if not hist:
        what = "no positive counts" if seen else "no sizes"
        raise _InputError(
            f"{name}: {what} found; expected one size per line (or 'size,count' lines)"
        )
    return dict(hist)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shapewise plan",
        description=(
            "Choose at most K padded sizes for the observed sizes, minimising "
            "padding (plus an optional per-size compile cost)."
        ),
    )
    parser.add_argument(
        "file",
        help="file of sizes: one integer per line, or 'size,count' / 'size count' "
        "lines; blank lines and '#' comments are ignored; '-' reads stdin",
    )
    parser.add_argument(
        "-k", "--max-sizes", type=int, required=True, help="at most this many sizes"
    )
    parser.add_argument(
        "--compile-cost",
        type=float,
        default=None,
        metavar="FLOAT",
        help="cost of each chosen size, in padded elements",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``shapewise plan``; return the exit status (0 ok, 1 bad input, 2 usage)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error; argparse printed it
        return exc.code if isinstance(exc.code, int) else 2
    prog = parser.prog
    if args.max_sizes < 1:
        print(
            f"{prog}: error: -k/--max-sizes must be >= 1, got {args.max_sizes}",
            file=sys.stderr,
        )
        return 2
    cost = args.compile_cost
    if cost is not None and not (math.isfinite(cost) and cost >= 0):
        print(
            f"{prog}: error: --compile-cost must be a finite number >= 0, got {cost}",
            file=sys.stderr,
        )
        return 2
    try:
        if args.file == "-":
            hist = _read_histogram(sys.stdin, "<stdin>")
        else:
            with open(args.file, encoding="utf-8") as fh:
                hist = _read_histogram(fh, args.file)
        plan = plan_sizes(hist, args.max_sizes, compile_cost=args.compile_cost)
    except OSError as exc:
        print(
            f"{prog}: error: cannot read {args.file!r}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    except UnicodeDecodeError as exc:
        print(f"{prog}: error: {args.file!r} is not UTF-8 text: {exc}", file=sys.stderr)
        return 1
    except (_InputError, ValueError, TypeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    print(plan.table())
    return 0
