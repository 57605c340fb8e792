"""``shapewise inspect``: run a model through the pipeline with every instrument on, write the
dump folder and print a summary.

    shapewise inspect                                  # the built-in toy transformer
    shapewise inspect --model mypkg.models:make --sizes 1,8,64 --ranges 65,512 --out dump

``--model package.module:factory`` names a function that returns ``(module, example_inputs)``
or ``(module, example_inputs, options)``; ``example_inputs`` is a tensor or a tuple of
arguments for the one trace, ``options`` a dict of ``shapewise.compile`` keywords (``sizes``,
``ranges``, ``splitting_ops``, ``dynamic_dims``) that the command-line flags override. Without
sizes from either, the traced size is compiled.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_factory", "main", "toy_factory"]


def toy_factory() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]:
    """The built-in model: ``ToyTransformer`` (2 layers, vocab 64), split at its attention op."""
    from shapewise.models import ATTENTION_OP, ToyTransformer

    torch.manual_seed(0)
    model = ToyTransformer(layers=2, dim=32, heads=4, hidden=64, vocab=64).eval()
    ids = torch.arange(8) % 64
    return model, (ids,), {"sizes": [1, 8], "ranges": [(9, 64)], "splitting_ops": [ATTENTION_OP]}


def load_factory(spec: str):
    """``package.module:factory`` → the factory function (errors say what was wrong)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model takes package.module:factory, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} (from --model {spec}): {e}") from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"{module_name} has no callable {attr!r} (from --model {spec})")
    return fn


def _call_factory(fn) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    made = fn()
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not callable(made[0]):
        raise ValueError("the factory must return (module, example_inputs) or (module, example_inputs, options), "
                         f"got {type(made).__name__}")
    model, inputs = made[0], made[1]
    options = dict(made[2]) if len(made) == 3 else {}
    inputs = inputs if isinstance(inputs, tuple) else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    unknown = set(options) - {"sizes", "ranges", "splitting_ops", "dynamic_dims"}
    if unknown:
        raise ValueError(f"unknown factory option(s) {sorted(unknown)}: use sizes, ranges, splitting_ops, dynamic_dims")
    return model, inputs, options


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated ints, got {text!r}") from None


def _int_range(inputs: Sequence[Any]) -> tuple[int, int]:
    """Random integer inputs stay within what the example inputs held (valid indices)."""
    ints = [t for t in inputs if isinstance(t, torch.Tensor) and not t.is_floating_point()
            and not t.is_complex() and t.dtype != torch.bool and t.numel()]
    if not ints:
        return 0, 2
    return min(int(t.min()) for t in ints), max(int(t.max()) for t in ints) + 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shapewise inspect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="package.module:factory (default: the built-in toy transformer)")
    p.add_argument("--sizes", help="static sizes, comma-separated (e.g. 1,8,64)")
    p.add_argument("--ranges", action="append", default=None, metavar="LOW,HIGH",
                   help="an inclusive size range compiled with symbolic sizes; may repeat")
    p.add_argument("--splitting-op", action="append", default=None, dest="splitting_ops", metavar="OP",
                   help="a splitting op (ns::op or an alias like sdpa); may repeat")
    p.add_argument("--backend", default="inductor", help="inductor | aot_eager | eager (default inductor)")
    p.add_argument("--out", default="shapewise-dump", help="the dump folder (default ./shapewise-dump)")
    p.add_argument("--no-verify", action="store_true", help="skip the check against eager")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shapewise inspect``; 0 when every check matched eager, 1 on a mismatch or bad input."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    import shapewise as sw
    from shapewise.display import piece_rows
    from shapewise.ir import text_table

    try:
        factory = load_factory(args.model) if args.model else toy_factory
        model, inputs, options = _call_factory(factory)
        if args.sizes:
            options["sizes"] = _ints(args.sizes, "--sizes")
        if args.ranges:
            options["ranges"] = [tuple(_ints(r, "--ranges")) for r in args.ranges]
        if args.splitting_ops:
            options["splitting_ops"] = args.splitting_ops
        if not options.get("sizes") and not options.get("ranges"):
            first = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim()), None)
            options["sizes"] = [first.shape[0]] if first is not None else []
    except ValueError as e:
        print(f"shapewise inspect: error: {e}", file=sys.stderr)
        return 1

    out = Path(args.out)
    dump, timing = sw.Dump(out), sw.Timing()
    verify = sw.Verify(int_range=_int_range(inputs))
    instruments = [dump, timing] + ([] if args.no_verify else [verify])
    name = "ToyTransformer (built in)" if not args.model else args.model
    print(f"shapewise inspect: {name} | backend {args.backend} | sizes {list(options.get('sizes', []))} | "
          f"ranges {list(options.get('ranges', []))} | splitting ops {list(options.get('splitting_ops', []))}")
    t0 = time.perf_counter()
    try:
        fast = sw.compile(model, backend=args.backend, instruments=instruments, **options)
        with torch.no_grad():
            fast(*inputs)
    except sw.ShapewiseError as e:  # a bad option or size, or a compile that failed: one line, no traceback
        print(f"shapewise inspect: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    program = fast.program
    n_split = sum(1 for p in program.pieces if p.is_splitting)
    print(f"traced {fast.traces}x, compiled in {time.perf_counter() - t0:.1f} s; "
          f"{len(program.pieces)} pieces ({n_split} splitting)\n")
    print(text_table(piece_rows(program), ["piece", "kind", "ops", "inputs", "outputs"]))
    print()
    print(program.dispatch)
    print(f"\ncompile report ({len(fast.report())} variants)")
    print(fast.report())
    print("\ntime per pass")
    print(timing)
    status = 0
    if not args.no_verify:
        bad = [r for r in verify.rows if not r["ok"]]
        sizes = sorted({r["size"] for r in verify.rows})
        print(f"\nverify against eager: {len(verify.rows)} checks ({len(sizes)} sizes x stages), "
              f"max error {verify.worst:.3g}, {'all ok' if not bad else f'{len(bad)} MISMATCHES'}")
        final = [r for r in verify.rows if r["pass"] == verify.rows[-1]["pass"]] if verify.rows else []
        print(text_table(final + [r for r in bad if r not in final], ["pass", "size", "ran", "max_error", "ok"]))
        status = 1 if bad else 0
    files = sorted(p for p in out.rglob("*") if p.is_file())
    stages = sorted(p.name for p in out.iterdir() if p.is_dir())
    print(f"\ndump: {out}/ ({len(stages)} stages, {len(files)} files): {', '.join(stages)}")
    print("  each split stage: program.txt, graph.py, stitch.py, piece_*.py, split.png"
          + (", split.dot, split.svg" if any(p.suffix == ".svg" for p in files) else
             " (no graphviz on PATH: no .dot/.svg)"))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
