"""transformers' generation internals shapewise relies on (imported only when used: transformers
is not a dependency of shapewise itself).

``deferred_stop_checks()``: inside it, transformers' ``generate()`` on a CUDA model checks whether
to stop one step late (its own ``DeferredStopCheck``, which it turns on only for MPS), so the host
queues step t+1 while the GPU runs step t instead of waiting for step t's ``unfinished.max() == 0``
at every token. Where the stop comes from the model (an EOS token), one extra forward runs, and
transformers drops its token (``_undo_generation_steps``); a stop at the length limit is known on
the host and is never late. Only where the cache is not returned (transformers rolls a returned one
back with ``crop``, per step), and not for an assistant model.

``masks_in_graph(model)``: inside it, ``generate()`` hands ``model``'s forward no attention mask where
the one it starts from has no padding, so the forward builds its masks itself, inside the compiled
graph, as it does when called directly; with a static cache transformers otherwise builds them outside
the forward, eagerly, at every step (``create_masks_for_generate``: about half of the ~45 ATen ops a
decode token runs outside the forward on transformers 5.25).

``kept_static_cache(model)``: inside it, ``model.generate()``'s static cache is one that ``model``
keeps from call to call (zeroed in place: ``reset()``), its layers initialised before the first forward
(``early_initialization``, as transformers does for a chunked prefill), not a new one per call made inside the
prefill. transformers makes a new ``StaticCache`` per ``generate()``: a CUDA graph that reads its tensors in place
is captured again at each call's first decode step (two uncaptured whole-forward calls: ~36 ms a call at the 1B's
shapes on an H100, 1.0 ms a token of a 32-token ``generate()``), and a cache made by the prefill keeps its
counter on the host until then, so no prefill is captured. The kept cache's tensors are not marked as static
addresses (Dynamo would guard on their identity, and a cache given away would trace again): the graphs read
them in place because they stay where they were. A call that returns its cache (``return_dict_in_generate``)
hands back a copy (``copy_of_kept_cache``): the kept one is the next call's.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence

import torch

from shapewise._compat.dynamo import clear_static_address

__all__ = ["copy_of_kept_cache", "deferred_stop_checks", "drop_kept_cache", "kept_static_cache", "masks_in_graph"]

_log = logging.getLogger("shapewise")
_DEVICES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("shapewise_deferred_stops", default=())
_PARAMS = ("device", "cache", "cache_is_returned", "is_assistant")
_lock = threading.Lock()
_why_not: list[str | None] = []  # filled once: None where the gate is installed, else why it cannot be


def _install() -> str | None:
    """Wrap ``DeferredStopCheck.is_supported`` once, so that it says yes inside
    ``deferred_stop_checks()`` and whatever transformers says outside it; returns why it cannot."""
    try:
        import transformers
        from transformers.generation import utils as generation
    except ImportError:
        return "transformers is not installed"
    check = getattr(generation, "DeferredStopCheck", None)
    original = getattr(check, "is_supported", None)
    if original is None:
        return (f"transformers {transformers.__version__} has no DeferredStopCheck: its generate() waits for "
                "each step's stop check")
    if getattr(original, "shapewise_gate", False):
        return None
    try:
        params = tuple(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        params = ()
    if params != _PARAMS:
        return (f"transformers {transformers.__version__}'s DeferredStopCheck.is_supported takes {params}, "
                f"not {_PARAMS} as shapewise knows it")

    def is_supported(device: torch.device, cache: object, cache_is_returned: bool, is_assistant: bool) -> bool:
        devices = _DEVICES.get()
        if devices and torch.device(device).type in devices and not is_assistant and not cache_is_returned:
            return True
        return original(device, cache, cache_is_returned, is_assistant=is_assistant)

    is_supported.shapewise_gate = True
    check.is_supported = staticmethod(is_supported)
    return None


@contextlib.contextmanager
def deferred_stop_checks(devices: Sequence[str] = ("cuda",)) -> Iterator[bool]:
    """transformers' ``generate()`` inside checks for a stop one step late on ``devices`` (its
    ``DeferredStopCheck``, which needs device events: CUDA's); yields whether it can here (a
    transformers without it logs why, once, and generates as before)."""
    with _lock:
        if not _why_not:
            _why_not.append(_install())
            if _why_not[0] is not None:
                _log.info("shapewise: generate() keeps its stop check at every step: %s", _why_not[0])
    if _why_not[0] is not None:
        yield False
        return
    token = _DEVICES.set(tuple(dict.fromkeys((*_DEVICES.get(), *devices))))  # nested: both contexts' devices
    try:
        yield True
    finally:
        _DEVICES.reset(token)


# The model whose generate() call is inside masks_in_graph, and that call's [padding seen: None until its first step].
_MASKS: contextvars.ContextVar[tuple[torch.nn.Module, list[bool | None]] | None] = contextvars.ContextVar(
    "shapewise_graph_masks", default=None)


@contextlib.contextmanager
def masks_in_graph(model: torch.nn.Module) -> Iterator[bool]:
    """Inside it, ``model.generate()`` passes the forward ``attention_mask=None`` in place of the masks
    it would build for a static cache, where the call's 2D mask has no padding. Each prefill step (each
    chunk of a chunked prefill, ``is_first_iteration``; else the call's first step) checks its mask: a 0,
    or a mask that is not 2D, keeps transformers' masks for the rest of the call (decode steps only add
    ones). Yields whether it is in effect: not for a model whose class builds its own masks for
    generate (``create_masks_for_generate``: multimodal and hybrid models, whose masks carry more than
    padding) or that has one of its own, not for an encoder-decoder (untried), nor with a transformers
    that has no such step. The model keeps a wrapper (``_graph_masks_step``) that, outside this context
    (another thread's call, a nested one), builds transformers' masks as before."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield False
        return
    original = getattr(masking_utils, "create_masks_for_generate", None)
    own = vars(model).get("create_masks_for_generate")
    if original is None or hasattr(type(model), "create_masks_for_generate") \
            or (own is not None and not getattr(own, "shapewise_graph_masks", False)) \
            or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        yield False
        return
    if own is None:
        model.create_masks_for_generate = _graph_masks_step(model, original)  # transformers asks the model first
    token = _MASKS.set((model, [None]))
    try:
        yield True
    finally:
        _MASKS.reset(token)


def _graph_masks_step(model: torch.nn.Module, original):
    """``model``'s ``create_masks_for_generate`` for ``masks_in_graph``: None inside it (for ``model``'s
    call), for an unpadded call; ``original`` (transformers') everywhere else."""
    owner = weakref.ref(model)  # (the model holds this function)

    def create_masks_for_generate(*args, **kwargs):
        current = _MASKS.get()
        if current is None or current[0] is not owner():
            return original(*args, **kwargs)
        padded = current[1]
        if padded[0] is None or (kwargs.get("is_first_iteration") and not padded[0]):  # prefill: one sync
            mask = kwargs.get("attention_mask")
            padded[0] = mask is not None and (mask.dim() != 2 or not bool(mask.all()))
        return original(*args, **kwargs) if padded[0] else None

    create_masks_for_generate.shapewise_graph_masks = True
    return create_masks_for_generate


class KeptCall:
    """One ``generate()`` call inside ``kept_static_cache``: the kept cache it holds (no other call gets it
    meanwhile: a call on another thread waits for it, one inside this call gets a cache of its own, made
    alike), and whether no call has finished with that cache yet (``fresh``: the forward may not compile with
    it); ``done()`` says one has. ``outer``: the call this one runs inside, if any."""

    def __init__(self, model: torch.nn.Module, outer: KeptCall | None) -> None:
        self.model = model
        self.outer = outer
        self.holding: object | None = None
        self.fresh = False

    def done(self) -> None:
        if self.holding is not None:
            _SERVED.add(self.holding)


# The call inside kept_static_cache.
_KEEP: contextvars.ContextVar[KeptCall | None] = contextvars.ContextVar("shapewise_kept_cache", default=None)
_IN_USE: weakref.WeakSet = weakref.WeakSet()  # the kept caches a call holds
_IN_USE_LOCK = threading.Condition()
_SERVED: weakref.WeakSet = weakref.WeakSet()  # the kept caches a call has finished with


@contextlib.contextmanager
def kept_static_cache(model: torch.nn.Module) -> Iterator[KeptCall | None]:
    """Inside it, ``model.generate()`` uses the static cache ``model`` keeps (see the module's docstring);
    yields the call's ``KeptCall``, or None where it cannot: not for an encoder-decoder, a model spread over
    devices or with heads of their own sizes (``_get_static_cache_init_shape`` says None), nor with a
    transformers without these steps."""
    prepare = getattr(model, "_prepare_static_cache", None)
    init_shape = getattr(model, "_get_static_cache_init_shape", None)
    if prepare is None or init_shape is None or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        yield None
        return
    if not getattr(prepare, "shapewise_kept_cache", False):
        try:
            signature = inspect.signature(prepare)
        except (TypeError, ValueError):
            yield None
            return
        model._prepare_static_cache = _kept_cache_step(model, prepare, signature, init_shape)
    call = KeptCall(model, _KEEP.get())
    token = _KEEP.set(call)
    try:
        yield call
    finally:
        _KEEP.reset(token)
        if call.holding is not None:
            with _IN_USE_LOCK:
                _IN_USE.discard(call.holding)
                _IN_USE_LOCK.notify_all()


def _kept_cache_step(model: torch.nn.Module, original, signature: inspect.Signature, init_shape):
    """``model``'s ``_prepare_static_cache`` for ``kept_static_cache``: the kept cache, reset, inside it (for
    ``model``'s call); ``original`` (transformers') everywhere else."""
    owner = weakref.ref(model)  # (the model holds this function)
    kept: dict[tuple, object] = {}  # (cache kind, batch size, length asked): the one cache the model keeps

    def initialised(args: tuple, kwargs: dict, batch_size: int) -> tuple[object, bool]:
        """A new cache from transformers, its layers initialised and unmarked where it can be; whether so."""
        cache = original(*args, **kwargs)
        layers = list(getattr(cache, "layers", None) or ())
        try:
            shape = init_shape()
        except AttributeError:  # a config without attention heads (Mamba2's): transformers' own cache
            shape = None
        if shape is None or not layers or not hasattr(cache, "early_initialization") or \
                not all(getattr(layer, "supports_early_init", False) for layer in layers):
            return cache, False  # transformers' own, made in the prefill
        if not all(getattr(layer, "is_initialized", False) for layer in layers):
            try:
                cache.early_initialization(batch_size=batch_size, num_heads=shape[0], head_dim=shape[1],
                                           dtype=model.dtype, device=model.device)
            except (ValueError, TypeError, RuntimeError):  # shapes it refuses: transformers' own, made anew
                return original(*args, **kwargs), False
        for layer in layers:  # not static addresses: Dynamo would guard on each tensor's identity
            for t in vars(layer).values():
                if isinstance(t, torch.Tensor):
                    clear_static_address(t)
        return cache, all(getattr(layer, "is_initialized", False) for layer in layers)

    def prepare_static_cache(*args, **kwargs):
        call = _KEEP.get()
        if call is None or call.model is not owner() or call.holding is not None:
            return original(*args, **kwargs)
        try:
            named = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)  # transformers' own call will say what is wrong
        key = (named.get("cache_implementation"), named.get("batch_size"), named.get("max_cache_len"))
        with _IN_USE_LOCK:
            while True:
                cache = kept.get(key)
                busy = cache is not None and cache in _IN_USE
                if not busy or _holds(call.outer, cache):
                    break
                _IN_USE_LOCK.wait()  # another thread's call holds it: this one waits for it
            if cache is not None and not busy:
                _IN_USE.add(cache)
                call.holding, call.fresh = cache, cache not in _SERVED
        if busy:  # the call around this one holds it: one of this call's own, made alike (the same traces)
            return initialised(args, kwargs, key[1])[0]
        if cache is not None:
            cache.reset()
            return cache
        cache, ready = initialised(args, kwargs, key[1])
        if ready:  # the one kept from now on (a call still holding an earlier one lets it go when it ends)
            with _IN_USE_LOCK:
                kept.clear()
                kept[key] = cache
                _IN_USE.add(cache)
            call.holding, call.fresh = cache, True
        return cache

    prepare_static_cache.shapewise_kept_cache = True
    prepare_static_cache.shapewise_kept = kept
    return prepare_static_cache


def _holds(call: KeptCall | None, cache: object) -> bool:
    """Whether ``call`` or a call it runs inside holds ``cache``."""
    while call is not None:
        if call.holding is cache:
            return True
        call = call.outer
    return False


def copy_of_kept_cache(model: torch.nn.Module, result: object) -> object:
    """``result`` (what ``model.generate()`` returned) with a copy of the cache it returns where that is the
    one ``model`` keeps (``kept_static_cache``), which the next call resets: the caller's own, to keep."""
    kept = getattr(getattr(model, "_prepare_static_cache", None), "shapewise_kept", None)
    # (transformers 5.25 renamed the output's field ``cache``; ``past_key_values`` is a deprecated alias there)
    name = "cache" if "cache" in getattr(result, "__dataclass_fields__", {}) else "past_key_values"
    cache = getattr(result, name, None)
    if kept and cache is not None and any(cache is c for c in kept.values()):
        setattr(result, name, copy.deepcopy(cache))
    return result


def drop_kept_cache(model: torch.nn.Module) -> None:
    """Forget the cache ``model`` keeps (``kept_static_cache``): its next call makes transformers' own."""
    kept = getattr(getattr(model, "_prepare_static_cache", None), "shapewise_kept", None)
    if kept:
        kept.clear()
