"""Pass, Pipeline and instruments: the one pass contract of shapewise."""

from __future__ import annotations

import ast
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.fx

from shapewise.errors import ShapewiseError
from shapewise.ir.printer import format_program
from shapewise.ir.program import Program

__all__ = [
    "Instrument",
    "Pass",
    "PassRecord",
    "Pipeline",
    "PrintAfter",
    "Timing",
    "parse_spec",
    "register_pass",
    "register_runnable",
]

_REGISTRY: dict[str, type[Pass]] = {}
_RUNNABLE: Callable[[Program, tuple[PassRecord, ...]], Any] | None = None


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass parseable from its spec string."""
    _REGISTRY[cls.name] = cls
    return cls


def register_runnable(factory: Callable[[Program, tuple[PassRecord, ...]], Any]) -> Callable[..., Any]:
    """Set what ``Pipeline.run`` returns: ``factory(final program, stage records)`` (the dispatch
    stage registers ``Runnable``; the framework does not import the stages above it)."""
    global _RUNNABLE
    _RUNNABLE = factory
    return factory


def _format_value(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, str)) for x in v) and not any(
        isinstance(x, str) and ("," in x or " " in x) for x in v
    ):
        return ",".join(str(x) for x in v)
    if callable(v):
        return getattr(v, "__name__", type(v).__name__)
    return repr(v).replace(" ", "")


def _parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    if "," in text:
        return tuple(_parse_value(part) for part in text.split(","))
    return text


def _split_fields(body: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in body:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == " " and depth == 0:
            if cur:
                out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return out


def parse_spec(spec: str) -> Pass:
    """Parse ``"concretize{sizes=1,8}"`` back into ``Concretize(sizes=(1, 8))``."""
    spec = spec.strip()
    name, _, rest = spec.partition("{")
    if name not in _REGISTRY:
        raise ShapewiseError(
            f"unknown pass {name!r} in spec {spec!r}; registered passes: {sorted(_REGISTRY)}"
        )
    kwargs = {}
    body = rest[:-1] if rest.endswith("}") else rest
    for item in _split_fields(body):
        key, eq, value = item.partition("=")
        if not eq:
            raise ShapewiseError(f"pass spec field {item!r} in {spec!r} is not key=value")
        kwargs[key] = _parse_value(value)
    return _REGISTRY[name](**kwargs)


@dataclass(frozen=True)
class Pass:
    """A program transformation: a frozen dataclass whose fields are its options.

    Subclasses set ``name`` and implement ``apply(program) -> program``; they never mutate
    their input. ``requires(program)`` lists passes that must run first when the program
    lacks what this pass needs (run on demand by ``Pipeline``), by spec (``"concretize"``,
    looked up in the registry: a stage never imports the stages it depends on) or as objects.
    """

    name: ClassVar[str] = "pass"

    def apply(self, program: Program) -> Program:
        raise NotImplementedError

    def requires(self, program: Program) -> Sequence[Pass | str]:
        return ()

    def __call__(self, program: Program | torch.fx.GraphModule) -> Program:
        """Run this pass (and, first, whatever it needs that the program lacks)."""
        if isinstance(program, torch.fx.GraphModule):
            program = Program(gm=program)
        return Pipeline([self]).apply(program)

    def spec(self) -> str:
        fields = []
        for f in dataclasses.fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING
            )
            if value == default:
                continue
            fields.append(f"{f.name}={_format_value(value)}")
        return f"{self.name}{{{' '.join(fields)}}}" if fields else self.name

    def __str__(self) -> str:
        return self.spec()


class Instrument:
    """Observer handed to a Pipeline: sees each pass before and after it runs."""

    def before_pass(self, p: Pass, program: Program) -> None:  # noqa: B027 - optional hook
        pass

    def after_pass(self, p: Pass, program: Program, seconds: float) -> None:  # noqa: B027
        pass


@dataclass
class PrintAfter(Instrument):
    """Print the program after each pass (or after the named ones) with the canonical printer."""

    passes: Sequence[str] = ()
    out: Callable[[str], None] = print

    def after_pass(self, p: Pass, program: Program, seconds: float) -> None:
        if not self.passes or p.name in self.passes:
            self.out(f"// ----- after {p.spec()} ({seconds * 1e3:.1f} ms)\n{format_program(program)}")


@dataclass
class Timing(Instrument):
    """Collect (spec, seconds) for every pass run."""

    rows: list[tuple[str, float]] = field(default_factory=list)

    def after_pass(self, p: Pass, program: Program, seconds: float) -> None:
        self.rows.append((p.spec(), seconds))

    def __str__(self) -> str:
        width = max((len(s) for s, _ in self.rows), default=4)
        return "\n".join(f"{s:<{width}}  {t * 1e3:9.1f} ms" for s, t in self.rows)


@dataclass(frozen=True)
class PassRecord:
    """One stage of a pipeline run: the pass, its output program, and its wall time."""

    spec: str
    program: Program
    seconds: float
    on_demand: bool = False


@register_pass
@dataclass(frozen=True)
class Pipeline(Pass):
    """Run passes in order; itself a pass, so pipelines nest.

    ``Pipeline([Split(), Concretize(sizes=[1, 8]), Lower()]).run(gm)`` returns a runnable;
    stages that are needed but not listed (shape analysis, dispatch) run on demand.
    """

    name: ClassVar[str] = "pipeline"
    passes: tuple[Pass, ...] = ()
    instruments: tuple[Instrument, ...] = field(default=(), compare=False, repr=False)

    def __init__(self, passes: Iterable[Pass | str] = (), instruments: Iterable[Instrument] = ()):
        resolved = tuple(parse_spec(p) if isinstance(p, str) else p for p in passes)
        for p in resolved:
            if not isinstance(p, Pass):
                raise ShapewiseError(f"Pipeline takes Pass objects or spec strings, got {p!r}")
        object.__setattr__(self, "passes", resolved)
        object.__setattr__(self, "instruments", tuple(instruments))

    def spec(self) -> str:
        return "pipeline{" + ",".join(p.spec() for p in self.passes) + "}"

    def apply(self, program: Program) -> Program:
        return self.trace(program)[-1].program if self.passes else program

    def trace(self, program: Program, records: list[PassRecord] | None = None) -> list[PassRecord]:
        """Run every pass (and what it needs), returning one record per stage."""
        records = [] if records is None else records
        for p in self.passes:
            program = self._run_one(p, program, records, on_demand=False)
        return records

    def _run_one(self, p: Pass, program: Program, records: list[PassRecord], on_demand: bool) -> Program:
        for dep in p.requires(program):
            dep = parse_spec(dep) if isinstance(dep, str) else dep
            program = self._run_one(dep, program, records, on_demand=True)
        if isinstance(p, Pipeline):
            sub = Pipeline(p.passes, (*self.instruments, *p.instruments))
            sub.trace(program, records)
            return records[-1].program if records else program
        for inst in self.instruments:
            inst.before_pass(p, program)
        t0 = time.perf_counter()
        try:
            out = p.apply(program)
        except Exception as e:
            before = [r.spec for r in records]
            e.add_note(
                f"shapewise: raised in pass {p.spec()}"
                + (f" (after {', '.join(before)})" if before else " (the first pass)")
            )
            raise
        seconds = time.perf_counter() - t0
        if not isinstance(out, Program):
            raise ShapewiseError(f"pass {p.spec()} returned {type(out).__name__}, expected a Program")
        records.append(PassRecord(p.spec(), out, seconds, on_demand))
        for inst in self.instruments:
            inst.after_pass(p, out, seconds)
        return out

    def run(self, gm: torch.fx.GraphModule | Program):
        """Run the pipeline on a graph and return a callable ``Runnable`` (made by the factory
        the dispatch stage registers, see ``register_runnable``), running ``build_dispatch``
        first when no pass built the table."""
        if _RUNNABLE is None:
            raise ShapewiseError("no runnable factory is registered: import shapewise (its dispatch stage "
                                 "registers one) before Pipeline.run")
        program = gm if isinstance(gm, Program) else Program(gm=gm)
        records: list[PassRecord] = []
        self.trace(program, records)
        if not records or records[-1].program.dispatch is None:
            last = records[-1].program if records else program
            Pipeline(["build_dispatch"], self.instruments).trace(last, records)
        return _RUNNABLE(records[-1].program, tuple(records))
