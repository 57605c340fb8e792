"""Lower: compile every variant of every compute piece with a backend."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx

from shapewise import _compat
from shapewise.errors import CompileError, ConfigError
from shapewise.passes.base import Pass, register_pass
from shapewise.passes.program import Binding, Piece, Program, Variant

__all__ = ["BACKENDS", "Lower", "lower_variant"]

log = logging.getLogger("shapewise")

BACKENDS = ("inductor", "eager", "aot_eager")


def _copy_gm(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    # Compilers take ownership of (mutate) the graph they get; the piece keeps its own.
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)


def _fake_mode_of(args: list[Any]):
    for a in args:
        mode = getattr(a, "fake_mode", None)
        if mode is not None:
            return mode
        if isinstance(a, torch.SymInt):
            return _compat.FakeTensorMode(shape_env=a.node.shape_env)
    return None


def _is_symbolic(args: list[Any]) -> bool:
    for a in args:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*a.shape, *a.stride())):
            return True
    return False


def lower_variant(piece: Piece, variant: Variant, backend: Any, options: Mapping[str, Any]) -> Callable[..., Any]:
    """Compile one (piece, variant) and return a callable taking the piece's inputs positionally.

    Static variants compile from concrete fake inputs in no tracing context; range variants in
    the context of their own fresh ShapeEnv (see ``concretize.example_args``).
    """
    args = list(variant.example_args)
    if backend == "eager":
        return piece.gm.forward
    # Symbolic args: a range variant, or a piece whose inputs have data-dependent sizes.
    mode = _fake_mode_of(args) if _is_symbolic(args) else None
    static = mode is None
    oblivious = _compat.no_zero_one_specialisation() if mode is not None else contextlib.nullcontext()
    with _compat.fresh_tracing_context(mode), oblivious:
        if backend == "inductor":
            fn = _compat.standalone_compile(_copy_gm(piece.gm), args, static=static, options=options)
        elif backend == "aot_eager":
            fn = _compat.aot_eager(_copy_gm(piece.gm), args)
        else:
            fn = backend(_copy_gm(piece.gm), args)
    if mode is not None:
        bad = _compat.range_guard_violations(mode)
        if bad:
            raise CompileError(
                f"the compile of {piece.name} for range {variant.binding} assumed something that does not "
                f"hold over the whole range: {'; '.join(bad)}; split the range or compile those sizes statically"
            )
    return fn


@register_pass
@dataclass(frozen=True)
class Lower(Pass):
    """Compile each variant: ``backend`` is "inductor", "eager", "aot_eager" or a
    ``callable(gm, example_inputs) -> callable``.

    ``options`` go to every Inductor compile; ``static_options`` only to single-size variants
    (e.g. ``{"max_autotune": True}``) and ``range_options`` only to range variants.
    ``on_compile_error="fallback"`` runs a variant that fails to compile eagerly instead.
    """

    name: ClassVar[str] = "lower"
    backend: Any = "inductor"
    options: Any = ()
    static_options: Any = ()
    range_options: Any = ()
    on_compile_error: str = "raise"

    def __post_init__(self) -> None:
        if not callable(self.backend) and self.backend not in BACKENDS:
            raise ConfigError(
                f"unknown backend {self.backend!r}: use one of {BACKENDS} or a callable(gm, example_inputs)")
        if self.on_compile_error not in ("raise", "fallback"):
            raise ConfigError(f"on_compile_error must be 'raise' or 'fallback', got {self.on_compile_error!r}")
        for f in ("options", "static_options", "range_options"):
            v = getattr(self, f)
            object.__setattr__(self, f, tuple(sorted(dict(v).items())) if v else ())

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "callable")

    def options_for(self, binding: Binding) -> dict[str, Any]:
        extra = self.static_options if binding.is_static else self.range_options
        return {**dict(self.options), **dict(extra)}

    def requires(self, program: Program) -> Sequence[Pass]:
        from shapewise.concretize.concretize import Concretize, _need_split_and_shapes

        needs = _need_split_and_shapes(program)
        if program.bindings is None:
            needs.append(Concretize())
        return needs

    def compile_variant(self, piece: Piece, variant: Variant) -> Variant:
        t0 = time.perf_counter()
        source = "compiled"
        error = None
        try:
            fn = lower_variant(piece, variant, self.backend, self.options_for(variant.binding))
        except Exception as e:  # noqa: BLE001 - reported with context below
            names = piece.shapes.names if piece.shapes else {}
            msg = (f"compiling {piece.name} for {variant.binding.describe(names)} with backend "
                   f"{self.backend_name!r} failed: {type(e).__name__}: {e}")
            if self.on_compile_error != "fallback":
                raise CompileError(msg) from e
            log.warning("shapewise: %s; running this variant eagerly instead", msg)
            fn, source, error = piece.gm.forward, "fallback", f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
        report = {
            "piece": piece.name,
            "key": variant.binding.describe(piece.shapes.names if piece.shapes else {}),
            "static": variant.binding.is_static,
            "seconds": seconds,
            "source": source,
            "backend": self.backend_name,
        }
        if error:
            report["error"] = error
        return dataclasses.replace(variant, compiled=fn, report=report)

    def apply(self, program: Program) -> Program:
        pieces = []
        for p in program.pieces:
            if p.is_splitting:
                pieces.append(p)
                continue
            pieces.append(dataclasses.replace(p, variants=tuple(self.compile_variant(p, v) for v in p.variants)))
        return program.replace(pieces=tuple(pieces), lowering=self)
