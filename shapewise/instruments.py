"""Instruments that look inside a pipeline run: ``Dump`` (each stage to a folder) and
``Verify`` (each stage's program against eager at each size). ``PrintAfter`` and ``Timing``
live in ``passes.base`` and are re-exported here.

>>> verify, dump = Verify(int_range=(0, 64)), Dump("shapewise-dump")
>>> Pipeline([Split(ops=["sdpa"]), Concretize(sizes=[1, 8]), Lower()], instruments=[dump, verify]).run(gm)
>>> print(verify)          # pass, size, ran, max_error, ok: one row per (stage, size)
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx

from shapewise._compat import compiled_source, storage_length
from shapewise.concretize import make_bindings
from shapewise.concretize.analyze import analyze_graph
from shapewise.dispatch.runnable import Runnable
from shapewise.errors import ShapewiseError
from shapewise.graph_split.draw import draw_split, split_dot
from shapewise.ir.printer import format_graph, format_program
from shapewise.ir.program import Binding, Program, ShapeInfo, TensorMeta, Variant
from shapewise.ir.report import Report
from shapewise.ir.runner import make_runner
from shapewise.ir.symbolic import evaluate
from shapewise.passes.base import Instrument, Pass, PrintAfter, Timing

__all__ = [
    "TOLERANCES",
    "Dump",
    "PrintAfter",
    "Timing",
    "Verify",
    "max_error",
    "random_inputs",
    "variant_source",
]

# (rtol, atol) by dtype: how far a compiled variant may drift from eager and still be "ok".
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def variant_source(variant: Variant) -> str | None:
    """The code a backend generated for a compiled variant (Inductor's wrapper), else None."""
    if variant.compiled is None:
        return None

    return compiled_source(variant.compiled)


def _file_part(text: str) -> str:
    """``{n=4, m=1..8}`` → ``n=4,m=1..8``: a binding as a file-name part."""
    return re.sub(r"[^A-Za-z0-9=.,_-]", "_", text.strip("{}").replace(", ", ","))


@dataclass
class Dump(Instrument):
    """Write each stage of a pipeline run to ``folder``.

    ``folder/00_input/`` holds the graph handed to the pipeline; then one sub-folder per
    pass, ``NN_<pass name>/``, with ``program.txt`` (the canonical printer), ``graph.py``
    (the whole graph), and once split ``stitch.py``, ``piece_i.py`` per piece and the split
    as ``split.png`` (always) and ``split.dot`` + ``split.svg`` (only where graphviz's
    ``dot`` is on PATH). Compiled variants whose backend left code (Inductor) add
    ``piece_i.<binding>.py``. ``folder/pipeline.txt`` lists the stages. No timings are
    written, so the same run gives the same files. A new ``Dump`` first removes the stage
    folders of an earlier dump there (nothing else); one reused for a second run keeps
    numbering after the first.
    """

    folder: str | Path = "shapewise-dump"
    graphviz: str | None = "dot"
    count: int = field(default=0, init=False)

    def _stage_dir(self, name: str) -> Path:
        path = Path(self.folder) / f"{self.count:02d}_{name}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _log(self, line: str) -> None:
        with open(Path(self.folder) / "pipeline.txt", "a") as f:
            f.write(line + "\n")

    def _clear(self) -> None:
        """Remove the stages of an earlier dump into the same folder (only what Dump writes)."""
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        for sub in folder.iterdir():
            if sub.is_dir() and re.fullmatch(r"\d\d_\w+", sub.name) and (sub / "program.txt").exists():
                shutil.rmtree(sub)
        (folder / "pipeline.txt").write_text("")

    def before_pass(self, p: Pass, program: Program) -> None:
        if self.count == 0:
            self._clear()
            self.write(program, self._stage_dir("input"))
            self._log("00 input")
            self.count = 1

    def after_pass(self, p: Pass, program: Program, seconds: float) -> None:
        self.write(program, self._stage_dir(p.name))
        self._log(f"{self.count:02d} {p.spec()}")
        self.count += 1

    def write(self, program: Program, path: Path) -> list[Path]:
        """Write one program's files into ``path``; returns the files written."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        files = {"program.txt": format_program(program) + "\n", "graph.py": format_graph(program.gm) + "\n"}
        if program.graph is not None:
            files["stitch.py"] = format_graph(program.graph) + "\n"
            names = program.shapes.names if program.shapes else {}
            for piece in program.pieces:
                kind = "splitting op, runs as is" if piece.is_splitting else "compute piece"
                files[f"{piece.name}.py"] = f"# {piece.name}: {kind}\n{format_graph(piece.gm)}\n"
                for v in piece.variants:
                    if v.gm is not None:  # rewritten by graph passes: the variant's own graph
                        files[f"{piece.name}.{_file_part(v.binding.describe(names))}.rewritten.py"] = \
                            f"# {piece.name} at {v.binding.describe(names)} after {', '.join(v.passes)}\n" \
                            f"{format_graph(v.gm)}\n"
                    src = variant_source(v)
                    if src:
                        files[f"{piece.name}.{_file_part(v.binding.describe(names))}.py"] = src
        written = []
        for name, text in files.items():
            (path / name).write_text(text)
            written.append(path / name)
        if program.graph is not None:
            written += self._write_split(program, path)
        return written

    def _write_split(self, program: Program, path: Path) -> list[Path]:
        draw_split(program, path / "split.png")
        written = [path / "split.png"]
        dot = shutil.which(self.graphviz) if self.graphviz else None
        if dot is not None:
            (path / "split.dot").write_text(split_dot(program))
            subprocess.run([dot, "-Tsvg", str(path / "split.dot"), "-o", str(path / "split.svg")], check=True,
                           capture_output=True, timeout=60)
            written += [path / "split.dot", path / "split.svg"]
        return written


# -- verify ------------------------------------------------------------------------------------

def random_inputs(shapes: ShapeInfo, values: Mapping[sympy.Symbol, int], *, seed: int = 0,
                  int_range: tuple[int, int] = (0, 2)) -> tuple[Any, ...]:
    """Inputs for a graph's placeholders with every symbol set to ``values``.

    Each tensor gets the shape, stride and storage offset of its ``TensorMeta`` evaluated
    at ``values``; floats are standard normal, ints uniform in ``int_range`` (low inclusive,
    high exclusive: keep indices valid), bools random. SymInt inputs are their value. The
    same ``seed`` and values give the same tensors; the global RNG is not touched.
    """
    gen = torch.Generator().manual_seed(seed)
    out: list[Any] = []
    for meta in shapes.inputs:
        if isinstance(meta, TensorMeta):
            shape, stride, offset = meta.at(values)
            n = storage_length(shape, stride, offset)
            if meta.dtype.is_floating_point or meta.dtype.is_complex:
                flat = torch.randn(n, generator=gen, dtype=meta.dtype)
            elif meta.dtype == torch.bool:
                flat = torch.randint(0, 2, (n,), generator=gen).bool()
            else:
                flat = torch.randint(int_range[0], int_range[1], (n,), generator=gen).to(meta.dtype)
            out.append(flat.to(meta.device).as_strided(shape, stride, offset))
        elif isinstance(meta, sympy.Basic):
            out.append(evaluate(meta, values))
        else:
            out.append(meta)
    return tuple(out)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, Mapping):
        return [x for k in value for x in _leaves(value[k])]
    return [value]


def max_error(actual: Any, expected: Any) -> tuple[float, float]:
    """(largest absolute difference, largest absolute expected value) over nested outputs.
    A structure, shape or dtype mismatch, or a NaN where eager has none, is an infinite error."""
    a_leaves, e_leaves = _leaves(actual), _leaves(expected)
    if len(a_leaves) != len(e_leaves):
        return math.inf, 0.0
    err, scale = 0.0, 0.0
    for a, e in zip(a_leaves, e_leaves):
        if not isinstance(e, torch.Tensor):
            err = max(err, 0.0 if a == e else math.inf)
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
            return math.inf, 0.0
        if e.numel() == 0:
            continue
        a64, e64 = a.detach().double(), e.detach().double()
        diff = (a64 - e64).abs()
        diff = torch.where(a64.isnan() & e64.isnan(), torch.zeros_like(diff), diff)
        d = diff.max().item()
        err = max(err, math.inf if math.isnan(d) else d)
        finite = e64[e64.isfinite()]
        scale = max(scale, finite.abs().max().item() if finite.numel() else 0.0)
    return err, scale


def _sample_values(binding: Binding, hints: Mapping[sympy.Symbol, int], cap: int) -> list[dict[sympy.Symbol, int]]:
    """Concrete values to test a binding at: itself if static; a range's low and high corners
    (a high beyond ``cap`` falls back to the traced value, clamped into the range)."""
    lo_corner, hi_corner = {}, {}
    for s, v in binding.items:
        if isinstance(v, int):
            lo_corner[s] = hi_corner[s] = v
        else:
            lo, hi = v
            lo_corner[s] = lo
            hi_corner[s] = hi if hi <= cap else min(max(hints.get(s, lo), lo), hi)
    return [lo_corner] if lo_corner == hi_corner else [lo_corner, hi_corner]


def _binding_for(program: Program, values: Mapping[sympy.Symbol, int]) -> Binding | None:
    """The binding of ``program`` whose variants serve ``values``: exact first, then a range."""
    bindings = program.bindings or ()
    for b in bindings:
        if b.is_static and all(values.get(s) == v for s, v in b.items):
            return b
    for b in bindings:
        if not b.is_static and all(lo <= values.get(s, lo - 1) <= hi for (s, _), (lo, hi) in zip(b.items, b.bounds())):
            return b
    return None


@dataclass
class Verify(Instrument):
    """Run each stage's program against eager on random inputs at each size; record the error.

    After every pass whose output is split, the program runs at each size: through its
    dispatch table once built, else its compiled variants, else its pieces as they are, and
    its result is compared with the eager run of the graph the pipeline was given.
    ``sizes``: like ``Concretize`` sizes (``[1, 8]``, ``{"batch": [1, 2]}``); by default the
    program's own bindings (a range at its two ends) or, before there are any, the traced
    sizes. ``inputs_fn(shapes, values) -> args`` makes the inputs (default ``random_inputs``
    with ``seed`` and ``int_range``). ``passes`` limits the check to the named passes;
    ``strict`` raises at the first size beyond tolerance. Rows: pass, size, ran, max_error, ok.
    """

    sizes: Any = None
    inputs_fn: Callable[[ShapeInfo, Mapping[sympy.Symbol, int]], Sequence[Any]] | None = None
    passes: Sequence[str] = ()
    seed: int = 0
    int_range: tuple[int, int] = (0, 2)
    strict: bool = False
    range_cap: int = 4096
    out: Callable[[str], None] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    _reference: torch.fx.GraphModule | None = field(default=None, init=False, repr=False)
    _ref_shapes: ShapeInfo | None = field(default=None, init=False, repr=False)
    _runnable: Runnable | None = field(default=None, init=False, repr=False)  # the checked program's, per pass

    def before_pass(self, p: Pass, program: Program) -> None:
        if program.graph is None:  # an unsplit program: the start of a run, and the eager reference
            self._reference, self._ref_shapes = program.gm, program.shapes

    def after_pass(self, p: Pass, program: Program, seconds: float) -> None:
        if program.graph is None or (self.passes and p.name not in self.passes):
            return

        reference = self._reference if self._reference is not None else program.gm
        shapes = program.shapes or self._ref_shapes or analyze_graph(reference, program.symbol_names)
        self._runnable = None  # one Runnable per checked program: its lazy compiles serve every size checked
        try:
            for values in self._values(program, shapes):
                self._check_and_report(p, program, reference, shapes, values)
        finally:
            if self._runnable is not None and self._runnable.runtime.background is not None:
                self._runnable.runtime.background.stop()  # checked: the pipeline's own Runnable compiles
            self._runnable = None

    def _check_and_report(self, p: Pass, program: Program, reference: torch.fx.GraphModule, shapes: ShapeInfo,
                          values: Mapping[sympy.Symbol, int]) -> None:
        row = self.check(p.spec(), program, reference, shapes, values)
        self.rows.append(row)
        if self.out is not None:
            self.out(self._format_row(row))
        if self.strict and not row["ok"]:
            raise ShapewiseError(f"verify: after {row['pass']} at size {row['size']}, the program differs "
                                 f"from eager by {row['max_error']:.3g}"
                                 + (f" ({row['error']})" if row.get("error") else ""))

    def _values(self, program: Program, shapes: ShapeInfo) -> list[dict[sympy.Symbol, int]]:
        if self.sizes is not None:
            bindings = make_bindings(shapes, self.sizes)
        elif program.bindings:
            bindings = program.bindings
        else:
            bindings = (Binding(tuple((s, shapes.hints[s]) for s in shapes.symbols if s in shapes.hints)),)
        out: list[dict[sympy.Symbol, int]] = []
        for b in bindings:
            for values in _sample_values(b, shapes.hints, self.range_cap):
                if values not in out:
                    out.append(values)
        return out

    def _callable(self, program: Program, values: Mapping[sympy.Symbol, int]) -> tuple[str, Callable[..., Any]]:
        for p in program.compute_pieces:  # a variant a compile worker has not delivered yet would run eagerly
            for v in p.variants:  # (wait_for_workers="never"): the check is of the compiled code, so load it
                if getattr(v.compiled, "stand_in", None) is not None and not v.compiled.ready:
                    v.compiled.resolve()
        if program.dispatch is not None:
            if self._runnable is None or self._runnable.program is not program:
                self._runnable = Runnable(program)
            return "dispatch", self._runnable
        binding = _binding_for(program, values)
        used = binding is not None and any(
            (v := p.variant_for(binding)) is not None and v.compiled is not None for p in program.compute_pieces)
        return ("variants" if used else "pieces"), make_runner(program.graph, program.callables(binding))

    def check(self, spec: str, program: Program, reference: torch.fx.GraphModule, shapes: ShapeInfo,
              values: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Run ``program`` and ``reference`` at ``values``; one row of the report."""
        seed = self.seed + zlib.crc32(repr(sorted((str(s), v) for s, v in values.items())).encode())
        if self.inputs_fn is not None:
            args = tuple(self.inputs_fn(shapes, values))
        else:
            args = random_inputs(shapes, values, seed=seed, int_range=self.int_range)
        size = Binding(tuple((s, values[s]) for s in shapes.symbols if s in values)).describe(shapes.names)
        row: dict[str, Any] = {"pass": spec, "size": size, "ran": "", "max_error": math.inf, "ok": False}
        with torch.no_grad():
            expected = reference(*args)
            try:
                row["ran"], fn = self._callable(program, values)
                actual = fn(*args)
            except Exception as e:  # noqa: BLE001 - a failure is what this instrument reports
                row["error"] = f"{type(e).__name__}: {e}"
                return row
        err, scale = max_error(actual, expected)
        dtypes = [t.dtype for t in _leaves(expected) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        rtol, atol = max((TOLERANCES.get(d, (1e-4, 1e-4)) for d in dtypes), default=(0.0, 0.0))
        row["max_error"] = err
        row["ok"] = err <= atol + rtol * scale
        return row

    @property
    def worst(self) -> float:
        """The largest error seen so far (0.0 before any check)."""
        return max((r["max_error"] for r in self.rows), default=0.0)

    @staticmethod
    def _format_row(row: Mapping[str, Any]) -> str:
        status = "ok" if row["ok"] else "MISMATCH"
        tail = f" ({row['error']})" if row.get("error") else ""
        return f"verify {row['pass']} at {row['size']} [{row['ran']}]: max error {row['max_error']:.3g} {status}{tail}"

    def report(self):
        """The rows as a ``Report`` (a list of dicts that prints as a table)."""
        return Report(self.rows, columns=("pass", "size", "ran", "max_error", "ok"))

    def __str__(self) -> str:
        return str(self.report())

    def _repr_html_(self) -> str:
        return self.report()._repr_html_()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))
