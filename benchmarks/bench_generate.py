"""Greedy decoding with transformers' ``generate()``: eager, transformers' own compile recipe,
and shapewise, side by side in one process on one GPU.

Model: ``LlamaForCausalLM`` with random weights and Llama-3.2-1B shapes (hidden 2048, 16 layers,
32 heads, 8 KV heads, MLP 8192, vocab 128256), bf16, SDPA attention. Prompt 128 tokens,
256 new tokens, greedy (``do_sample=False``, ``min_new_tokens`` so no contender stops early).

Contenders (each on its own copy of the same weights):
  eager             ``model.generate`` with the default dynamic cache;
  hf_recipe         transformers' own recipe: ``cache_implementation="static"``, with which
                    ``generate()`` compiles the forward itself (``torch.compile``,
                    mode="reduce-overhead", fullgraph=True: its ``CompileConfig``);
  shapewise         ``sw.compile_generate(model, prompt_sizes=[128], max_length=384,
                    static_cache=True, cudagraphs="full")``: one trace for prefill, one for
                    decode, each static, each in a CUDA graph;
  shapewise_dyncache  the default dynamic cache (decode symbolic in the KV length), no graphs;
  shapewise_frame / shapewise_dyncache_frame  the same with ``direct_call=False``: every decode
                    step through Dynamo's frame and its guards (compile_generate's calls go past
                    it by default).

``--dtensor``: every contender's weights as DTensors (torch.distributed.tensor.parallel's
colwise / rowwise plan on a mesh of this one GPU, NCCL world size 1), as a tensor-parallel rank
holds them: Dynamo's guards then check each weight's DTensor spec on every call.

Per contender: the first ``generate()``'s wall time (compiles + capture + one generation),
time to first token (median of ``generate(max_new_tokens=1)``), decode tokens/s (median of
full generations: 255 tokens over the time past the first token), the Dynamo traces, and
the relative error of its first step's logits (prefill) against eager's, and whether its
tokens equal eager's (and the first position where they differ: random weights give
near-tied logits, so a compiled kernel's bf16 rounding can flip an argmax, after which the
sequences part).

    PYTHONPATH=. python3 benchmarks/bench_generate.py --out /tmp/gen
    PYTHONPATH=. python3 benchmarks/bench_generate.py --dtensor --out /tmp/gen-dtensor
    python3 benchmarks/bench_generate.py --device cpu --tiny --out /tmp/gen-cpu   # smoke test
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shapewise as sw  # noqa: E402
from shapewise._compat import dynamo_unique_graphs  # noqa: E402

CONTENDERS = ("eager", "hf_recipe", "shapewise", "shapewise_frame", "shapewise_dyncache", "shapewise_dyncache_frame")


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0,
                tie_word_embeddings=True)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def llama(shape: dict[str, Any], device: str, dtype: torch.dtype, layers: int | None = None):
    """A ``LlamaForCausalLM`` of config ``shape`` with random weights (seed 0), SDPA, no EOS."""
    import transformers

    cfg = transformers.LlamaConfig(**shape)
    if layers:
        cfg.num_hidden_layers = layers
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 1B model's fp32 init on the CPU takes ~30 s
        model = transformers.LlamaForCausalLM(cfg).to(dtype=dtype).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


def make_model(tiny: bool, device: str, dtype: torch.dtype, layers: int | None):
    return llama(TINY if tiny else LLAMA_1B, device, dtype, layers)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def prepare(name: str, model, prompt: int, new: int, cudagraphs: bool) -> Any:
    """Set ``model`` up as contender ``name``; returns the shapewise module (or None)."""
    if name == "hf_recipe":
        from transformers import CompileConfig

        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    elif name in ("shapewise", "shapewise_frame"):
        return sw.compile_generate(model, prompt_sizes=[prompt], max_length=prompt + new, static_cache=True,
                                   backend="inductor", cudagraphs="full" if cudagraphs else False, progress=False,
                                   direct_call=name == "shapewise")
    elif name in ("shapewise_dyncache", "shapewise_dyncache_frame"):
        return sw.compile_generate(model, prompt_sizes=[prompt], max_length=prompt + new, backend="inductor",
                                   progress=False, direct_call=name == "shapewise_dyncache")
    return None


def parallelize(model: torch.nn.Module, device: str) -> None:
    """DTensor weights: torch's tensor-parallel plan on a mesh of one device (world size 1)."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.distributed.tp_worker import parallelize_one

    if not dist.is_initialized():
        import os

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    parallelize_one(model, torch.device(device, 0) if device == "cuda" else torch.device(device))


