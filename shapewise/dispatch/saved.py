"""A compiled program saved whole, and loaded without tracing, splitting, analysing or keying
its pieces again: shapewise's half of the whole-program artifact (Dynamo's half, its trace and
guards, is torch's ``aot_compile``: ``shapewise.warm``).

In: a ``Runnable``. ``program_bytes`` saves its final Program (the whole graph, the stitching
graph, every piece's graph, the shape facts, the bindings, each variant's
rewritten graph and passes, the dispatch and CUDA-graph plans, the lowering's options), with
per variant its example inputs' layouts and its artifact's content key, through torch's
``GraphPickler``, each graph with its facts (``ir.effects``) and the fake values of its inputs and
outputs only (the ones between were half of a warm start: a compile that needs them makes them
again from the inputs'). Compiled callables are not in it: ``load_program`` lowers the loaded Program
again in a compile session that already knows every key, so each variant comes from the
artifact cache (a variant not there is compiled, as on a cold start) and the Runnable builds its
run-time state (table, guards, CUDA graphs) from the plans as it always does.

What cannot be saved says why (``NotSaved``): a tensor-subclass input (a DTensor's mesh), a
backend or option that does not pickle. What is loaded is checked by ``shapewise.warm``'s key
(torch and shapewise builds, the options, the model); this module trusts its input.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pickle
from typing import Any

from shapewise import _compat
from shapewise.concretize.examples import example_args_from_layouts, example_layouts
from shapewise.errors import ShapewiseError
from shapewise.ir.effects import values_left_out
from shapewise.ir.program import Program

__all__ = ["FORMAT", "NotSaved", "load_program", "program_bytes", "program_from_bytes"]

log = logging.getLogger("shapewise")

FORMAT = "shapewise-program/1"


class NotSaved(ShapewiseError):
    """This program cannot be saved whole (the message says why); it runs as it is."""


def _modules(program: Program) -> list[str]:
    """The modules to import before the graphs load: those of the graph passes applied (their
    custom ops, ``shapewise::linear_group``, are looked up by name), of a callable backend."""
    mods = {type(p).__module__ for r in program.rewrites
            for p in (*getattr(r, "passes", ()), *getattr(r, "inductor_passes", ()))}
    for piece in program.pieces:
        for v in piece.variants:
            mods.update(type(p).__module__ for p in v.inductor_passes)
    backend = getattr(program.lowering, "backend", None)
    if callable(backend):
        mods.add(getattr(backend, "__module__", None) or "")
    return sorted(m for m in mods if m and m != "__main__")


def _graphs(program: Program) -> list[Any]:
    """Every GraphModule of ``program``: the whole graph, the stitching graph, the pieces', the variants' own."""
    gms = (program.gm, program.graph, *(g for p in program.pieces for g in (p.gm, *(v.gm for v in p.variants))))
    return [g for g in gms if g is not None]


def _placeholders(gm: Any) -> list[Any]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"] if gm is not None else []


def _sources(gm: Any) -> list[Any]:
    """Per input of the trace's graph, Dynamo's ``Source`` of it (``L['self'].lm_head.weight``) where
    it pickles, else None: a warm start builds its direct calls from them (``shapewise.warm``)."""
    out = []
    for node in _placeholders(gm):
        source = _compat.placeholder_source(node)
        try:
            pickle.dumps(source)
        except Exception:  # noqa: BLE001 - a source that does not save: that trace has no direct call
            source = None
        out.append(source)
    return out


def program_bytes(runnable: Any) -> bytes:
    """A ``Runnable``'s program as bytes (``NotSaved`` where it cannot be)."""
    program = runnable.program
    if program.lowering is None or program.dispatch is None:
        raise NotSaved("the program is not lowered and dispatched yet (a Runnable from the whole pipeline is)")
    session = runnable.runtime.session
    known = dict(session.loaded_keys) if session is not None else {}
    layouts: dict[tuple[str, int], list[Any]] = {}
    keys: dict[tuple[str, int], tuple[str | None, bool]] = {}
    pieces = []
    for piece in program.pieces:
        if piece.is_splitting:
            pieces.append(dataclasses.replace(piece, call=None))
            continue
        variants = []
        for i, v in enumerate(piece.variants):
            if any(_compat.is_traceable_wrapper_subclass(a) for a in v.example_args):
                raise NotSaved(f"{piece.name} takes a tensor-subclass input (a DTensor): its mesh is not saved")
            layouts[piece.name, i] = example_layouts(piece, v.example_args, v.binding)
            key = v.artifact_key or known.get((piece.name, v.binding))
            if key is not None:
                keys[piece.name, i] = tuple(key)
            variants.append(dataclasses.replace(v, compiled=None, example_args=(), artifact_key=None))
        pieces.append(dataclasses.replace(piece, variants=tuple(variants), call=None))
    stripped = program.replace(pieces=tuple(pieces))
    state = {"format": FORMAT, "modules": _modules(program), "layouts": layouts, "keys": keys,
             "sources": _sources(program.gm), "compiled_under": getattr(runnable, "compiled_under", None)}
    try:
        # Under the compile lock: the graphs lend their inner values out while they pickle, and a
        # background compile of one of them must not run meanwhile.
        with _compat.compile_lock(), values_left_out(_graphs(stripped)):
            return pickle.dumps({**state, "program": _compat.graph_dumps(stripped, _graphs(stripped))})
    except Exception as e:  # noqa: BLE001 - whatever does not pickle: said, and the program runs unsaved
        raise NotSaved(f"the program does not pickle ({type(e).__name__}: {str(e)[:300]})") from None


