"""``generate()`` under ``compile_generate``: the wrapper around transformers' own generation loop
(``_shapewise_generate``), installed on the model where a call needs more than the compiled forward: the CUDA
graphs' outputs borrowed, not copied, per step (``borrow``); the stop check read a step late (``defer_stop``);
the masks built in the graph (``graph_masks``); one static cache kept from call to call (``keep_cache``). The
last two change what the forward is handed, which some forwards do not compile with: the first call that fails
so turns that option off for the model, says so, and runs again (from its random state) without it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any

import torch

from shapewise import _compat
from shapewise.dispatch.copies import borrowed_outputs
from shapewise.errors import CompileError

log = logging.getLogger("shapewise")


# generate() arguments under which it keeps a forward's output tensors past the next forward
# (assisted and DoLa decoding, contrastive search, beams, code from the Hub): no borrowing there.
_KEEPS_OUTPUTS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "dola_layers",
                  "penalty_alpha", "custom_generate")


def _keeps_outputs(model: torch.nn.Module, kwargs: dict) -> str | None:
    """Why this ``generate(**kwargs)`` call (its arguments by name, ``generation_config``'s
    included) may keep tensors of a forward's outputs after it calls the forward again, or None
    where it keeps none: greedy or sampled decoding copies the last position's logits
    (``.to(copy=True)``) and drops the outputs before the next step."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def get(name: str) -> Any:
        return kwargs[name] if name in kwargs else getattr(config, name, None)

    if get("return_dict_in_generate") and (get("output_hidden_states") or get("output_attentions")):
        return "it returns each step's hidden states or attentions"
    if (get("num_beams") or 1) > 1:
        return "beam search"
    if get("guidance_scale") not in (None, 1, 1.0):  # its logits processor calls the forward between steps
        return "classifier-free guidance"
    return next((f"{n} is set" for n in _KEEPS_OUTPUTS if get(n)), None)


