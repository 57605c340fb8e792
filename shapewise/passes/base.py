"""Pass, Pipeline and instruments: the one pass contract of shapewise.

In: a ``Program`` (or a ``GraphModule``, wrapped in one). Out: a new ``Program`` per pass, never
the input changed; ``Pipeline.trace`` gives one ``PassRecord`` (spec, output, seconds) per stage,
stages a pass ``requires`` included, and ``Pipeline.run`` the callable that the dispatch stage
makes of the last one. A pass prints as a spec (``concretize{sizes=1,8}``) that ``parse_spec``
reads back through the registry (``register_pass``); its ``uuid`` is what content keys record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import time
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.fx

from shapewise.errors import ConfigError, ShapewiseError
from shapewise.ir.printer import format_program
from shapewise.ir.program import Program
from shapewise.passes.spec import format_fields, parse_value, split_top

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
    "registered_passes",
    "source_hash",
]

_REGISTRY: dict[str, type[Pass]] = {}
_RUNNABLE: Callable[[Program, tuple[PassRecord, ...]], Any] | None = None
_SOURCE_HASHES: dict[type, str] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass parseable from its spec string. A name that another class
    (another module or qualified name) holds already is refused."""
    held = _REGISTRY.get(cls.name)
    if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ConfigError(f"pass name {cls.name!r} of {cls.__module__}.{cls.__qualname__} is taken by "
                          f"{held.__module__}.{held.__qualname__}; give the pass another name")
    _REGISTRY[cls.name] = cls
    return cls


def registered_passes() -> dict[str, type[Pass]]:
    """``{spec name: pass class}`` of every registered pass (a copy), in registration order."""
    return dict(_REGISTRY)


def register_runnable(factory: Callable[[Program, tuple[PassRecord, ...]], Any]) -> Callable[..., Any]:
    """Set what ``Pipeline.run`` returns: ``factory(final program, stage records)`` (the dispatch
    stage registers ``Runnable``; the framework does not import the stages above it)."""
    global _RUNNABLE
    _RUNNABLE = factory
    return factory


def _is_pass_type(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Pass)


def parse_spec(spec: str) -> Pass:
    """Parse ``"concretize{sizes=1,8}"`` back into ``Concretize(sizes=(1, 8))``: the registered
    class of that name, its fields read by their types (``Pass.from_spec``)."""
    spec = spec.strip()
    name, brace, rest = spec.partition("{")
    if name not in _REGISTRY:
        raise ShapewiseError(
            f"unknown pass {name!r} in spec {spec!r}; registered passes: {sorted(_REGISTRY)}"
        )
    if brace and not rest.endswith("}"):
        raise ConfigError(f"pass spec {spec!r} does not end with '}}'")
    return _REGISTRY[name].from_spec(rest[:-1] if brace else "")


def _source(cls: type) -> str:
    """The class's source text; for a class whose file is gone (``python -c``, some notebooks),
    its methods' bytecode, names and constants (deterministic, unlike ``marshal``)."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        parts: list[str] = [cls.__qualname__]

        def code_text(code: types.CodeType) -> None:
            parts.extend([code.co_code.hex(), repr(code.co_names), repr(code.co_varnames)])
            for c in code.co_consts:
                code_text(c) if isinstance(c, types.CodeType) else parts.append(repr(c))

        for key, value in sorted(vars(cls).items()):
            fn = getattr(value, "__func__", value)
            if isinstance(fn, types.FunctionType):
                parts.append(key)
                code_text(fn.__code__)
            elif not key.startswith("__"):
                parts.append(f"{key}={value!r}")
        return "\n".join(parts)


def source_hash(cls: type) -> str:
    """A hash of a pass class's source and of its bases' up to the framework's own (``Pass``,
    ``GraphPass``, ...; as vLLM's ``InductorPass.hash_source``): a changed rewrite changes the
    pass's ``uuid`` and so every content key that records it."""
    if cls not in _SOURCE_HASHES:
        h = hashlib.sha256()
        for c in cls.__mro__:
            if isinstance(c, type) and issubclass(c, Pass) and not c.__module__.startswith("shapewise.passes."):
                h.update(_source(c).encode())
        _SOURCE_HASHES[cls] = h.hexdigest()[:16]
    return _SOURCE_HASHES[cls]


@dataclass(frozen=True)
class Pass:
    """A program transformation: a frozen dataclass whose fields are its options.

    Subclasses set ``name`` and implement ``apply(program) -> program``; they never mutate
    their input. ``requires(program)`` lists passes that must run first when the program
    lacks what this pass needs (run on demand by ``Pipeline``), by spec (``"concretize"``,
    looked up in the registry: a stage never imports the stages it depends on) or as objects.
    ``spec()`` prints the pass as text that ``parse_spec`` reads back; ``uuid()`` is what content
    keys record of it (``version``: a salt, bump it to tell runs apart where the source did not
    change). The graph-level passes (``GraphPass``, ``InductorPass``) are passes too.
    """

    name: ClassVar[str] = "pass"
    version: ClassVar[int] = 1

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
        """``name{field=value ...}``, the fields that differ from their defaults."""
        fields = format_fields(self)
        return f"{self.name}{{{' '.join(fields)}}}" if fields else self.name

    @classmethod
    def from_spec(cls, body: str) -> Pass:
        """The pass whose spec's ``{...}`` is ``body`` (``"sizes=1,8"``), each field read by its type."""
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an annotation that does not resolve reads untyped
            hints = {}
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        kwargs = {}
        for item in split_top(body, " "):
            key, eq, text = item.partition("=")
            if not eq:
                raise ConfigError(f"pass spec field {item!r} in {cls.name}{{{body}}} is not key=value")
            if key not in fields:
                raise ConfigError(f"pass {cls.name} has no option {key!r}; its options: {sorted(fields)}")
            try:
                kwargs[key] = parse_value(text, hints.get(key, Any), parse_spec, _is_pass_type)
            except ConfigError as e:
                raise ConfigError(f"pass spec {cls.name}{{{body}}}: {key}: {e}") from e
        return cls(**kwargs)

    def uuid(self) -> str:
        """What content keys record of this pass: its class, every field, ``version`` and a hash of
        its source (``source_hash``): ``module.Class:name{fields}@version#hash``."""
        fields = format_fields(self, every_field=True)
        text = f"{self.name}{{{' '.join(fields)}}}" if fields else self.name
        return f"{type(self).__module__}.{type(self).__qualname__}:{text}@{self.version}#{source_hash(type(self))}"

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
        """``pipeline{split,concretize{sizes=1,8}}``: its passes' specs, comma-separated."""
        return "pipeline{" + ",".join(p.spec() for p in self.passes) + "}"

    @classmethod
    def from_spec(cls, body: str) -> Pipeline:
        return cls([parse_spec(part) for part in split_top(body, ",") if part.strip()])

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