def program_from_bytes(data: bytes) -> tuple[Program, dict[tuple[str, Any], tuple[str | None, bool]], Any]:
    """The Program ``program_bytes`` saved, its variants' example inputs made again (not compiled),
    {(piece name, binding): its artifact's content key}, and the (grad mode, autocast) it was compiled
    under (None: not saved)."""
    state = pickle.loads(data)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise NotSaved(f"not a saved shapewise program of format {FORMAT!r}")
    for m in state["modules"]:
        importlib.import_module(m)
    program: Program = _compat.graph_loads(state["program"])
    # Code now for what calls run (the splitting ops' pieces, eagerly), first; the rest at a first call
    # (the stitching graph is run from its nodes, the compiled pieces by their artifacts).
    run = {id(p.gm) for p in program.pieces if p.is_splitting}
    for gm in sorted(_graphs(program), key=lambda g: id(g) not in run):
        _compat.recompile_loaded(gm, lazy=id(gm) not in run)
    for node, source in zip(_placeholders(program.gm), state.get("sources", ())):
        if source is not None:  # where each input comes from in a call: what a direct call reads
            node.meta[_compat.SOURCE_META] = source
    modes: dict[Any, Any] = {}  # one fake mode per static binding, shared by the pieces (as Concretize does)
    keys: dict[tuple[str, Any], tuple[str | None, bool]] = {}
    pieces = []
    for piece in program.pieces:
        if piece.is_splitting:
            pieces.append(piece)
            continue
        variants = []
        for i, v in enumerate(piece.variants):
            mode = modes.setdefault(v.binding, _compat.FakeTensorMode()) if v.binding.is_static else None
            args = example_args_from_layouts(piece, v.binding, state["layouts"][piece.name, i], mode)
            variants.append(dataclasses.replace(v, example_args=args))
            if (piece.name, i) in state["keys"]:
                keys[piece.name, v.binding] = state["keys"][piece.name, i]
        pieces.append(dataclasses.replace(piece, variants=tuple(variants)))
    return program.replace(pieces=tuple(pieces)), keys, state.get("compiled_under")


def load_program(data: bytes) -> tuple[Program, Any]:
    """The Program of ``program_bytes``'s bytes, lowered: every variant loaded from the artifact
    cache by its saved key (compiled where it is not there, under the state it was compiled under);
    and that state, for the ``Runnable`` of it (which builds the run-time state from its plans)."""
    program, keys, under = program_from_bytes(data)
    lowering = program.lowering
    session = lowering.session()
    session.loaded_keys.update(keys)
    with _compat.compiles_as_usual(), _compat.compile_state_as(under):
        return lowering.apply(program, session), under