def _shapewise_generate(model: torch.nn.Module, *, borrow: bool = True, defer_stop: bool = False,
                        graph_masks: bool = False, keep_cache: bool = False, keep_asked: bool = True) -> Any:
    """``model.generate`` that runs inside ``borrowed_outputs()`` (the CUDA graphs' logits not
    copied per step; ``borrow``) where the call keeps no output tensor (``_keeps_outputs``, on its
    arguments bound by name: a positional ``generation_config`` counts), inside
    ``_compat.deferred_stop_checks()`` (``defer_stop``: on a CUDA model, whether to stop is read one
    step late, so the host is never held at a step's end waiting for the GPU) and inside
    ``_compat.masks_in_graph()`` (``graph_masks``: an unpadded call's masks built in the graph) and inside
    ``_compat.kept_static_cache()`` (``keep_cache``: one static cache from call to call; a call that returns
    its cache returns a copy; ``keep_asked`` False: on by default, so its fallback says so at info level, and a
    call given state it may change runs without it until a call has run with it)."""
    generate = model.generate
    try:
        signature = inspect.signature(generate)
    except (TypeError, ValueError):
        signature = None

    def by_name(args: tuple, kwargs: dict) -> dict | None:
        if not args:
            return kwargs
        if signature is None:
            return None
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return None  # generate() itself will say what is wrong
        extra = next((bound.pop(n) for n, p in signature.parameters.items()
                      if p.kind is inspect.Parameter.VAR_KEYWORD and n in bound), {})
        return {**bound, **extra}

    def run(args: tuple, kwargs: dict, in_graph: bool, keep: bool, calls: list | None = None) -> Any:
        with contextlib.ExitStack() as scope:
            if borrow:
                named = by_name(args, kwargs)
                if named is not None and _keeps_outputs(model, named) is None:
                    scope.enter_context(borrowed_outputs())
            if keep:
                call = scope.enter_context(_compat.kept_static_cache(model))
                if calls is not None:
                    calls.append(call)
            if defer_stop:
                scope.enter_context(_compat.deferred_stop_checks())
            if in_graph:
                scope.enter_context(_compat.masks_in_graph(model))
            out = generate(*args, **kwargs)
        return _compat.copy_of_kept_cache(model, out) if keep else out

    @functools.wraps(generate)
    def generate_shapewise(*args: Any, **kwargs: Any) -> Any:
        masks = generate_shapewise.shapewise_graph_masks  # (each off for good once a forward failed with it)
        keep = generate_shapewise.shapewise_keeps_cache
        if keep and not keep_asked and not generate_shapewise.shapewise_kept_once:
            named = by_name(args, kwargs)  # the default's first calls: none that a failed compile would spoil
            keep = named is not None and not set(named) & _CALL_STATE
        if not masks and not keep:
            return run(args, kwargs, False, False)
        rng = _rng_states()
        calls: list = []
        try:
            out = run(args, kwargs, masks, keep, calls)
            for call in calls:
                if call is not None:
                    if call.holding is not None:  # (a call may not take it: a dynamic cache, use_cache=False)
                        generate_shapewise.shapewise_kept_once = True
                    call.done()
            return out
        except Exception as e:  # noqa: BLE001 - raised again below unless one of these options caused it
            # A forward that reads the mask's length as a value (OPT's positions) does not compile without
            # one. With the kept cache, initialised before the prefill, a forward that reads the cache's length
            # there (OPT's, BioGPT's) or whose heads are not what transformers' init shape says (Falcon's)
            # does not either: only a call that made a new kept cache compiles with it (``fresh``). The option
            # is turned off and the call, which ran up to that compile (a prefill, maybe its first token), runs
            # again from the same random state, unless it was given state it may have changed or handed out.
            option = "graph_masks" if masks and isinstance(e, CompileError) and e.reads_values else \
                "keep_cache" if keep and any(c is not None and c.fresh for c in calls) and (
                    isinstance(e, CompileError) or _compat.is_trace_error(e) or _compat.is_trace_error(e.__cause__)
                ) else None
            if option is None:  # not what these options cause: the user's to see
                raise
            what = _WITHOUT[option]
            why = str(e).splitlines()[0][:300] if str(e).strip() else type(e).__name__
            named = by_name(args, kwargs)
            given = sorted(set(named or ()) & _CALL_STATE) if named is not None else ["arguments not bound"]
            if given:
                _turn_off(option)
                raise CompileError(f"compile_generate({option}=True): {type(model).__name__}'s forward did not "
                                   f"compile {what} ({why}); {option} is now off for this model. This call was "
                                   f"given {given}, which it may have used: call generate() again") from e
            _set_rng_states(rng)
            _turn_off(option)
            asked = option == "graph_masks" or keep_asked
            log.log(logging.WARNING if asked else logging.INFO,
                    "shapewise: compile_generate(%s=True%s): %s's forward did not compile %s (%s); generate() runs "
                    "without it from now on, this call too", option, "" if asked else ", the default here",
                    type(model).__name__, what, why)
            if option == "graph_masks":
                return generate_shapewise(*args, **kwargs)  # (the kept cache may fail in its turn)
            try:
                return run(args, kwargs, masks, False)
            except Exception:
                generate_shapewise.shapewise_keeps_cache = True  # failing without it too: not its doing
                raise

    def _turn_off(option: str) -> None:
        if option == "graph_masks":
            generate_shapewise.shapewise_graph_masks = False
        else:
            generate_shapewise.shapewise_keeps_cache = False
            _compat.drop_kept_cache(model)

    generate_shapewise.shapewise_borrows = borrow
    generate_shapewise.shapewise_defers_stop = defer_stop
    generate_shapewise.shapewise_graph_masks = graph_masks
    generate_shapewise.shapewise_keeps_cache = keep_cache
    generate_shapewise.shapewise_kept_once = False  # a call has run with the kept cache
    return generate_shapewise


# What the forward is handed under each option that a forward may not compile with.
_WITHOUT = {"graph_masks": "without an attention mask",
            "keep_cache": "with its static cache initialised before the prefill"}

# generate() arguments whose state a call can change or hand out before a compile fails in it: such a call
# is not run again by graph_masks' fallback (a cache it wrote, tokens streamed, stateful processors).
_CALL_STATE = frozenset({"past_key_values", "cache", "streamer", "logits_processor", "stopping_criteria",
                         "assistant_model", "prefix_allowed_tokens_fn"})


def _rng_states() -> tuple:
    """The CPU's and (where initialised) the GPUs' random states: a sampled call run again draws the same."""
    return torch.random.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def _set_rng_states(states: tuple) -> None:
    cpu, cuda = states
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