def run_contender(name: str, base, ids: torch.Tensor, args: argparse.Namespace, expected: Any):
    device = args.device
    model = copy.deepcopy(base)
    if args.dtensor:
        parallelize(model, device)
    torch._dynamo.reset()
    graphs0 = dynamo_unique_graphs()
    fast = prepare(name, model, ids.shape[1], args.new, device == "cuda")
    kw = dict(do_sample=False, max_new_tokens=args.new, min_new_tokens=args.new)
    with torch.no_grad():
        first_s, first = timed(lambda: model.generate(ids, **kw, return_dict_in_generate=True, output_logits=True),
                               device)
        logits0 = first.logits[0].float()
        ttft = [timed(lambda: model.generate(ids, do_sample=False, max_new_tokens=1, min_new_tokens=1), device)[0]
                for _ in range(args.repeats)]
        full = []
        for _ in range(args.repeats):
            s, out = timed(lambda: model.generate(ids, **kw), device)
            full.append(s)
    t_first, t_full = statistics.median(ttft), statistics.median(full)
    row = {
        "contender": name,
        "first_generate_s": round(first_s, 2),
        "ttft_ms": round(1e3 * t_first, 2),
        "generate_ms": round(1e3 * t_full, 1),
        "decode_tokens_per_s": round((args.new - 1) / max(t_full - t_first, 1e-9), 1),
        "dynamo_graphs": dynamo_unique_graphs() - graphs0,
        "tokens": out[0, ids.shape[1]:].tolist(),
    }
    if fast is not None:
        row["shapewise_traces"] = fast.traces
        row["direct_info"], row["direct_calls"] = fast.direct_info, fast.direct_calls
        row["shapewise_variants"] = [f"{r['trace']} {r['piece']} {r['key']}" if "trace" in r else r["key"]
                                     for r in fast.report()][:64]
    if expected is not None:
        (exp, exp_logits0), got = expected, out[0, ids.shape[1]:]
        same = torch.equal(got, exp)
        row["same_tokens_as_eager"] = same
        row["first_difference"] = None if same else int((got != exp).nonzero()[0, 0])
        row["prefill_logits_rel_err"] = float((logits0 - exp_logits0).norm() / exp_logits0.norm())
    return row, (out[0, ids.shape[1]:], logits0)


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Greedy generate(): {result['model']}", "",
             f"{result['hardware']}; torch {result['torch']}, transformers {result['transformers']}; "
             f"{result['date']}. Prompt {result['prompt']} tokens, {result['new']} new tokens, batch 1, "
             f"medians of {result['repeats']} runs after one warm-up generation.", "",
             "| contender | decode tokens/s | vs hf_recipe | time to first token (ms) | first generate() (s) "
             "| Dynamo graphs | direct calls | prefill logits rel. err. vs eager | same tokens as eager |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    rows = [r for r in result["rows"] if "error" not in r]
    base = next((r["decode_tokens_per_s"] for r in rows if r["contender"] == "hf_recipe"), None)
    for r in rows:
        ratio = f"{r['decode_tokens_per_s'] / base:.2f}x" if base else "-"
        same = "yes" if r.get("same_tokens_as_eager", True) else f"no (from token {r['first_difference']})"
        err = f"{r['prefill_logits_rel_err']:.1e}" if "prefill_logits_rel_err" in r else "-"
        lines.append(f"| {r['contender']} | {r['decode_tokens_per_s']:,} | {ratio} | {r['ttft_ms']} | "
                     f"{r['first_generate_s']} | {r['dynamo_graphs']} | {r.get('direct_calls', '-')} | {err} "
                     f"| {same} |")
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['contender']} | failed: {r['error'][:150]} | | | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--dtensor", action="store_true", help="every contender's weights as DTensors (world size 1)")
    args = ap.parse_args(argv)
    import transformers

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    base = make_model(args.tiny, args.device, dtype, args.layers)
    nparams = sum(p.numel() for p in base.parameters())
    ids = torch.randint(0, base.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    hardware = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    result: dict[str, Any] = {
        "model": f"LlamaForCausalLM, {'tiny' if args.tiny else 'Llama-3.2-1B shapes'}, "
                 f"{base.config.num_hidden_layers} layers, {nparams / 1e6:.0f}M parameters, {str(dtype)[6:]}"
                 + (", DTensor weights (TP plan, world size 1)" if args.dtensor else ""),
        "hardware": hardware, "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "prompt": args.prompt, "new": args.new, "repeats": args.repeats, "rows": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    expected = None
    for name in args.contenders.split(","):
        try:
            row, tokens = run_contender(name, base, ids, args, expected)
            if name == "eager":
                expected = tokens
        except Exception as e:  # noqa: BLE001 - a failed contender is a result, not the end of the run
            traceback.print_exc()
            row = {"contender": name, "error": f"{type(e).__name__}: {e}"}
        result["rows"].append(row)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        (out / "results.md").write_text(markdown(result))
        print({k: v for k, v in row.items() if k not in ("tokens", "shapewise_variants")}, flush=True)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
