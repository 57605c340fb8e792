"""``compile_generate``: shapewise under transformers' ``model.generate()``.

Generation calls ``model.forward`` twice over: once for the prompt (prefill, many tokens, an
empty KV cache) and once per new token (decode, one token, a cache that grows by one each step
unless it is a static cache). The model's Python branches on ``q_len > 1``, so the two are two
traces; shapewise makes each one once:

- prefill: one trace, static kernels per prompt size in ``prompt_sizes`` (plus symbolic ones per
  ``prompt_ranges``);
- decode: one trace fixed at one token; with the default dynamic cache its KV length is a
  second dynamic size (``kv``), compiled over ``(1, max_length)``; with a static cache the
  cache has one size and decode is a single static variant.

Prefill and decode steps call the compiled program directly, past Dynamo's frame
(``direct_call``, on by default here; ``shapewise.direct``): the KV cache's tensors are read
from the cache object as the trace read them, and what the forward sets on the cache's layers
(a dynamic cache's new tensors, prefill's initialisation) is set as Dynamo's frame would set it.
``fast.direct_info`` says which traces are on and why not.

>>> fast = sw.compile_generate(model, prompt_sizes=[16, 32, 64, 128], prompt_ranges=[(129, 1024)],
...                            max_length=2048, backend="inductor")
>>> model.generate(ids, max_new_tokens=64, do_sample=False)      # same tokens as eager
>>> fast.report()                                                 # which trace serves which sizes
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch

from shapewise.backend import cudagraphs_options
from shapewise.errors import ConfigError
from shapewise.generate_loop import _shapewise_generate
from shapewise.module import ShapewiseModule

log = logging.getLogger("shapewise")

__all__ = ["compile_generate"]

_OWN = ("sizes", "ranges", "dynamic_dims")
_COUNTERS = ("cumulative_length", "cumulative_length_int")
_ALONG_DIM_1 = ("indexer_keys",)  # cache tensors whose token dim is 1
_RELAID = ("keys", "values", *_ALONG_DIM_1)  # what a prefill hands decode contiguous


def _uses_cache(model: torch.nn.Module) -> bool:
    """Whether ``generate()`` passes this model a KV cache (its generation config decides, else its config)."""
    flag = getattr(model.generation_config, "use_cache", None)
    return (flag if flag is not None else getattr(model.config, "use_cache", True)) is not False


def _settle_cache(cache_arg: str) -> Any:
    """After a prefill (a call of several tokens), a dynamic cache's keys and values made
    contiguous: prefill leaves them in whatever layout its kernels made (Inductor's, or a
    sliding window's slice of the prompt, whose strides depend on the prompt's length), and a
    decode trace is guarded on strides, so each layout would cost a trace. Decode's own steps
    then grow the cache in the layouts its one trace (two for sliding windows: filling, then
    full) was made for, whatever the prompt."""
    def settle(args: tuple, kwargs: dict, out: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.shape[-1] == 1:
            return
        cache = kwargs.get(cache_arg)
        if cache is None:
            cache = getattr(out, "past_key_values", None)
        for layer in _cache_layers(cache):
            window = getattr(layer, "sliding_window", None)
            for name in _RELAID:
                t = getattr(layer, name, None)
                if not isinstance(t, torch.Tensor):
                    continue
                if type(window) is int and name != "indexer_keys" and t.dim() == 4 and t.shape[-2] == window - 1:
                    # A full window, laid out as the layer's own update lays it out at every step
                    # (the last window - 1 rows of the cat of the cache and the new token).
                    full = t.new_empty((*t.shape[:2], window, t.shape[-1]))
                    full[:, :, 1:].copy_(t)
                    setattr(layer, name, full[:, :, 1:])
                elif not t.is_contiguous():
                    setattr(layer, name, t.contiguous())

    return settle


def _whole_sequence_note(cache_arg: str) -> Any:
    """A DispatchMiss's note where a decode step came with more than the new token: the model's
    ``generate()`` passes it the whole sequence at every step (cpmant, xlm, xlnet), beside a cache."""
    def note(args: tuple, kwargs: dict) -> str | None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get(cache_arg)
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.shape[-1] == 1 or cache is None:
            return None
        try:
            held = int(cache.get_seq_length())
        except Exception:  # noqa: BLE001 - a cache without a length: no note
            return None
        if held == 0:
            return None
        return (f"compile_generate: a decode step (the cache holds {held} tokens) was given {ids.shape[-1]} tokens: "
                "this model's generate() passes it the whole sequence at every step (its "
                "prepare_inputs_for_generation does not cut the input to the new token), so each step is a prefill "
                "at a new length, which compile_generate does not serve (it compiles decode for one new token); "
                "generate with this model eagerly")

    return note


def _cache_layers(cache: Any) -> list[Any]:
    """The layers of a transformers cache (an encoder-decoder cache's self-attention ones)."""
    cache = getattr(cache, "self_attention_cache", cache)
    layers = getattr(cache, "layers", None)
    return list(layers) if isinstance(layers, (list, tuple)) else []


def _static_cache_for(model: torch.nn.Module, asked: bool | str) -> bool:
    """Whether ``compile_generate(static_cache=asked)`` gives ``model`` a static cache (its docstring)."""
    if asked not in (True, False, "force") or isinstance(asked, int) and not isinstance(asked, bool):
        raise ConfigError(f"static_cache must be True, False or 'force', got {asked!r}")
    if asked is True and getattr(type(model), "_can_compile_fullgraph", True) is False:
        log.warning("shapewise: transformers marks %s as not compilable as one graph with a static cache "
                    "(_can_compile_fullgraph = False); compile_generate keeps its dynamic cache. "
                    "static_cache='force' uses the static cache anyway", type(model).__name__)
        return False
    return bool(asked)


def _triton_gemv_available() -> bool:
    from shapewise.library.kernels.gemv import triton_gemv_available

    return triton_gemv_available()


def compile_generate(model: torch.nn.Module, *, prompt_sizes: Sequence[int] = (),
                     prompt_ranges: Sequence[tuple[int, int]] = (), max_length: int = 4096,
                     static_cache: bool | str = False, splitting_ops: Any = None, fuse_projections: bool | None = None,
                     grouped_decode: bool | None = None, combo_kernels: bool | None = None,
                     batch_updates: bool | None = None, decode_gemv: bool | None = None,
                     defer_stop: bool | None = None, pdl: bool = False, graph_masks: bool = False,
                     keep_cache: bool | None = None, gemv_norm: bool | None = None,
                     **options: Any) -> ShapewiseModule:
    """Compile ``model.forward`` for ``model.generate()`` and install it on ``model`` (as
    transformers' own recipe does with ``torch.compile``); returns the compiled forward.

    ``prompt_sizes`` / ``prompt_ranges``: prompt lengths to compile prefill for (a prompt of
    another length is a ``DispatchMiss``, or whatever ``on_miss`` says). ``max_length``: the
    longest sequence (prompt + new tokens) decode must serve. ``static_cache``: make
    ``generate()`` use transformers' static cache (``generation_config.cache_implementation``),
    of ``max_length`` positions for every call (``generation_config.max_cache_len``, unless set:
    a decode step attends over all of them, masked, so ask for the length you need); decode is
    then one static variant. A model whose class transformers marks as not compilable as one
    graph (``_can_compile_fullgraph = False``: BERT-style decoders, whose masks are built for the
    prompt's length, not the cache's, under a trace) keeps its dynamic cache, with a warning:
    with a static cache 25 of 41 such architectures failed or gave other tokens, with the dynamic
    cache 20 of those 25 are right (benchmarks/results/sweep_cpu_static_fallback).
    ``static_cache="force"`` uses the static cache on those too. ``direct_call`` (default True):
    calls past Dynamo's frame where a trace allows them. ``splitting_ops``: by default the graph is split at SDPA (each
    piece compiles and, with piecewise CUDA graphs, is captured on its own). Under
    ``cudagraphs="full"`` (or ``{"mode": "full", ...}``), where a split only keeps Inductor from fusing across
    the attention, the decode trace stays whole by default (``whole_traces={"seq": 1}``, a pipeline option,
    ``sw.compile``'s too: a trace that fixes seq at one token is one piece; on the H200 at Llama-3.2-1B shapes,
    297 kernels a decode step against 342 split, as transformers' recipe; benchmarks/results/decode_h200) and
    only the prompt trace is split: its pieces, the same in every layer, compile once a size (the dedupe), not
    the whole forward once a size (an H100, the 1B: the serial cold start 44.0 against 68.2 s, 32.4 s with 4
    compile workers; benchmarks/results/default_split_h100_20261207). ``splitting_ops=()`` keeps every trace
    whole; ``whole_traces={}`` splits the decode trace too. ``fuse_projections``: pack each module's sibling linear
    layers into one buffer (``sw.library.pack_projections``: the model's parameters become views
    into it, in place) and run ``sw.library.FuseProjections`` first among the graph passes, so q,
    k, v (and gate, up) are one matmul each. By default (None) on where the steps replay CUDA
    graphs (a model on a GPU, ``cudagraphs`` set), where the fused op's host cost is paid once, at
    capture: on the H200 at 1B shapes the step's GPU time falls 17%. Without graphs each call of
    the op costs more host time (~29 µs on a 2-core CPU) than the matmul launches it saves (a
    16-layer decode step on the CPU: 4.1 ms fused, 2.2 unfused; benchmarks/bench_fuse_cpu.py).
    ``grouped_decode``: run ``sw.library.GroupedDecodeAttention`` (a decode step's grouped-query
    attention over the cache's own KV heads, in shapewise's decode kernel, not over transformers'
    repeated copies of them). ``combo_kernels``: Inductor's combo kernels for the static variants
    (``static_options={"combo_kernels": True}``: independent small kernels, such as a layer's rotary
    and cache writes, in one launch). Both by default (None) on where the forward is one CUDA graph
    per size (``cudagraphs="full"``, a model on a GPU), where the attention is in the graph the
    pass sees and launches are what a step is made of: on the H200 at 1B shapes, with both, 197
    kernels a step against 250 and 1106 against 1229 µs (benchmarks/results/decode_h200/decode_kernel).
    ``batch_updates``: run ``sw.library.BatchInputUpdates`` (a static cache's per-layer token
    counters, ``counter.add_(1)`` in each layer, added in one launch at the end of the step, not
    one kernel a layer); by default on where the other two are.
    ``decode_gemv``: run ``sw.library.DecodeGemv`` (after FuseProjections): at decode, each linear
    layer, the fused groups too, in shapewise's Triton GEMV where it times faster than cuBLAS for
    that weight at that row count (tuned once per weight shape on the device, in CUDA graphs as a
    step runs it, the results kept on disk), else cuBLAS as before. By default (None) on where the
    other three are and Triton is there: on an H100 at 1B shapes a step's GPU time fell 11.8%
    (1150.9 against 1304.7 µs; benchmarks/results/h100_20261206_rows; in a second run the tuner
    of then, timing single launches, kept cuBLAS for every weight and nothing changed), and with the
    tuner in graphs the 16-layer chain of its GEMVs takes 45.9 µs a layer against cuBLAS's 53.6
    (benchmarks/results/h100_20261206_default; that step itself is not measured yet).
    A ``DecodeGemv`` given in ``graph_passes`` is used as given instead (with ``pdl``, as
    ``pdl=True``); the one added here keeps ``pdl=False`` under ``pdl`` too.
    ``gemv_norm``: the ``DecodeGemv`` added here with ``norm=True`` (``True`` / ``False``: a ``DecodeGemv`` given in
    ``graph_passes`` too): at one row (a decode step of one
    sequence), where the tuner chose the kernel, the RMSNorm before a product and the residual add after it
    in its kernel (``sw.library.norm_gemv``; bf16). By default (None) on where ``decode_gemv`` is: on an
    H100 at 1B shapes a step's GPU time 1130.8 against 1148.9 µs and 118 against 150 kernels a step
    (benchmarks/results/norm_h100_20261207); at 16 and 64 rows it was slower, so ``norm_rows`` stays 1.
    With CUDA graphs and a static cache, ``model.generate`` is wrapped too: a call that keeps no
    output tensor of a step past the next step (greedy or sampled decoding without returned hidden
    states or attentions; not beams, assisted, DoLa or contrastive decoding, not classifier-free
    guidance) runs inside ``shapewise.dispatch.borrowed_outputs()``, so each step's logits are
    the graph's own buffer, not a copy of it (``generate()`` copies the last position itself).
    ``defer_stop``: ``generate()`` on a CUDA model decides whether to stop one step late
    (``_compat.deferred_stop_checks``: transformers' own ``DeferredStopCheck``, which it turns on for
    MPS only), so the host queues the next step while the GPU runs this one, instead of waiting at
    every token for ``unfinished.max() == 0``; where an EOS token stops it, one extra step runs and
    its token is dropped, so the tokens are the same. Not where the cache is returned
    (``return_dict_in_generate``, a cache passed in) or for assisted decoding: there it checks at
    every step, as before. By default (None) on for a model on a GPU.
    ``pdl``: programmatic dependent launch (``sw.library.kernels.pdl``; Hopper and later, else
    ignored): Inductor's kernels (``static_options={"triton.enable_pdl": True}``), the decode
    attention kernel and ``DecodeGemv`` passes given in ``graph_passes`` (as ``pdl=True``) start
    while the kernel ahead of them finishes. Off by default: on the H200 at 1B shapes it changed
    nothing measurable when the GEMMs were cuBLAS's (a step's GPU time 1059 against 1064 µs;
    benchmarks/results/h200_20261205b), and with every GEMV in the kernel, each with PDL (a
    ``DecodeGemv(pdl=True)``), it made an H100's step slower (1359.7 against 1252.3 µs) and a chain
    of the GEMVs too (56.9 against 45.9 µs a layer; benchmarks/results/h100_20261206_default).
    ``graph_masks``: with a static cache, ``generate()`` hands the forward no attention mask where the
    call's own has no padding (``_compat.masks_in_graph``), so the forward builds its masks inside the
    compiled graph, as when called directly, instead of transformers building them eagerly outside it
    at every step (about half of the ~45 ATen ops a decode token runs outside the forward). Off by
    default: on this project's 2-core CPU a tiny Llama's ``generate()`` ran 3161.8 against 2438.9
    tokens/s with it, the same tokens and traces (benchmarks/results/graph_masks_cpu); not measured on
    a GPU yet. Not for a model whose class builds its own masks for generate (multimodal and some
    hybrid models) or an encoder-decoder: there it does nothing. A forward that needs the mask to
    compile (OPT derives its positions from the mask's length, the static cache's length read as a
    value) fails its first compile without it: ``generate()`` then says so in a warning and runs with
    transformers' masks, for that call and every later one.
    ``keep_cache``: with a static cache, ``generate()`` uses one cache the model keeps (``_compat.kept_static_cache``),
    not transformers' new one per call, whose tensors move: each call captured its decode graph again, and its
    prefill ran uncaptured (the new cache's counter on the host). Default: on with a static cache in CUDA graphs
    (``cudagraphs`` set), off otherwise. On an H200 (the 1B, the default's split prompt trace, 4 workers,
    benchmarks/results/keep_cache_h200_20261207) a 32-token ``generate()`` took 1.19 ms a token against 1.59,
    the decode 1.09 against 1.25 ms a token and a 64-token prompt's prefill 4.4 against 12.1 ms, with no graph
    captured again. The cache is initialised before the prefill, which 6 of 154 architectures do not compile
    with (OPT, BioGPT read the cache's length as a value there; Falcon, GPT-BigCode and 2 more have heads other
    than transformers' init shape says): their first call turns it off for the model, says so (a warning where
    it was asked for, an info line where it was the default) and runs again without it (as ``graph_masks``;
    benchmarks/results/sweep_cpu_keep_cache); where it was the default, a call given state it may change
    (a streamer, processors, a cache) runs without it until a call has run with it. The kept cache holds its
    memory; a call that returns its cache (``return_dict_in_generate``) returns a copy.
    Other options go to ``shapewise.compile``.
    """
    clash = [k for k in _OWN if k in options]
    if clash:
        raise ConfigError(f"compile_generate chooses {clash} itself (from prompt_sizes, prompt_ranges and "
                          "max_length); use shapewise.compile to set them by hand")
    if isinstance(model.forward, ShapewiseModule):
        raise ConfigError("model.forward is compiled already; call compile_generate on the model once")
    if max_length < 2:
        raise ConfigError(f"max_length must be >= 2 (a prompt and one new token), got {max_length}")
    if not isinstance(graph_masks, bool):
        raise ConfigError(f"graph_masks must be True or False, got {graph_masks!r}")
    if keep_cache is not None and not isinstance(keep_cache, bool):
        raise ConfigError(f"keep_cache must be True, False or None (the default: on with a static cache in CUDA "
                          f"graphs), got {keep_cache!r}")
    if gemv_norm is not None and not isinstance(gemv_norm, bool):
        raise ConfigError(f"compile_generate(gemv_norm={gemv_norm!r}): say True, False or None (on where "
                          f"decode_gemv is)")
    static_cache = _static_cache_for(model, static_cache)
    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params:
        raise ConfigError(f"compile_generate needs a forward(input_ids, ...) (a transformers generative model); "
                          f"{type(model).__name__}.forward takes {list(params)}")
    # The cache argument is ``cache`` in transformers >= 5.2x, ``past_key_values`` before.
    cache_arg = next((n for n in ("cache", "past_key_values") if n in params), None)
    if cache_arg is not None and not _uses_cache(model):
        cache_arg = None  # generate() passes no cache: every step runs the whole sequence again
    dims: dict[str, dict[int, str]] = {"input_ids": {1: "seq"}}
    if "position_ids" in params:
        dims["position_ids"] = {1: "seq"}
    grows = not static_cache and cache_arg is not None
    if cache_arg is not None:
        # The token counts sliding-window layers keep as Python ints (a dynamic cache's
        # ``cumulative_length``, a static one's ``cumulative_length_int``): sizes, not constants.
        # A sparse-attention (DSA) layer's indexer keys, [batch, tokens, head dim], grow along dim 1.
        dims[cache_arg] = {**({2: "kv", **{a: {1: "kv"} for a in _ALONG_DIM_1}} if grows else {}),
                           **dict.fromkeys(_COUNTERS, "pos")}
    if "attention_mask" in params and not static_cache:
        # [batch, tokens so far]. A static cache's mask is not marked: at decode its width is the
        # cache's, one size; at prefill it is [batch, 1, prompt, width], the width the prompt's
        # length or a window's, which the model fixes per prompt length in a range anyway.
        dims["attention_mask"] = {-1: "ctx"}
    ctx = "attention_mask" in dims
    prompt = [{"seq": s, **({"ctx": s} if ctx else {})} for s in prompt_sizes]
    prompt_r = [{"seq": tuple(r), **({"ctx": tuple(r)} if ctx else {})} for r in prompt_ranges]
    # Decode: one token; the cache's length, the mask's and the layers' counters over the sequence.
    span = (1, max_length)
    decode = {"seq": 1, **({"kv": span} if grows else {}), **({"ctx": span} if ctx else {}),
              **({"pos": span} if cache_arg is not None else {})}
    sizes, ranges = prompt, [*prompt_r, decode]
    if cache_arg is None:
        # No KV cache: each step is a prefill one token longer, so the prefill trace serves the
        # lengths past the prompts, up to max_length (one range, symbolic kernels).
        longest = max([*prompt_sizes, *(hi for _, hi in prompt_ranges)], default=0)
        grow = (longest + 1, max_length)
        ranges = [*prompt_r, *([{"seq": grow, **({"ctx": grow} if ctx else {})}] if grow[0] <= grow[1] else [])]
    if static_cache:
        model.generation_config.cache_implementation = "static"
        # transformers sizes a static cache by each call's prompt + new tokens: the first call's
        # length would be fixed in the traces (prompts past it skipped at compile, a longer call
        # traced again). One cache of max_length serves every call up to it from the same traces.
        if getattr(model.generation_config, "max_cache_len", None) is None:
            model.generation_config.max_cache_len = max_length
    # With a static cache on a GPU, generate() would wrap the forward in torch.compile itself.
    model.generation_config.disable_compile = True
    options.setdefault("direct_call", True)
    first = next(iter(model.parameters()), None)
    on_gpu = first is not None and first.device.type == "cuda"
    full = cudagraphs_options(options.get("cudagraphs", False)).get("mode") == "full"
    if fuse_projections is None:
        fuse_projections = bool(on_gpu and options.get("cudagraphs", False))  # {} is off, as cudagraphs_options says
    if grouped_decode is None:
        grouped_decode = on_gpu and full
    if combo_kernels is None:
        combo_kernels = on_gpu and full
    if batch_updates is None:
        batch_updates = on_gpu and full
    gemv_asked = decode_gemv
    if decode_gemv is None:
        decode_gemv = on_gpu and full and _triton_gemv_available()
    if defer_stop is None:
        defer_stop = on_gpu
    passes = list(options.get("graph_passes", ()))
    if gemv_norm is not None:
        from shapewise.library.decode_gemv import DecodeGemv

        given = any(isinstance(p, DecodeGemv) for p in passes)  # the user's own: gemv_norm says for them too
        passes = [dataclasses.replace(p, norm=gemv_norm) if isinstance(p, DecodeGemv) else p for p in passes]
        if gemv_norm and not decode_gemv and not given:
            why = "decode_gemv=False" if gemv_asked is False else \
                "decode_gemv is off by default here: it needs a model on a GPU, cudagraphs='full' and Triton"
            raise ConfigError(f"compile_generate(gemv_norm=True) puts the RMSNorm into DecodeGemv's kernel, which "
                              f"this call does not run ({why}); leave gemv_norm unset, or pass decode_gemv=True")
    if batch_updates:
        from shapewise.library.batch_updates import BatchInputUpdates

        if not any(isinstance(p, BatchInputUpdates) for p in passes):
            passes.append(BatchInputUpdates())
    if grouped_decode:
        from shapewise.library.grouped_decode import GroupedDecodeAttention  # registers its op

        if not any(isinstance(p, GroupedDecodeAttention) for p in passes):
            passes.insert(0, GroupedDecodeAttention(pdl=pdl))
    if pdl:
        from shapewise.library.decode_gemv import DecodeGemv

        passes = [dataclasses.replace(p, pdl=True) if isinstance(p, DecodeGemv) else p for p in passes]
        options["static_options"] = {"triton.enable_pdl": True, **(options.get("static_options") or {})}
    if decode_gemv:  # after pdl's: compile_generate's own pass is tuned against cuBLAS (pdl=True would run
        # the kernel for every weight, which made an H100's step slower: 1359.7 against 1252.3 µs)
        from shapewise.library.decode_gemv import DecodeGemv

        if not any(isinstance(p, DecodeGemv) for p in passes):
            passes.append(DecodeGemv(norm=True if gemv_norm is None else gemv_norm))
    if fuse_projections:
        from shapewise.library.fuse_projections import FuseProjections, pack_projections  # registers its op

        pack_projections(model)
        passes.insert(0, FuseProjections())
    if passes:
        options["graph_passes"] = tuple(passes)
    if combo_kernels:
        options["static_options"] = {"combo_kernels": True, **(options.get("static_options") or {})}
    if splitting_ops is None:
        splitting_ops = ("sdpa",)
        if full:  # the decode trace whole (one graph a step), the prompt trace's pieces deduped
            options.setdefault("whole_traces", {"seq": 1})
    fast = ShapewiseModule(model.forward, sizes=sizes, ranges=ranges, dynamic_dims=dims,
                           splitting_ops=splitting_ops, **options)
    if grows:
        fast.after_call = _settle_cache(cache_arg)
    if cache_arg is not None:
        fast.miss_note = _whole_sequence_note(cache_arg)
    fast.static_cache = static_cache  # the cache generate() uses: what was asked, or the dynamic one (above)
    model.forward = fast
    # Borrowing needs a static cache: a dynamic cache's tensors are the forward's outputs (a
    # prefill graph's buffers, which a cache returned or passed in would keep past the call).
    # Both wrap transformers' own generate() only, not one the model already replaced (Hub code).
    borrow = bool(cudagraphs_options(options.get("cudagraphs", False))) and static_cache
    own_generate = not hasattr(model, "generate") or "generate" in vars(model)
    asked_keep = keep_cache is not None
    if keep_cache is None:  # where steps replay CUDA graphs: a new cache per call would move their inputs
        keep_cache = borrow
    for name, on in (("graph_masks", graph_masks), ("keep_cache", keep_cache if asked_keep else False)):
        if on and not static_cache:
            log.warning("shapewise: compile_generate(%s=True) does nothing without a static cache%s", name,
                        ": transformers builds masks outside the forward only for one" if name == "graph_masks" else "")
        elif on and own_generate:
            log.warning("shapewise: compile_generate(%s=True) does nothing for a model whose generate() is not "
                        "transformers' own", name)
    graph_masks, keep_cache = graph_masks and static_cache, keep_cache and static_cache
    if (borrow or defer_stop or graph_masks or keep_cache) and not own_generate:
        model.generate = _shapewise_generate(model, borrow=borrow, defer_stop=defer_stop, graph_masks=graph_masks,
                                             keep_cache=keep_cache, keep_asked=asked_keep)
    return fast
