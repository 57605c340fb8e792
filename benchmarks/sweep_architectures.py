"""Every causal-LM architecture transformers ships, tried as a new user would: a tiny random config
from each config class (fp32, SDPA where the model has it, ``aot_eager``), then

- forward: ``sw.compile(m, dynamic_dims={"input_ids": 1}, sizes=[1, 4, 16], ranges=[(17, 64)],
  splitting_ops=["sdpa"])`` against eager at lengths 4, 1, 16, 33, 64;
- generate: ``sw.compile_generate(m, prompt_sizes=[12], max_length=32)`` and 8 greedy tokens against
  eager ``generate()`` (tokens and per-step logits), with the number of Dynamo traces it took.

One line per architecture; each architecture runs in a process of its own (a timeout and a memory
limit, so one model cannot stop the sweep). ``--out DIR`` writes ``sweep.jsonl`` and ``summary.md``.

    python benchmarks/sweep_architectures.py --out benchmarks/results/sweep_cpu           # all
    python benchmarks/sweep_architectures.py llama mistral qwen3_next                     # some
    python benchmarks/sweep_architectures.py --parts generate --fuse-projections           # FuseProjections on
    python benchmarks/sweep_architectures.py --parts generate --grouped-decode             # GroupedDecodeAttention on
    python benchmarks/sweep_architectures.py --parts generate --static-cache --warm-start  # saved traces reloaded
    python benchmarks/sweep_architectures.py --parts generate --static-cache --keep-cache  # one cache, kept
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SIZES = [1, 4, 16]
RANGES = [(17, 64)]
FORWARD_LENGTHS = [4, 1, 16, 33, 64]
PROMPT, MAX_LENGTH, NEW_TOKENS = 12, 32, 8

# Attributes a tiny config sets where the config class has them (on it and its sub-configs).
TINY = {
    "vocab_size": 128, "hidden_size": 32, "n_embd": 32, "d_model": 32, "embed_dim": 32, "dim": 32,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "d_ff": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
    "n_layers": 2, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128, "n_positions": 128,
    "n_ctx": 128, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "sliding_window": 8, "attention_chunk_size": 8,
    # multi-head latent attention (DeepSeek-style), its indexer, linear attention and SSM layers
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 16,
    "index_n_heads": 4, "index_head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "mamba_n_heads": 4, "mamba_d_head": 8,
    "mamba_expand": 1, "expand": 1, "mamba_d_state": 8, "ssm_state_size": 8, "state_size": 8,
    "mamba_n_groups": 1, "n_groups": 1, "time_step_rank": 4, "qk_head_dim": 16, "n_group": 1, "topk_group": 1,
}
LAYER_LISTS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern")


def tiny_config(model_type: str) -> Any:
    import transformers as T

    cfg = T.AutoConfig.for_model(model_type)

    def shrink(c: Any, depth: int = 0) -> None:
        before = dict(c.__dict__)
        for k, v in TINY.items():
            if k in before and isinstance(before[k], int) and not isinstance(before[k], bool):
                if k == "num_key_value_heads" and before.get("num_key_value_heads") == before.get(
                        "num_attention_heads"):
                    v = 4  # multi-head (and latent) attention keeps a key/value head per query head
                setattr(c, k, v)
        for k in LAYER_LISTS:  # per-layer lists follow the layer count
            v = c.__dict__.get(k)
            if isinstance(v, (list, tuple)) and len(v) > 2:
                kinds = list(dict.fromkeys(v))[:2]
                setattr(c, k, type(v)(kinds + kinds[:2 - len(kinds)] if len(kinds) < 2 else kinds))
            elif isinstance(v, str) and len(v) > 2:
                setattr(c, k, v[:2])
        if depth < 2:
            for v in list(c.__dict__.values()):
                if isinstance(v, T.PretrainedConfig):
                    shrink(v, depth + 1)

    shrink(cfg)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, k, None) is not None and isinstance(getattr(cfg, k), int) and getattr(cfg, k) >= 128:
            setattr(cfg, k, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}[k])
    return cfg


def build(model_type: str) -> Any:
    import copy

    import torch
    import transformers as T
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES

    cfg = tiny_config(model_type)
    cls = getattr(T, NAMES[model_type])
    torch.manual_seed(0)
    try:
        model = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    except (ValueError, ImportError):
        torch.manual_seed(0)
        model = cls._from_config(cfg)
    return model.eval()


def _close(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4)


def check(model_type: str, parts: tuple[str, ...] = ("forward", "generate")) -> dict[str, Any]:
    """One architecture: {"arch", "forward", "generate", "traces", "error"} (``forward`` / ``generate``:
    "ok", "wrong", "error", "eager-fails" or "skipped")."""
    import copy

    import torch

    import shapewise as sw

    row: dict[str, Any] = {"arch": model_type, "forward": "skipped", "generate": "skipped", "traces": None,
                           "error": None}
    try:
        model = build(model_type)
    except Exception as e:  # noqa: BLE001
        row.update(forward="build-fails", generate="build-fails", error=_err(e))
        return row
    vocab = getattr(model.config.get_text_config(), "vocab_size", 128) or 128
    gen = torch.Generator().manual_seed(0)
    if "forward" in parts:
        row["forward"] = "error"
        try:
            ids = {t: torch.randint(3, min(vocab, 128), (1, t), generator=gen) for t in FORWARD_LENGTHS}
            with torch.no_grad():
                try:
                    expected = {t: model(input_ids=x, use_cache=False).logits for t, x in ids.items()}
                except Exception as e:  # noqa: BLE001
                    row.update(forward="eager-fails", generate="eager-fails", error=_err(e))
                    return row
                fast = sw.compile(model, dynamic_dims={"input_ids": 1}, sizes=SIZES, ranges=RANGES,
                                  splitting_ops=["sdpa"], backend="aot_eager")
                wrong = [t for t, x in ids.items() if not _close(fast(input_ids=x, use_cache=False).logits,
                                                                 expected[t])]
            row["forward"] = "wrong" if wrong else "ok"
            row["forward_traces"] = fast.traces
            if wrong:
                row["error"] = f"logits differ at lengths {wrong}"
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
    if "generate" in parts:
        row["generate"] = "error"
        try:
            model = build(model_type)
            prompts = [torch.randint(3, min(vocab, 128), (1, PROMPT), generator=gen) for _ in range(2)]
            run = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                       return_dict_in_generate=True, output_logits=True)
            try:
                expected = [model.generate(p, **run) for p in prompts]
            except Exception as e:  # noqa: BLE001
                row.update(generate="eager-fails")
                row["error"] = row["error"] or _err(e)
                return row
            eager_model = copy.deepcopy(model)  # noqa: F841 - keeps the weights if compile_generate mutates
            extra = {"fuse_projections": True} if os.environ.get("SWEEP_FUSE_PROJECTIONS") == "1" else {}
            if os.environ.get("SWEEP_GROUPED_DECODE") == "1":  # unsplit, so the pass sees the attention
                extra.update(graph_passes=[sw.library.GroupedDecodeAttention()], splitting_ops=())
            if os.environ.get("SWEEP_STATIC_CACHE") == "1":
                extra["static_cache"] = True
            if os.environ.get("SWEEP_KEEP_CACHE") == "1":  # generate()'s default where steps replay CUDA graphs
                extra["keep_cache"] = True
            warm_dir = os.environ.get("SWEEP_WARM_START")
            if warm_dir:  # a cold start that saves its traces, then a second start that should load them
                extra.update(warm_start=True, cache=os.path.join(warm_dir, model_type))
            fast = sw.compile_generate(model, prompt_sizes=[PROMPT], max_length=MAX_LENGTH, backend="aot_eager",
                                       **extra)
            bad = _wrong_prompts(model, prompts, expected, run)
            row["traces"] = fast.traces
            if "static_cache" in extra:  # what compile_generate chose (a model marked not compilable: dynamic)
                row["static_cache"] = fast.static_cache
            if warm_dir:
                row["warm_cold_info"] = fast.warm_info
                torch._dynamo.reset()
                model = build(model_type)  # the same weights (seeded), a fresh object: as a new process has it
                again = sw.compile_generate(model, prompt_sizes=[PROMPT], max_length=MAX_LENGTH,
                                            backend="aot_eager", **extra)
                bad += _wrong_prompts(model, prompts, expected, run)
                row["warm_info"] = again.warm_info
                row["warm_loaded"] = again.warm_info.startswith("warm start:") and "loaded from" in again.warm_info
                row["warm_direct"], row["warm_direct_calls"] = again.direct_info, again.direct_calls
            row["generate"] = "wrong" if bad else "ok"
            if os.environ.get("SWEEP_GROUPED_DECODE") == "1":  # attentions the pass rewrote, over every variant
                row["grouped_decode_rewrites"] = sum(
                    n.meta.get("shapewise_rewrite") == "grouped_decode_attention" for r in fast.runnables
                    for p in r.program.compute_pieces for v in p.variants if v.gm is not None for n in v.gm.graph.nodes)
            row["direct"] = fast.direct_info
            if bad:
                row["error"] = row["error"] or "tokens or logits differ from eager generate()"
        except Exception as e:  # noqa: BLE001
            row["error"] = row["error"] or _err(e)
    return row


def _wrong_prompts(model: Any, prompts: list[Any], expected: list[Any], run: dict[str, Any]) -> list[int]:
    """The prompt lengths whose ``generate()`` tokens or per-step logits differ from eager's."""
    import torch

    bad = []
    for p, e in zip(prompts, expected):
        got = model.generate(p, **run)
        if not torch.equal(got.sequences, e.sequences) or not all(_close(a, b) for a, b in zip(got.logits, e.logits)):
            bad.append(p.shape[1])
    return bad


def _err(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    loc = f" @ {Path(where.filename).name}:{where.lineno}" if where else ""
    return f"{type(e).__module__}.{type(e).__name__}: {first}{loc}"


def _child(model_type: str, parts: tuple[str, ...], q: Any, mem_gb: float) -> None:
    if mem_gb:
        resource.setrlimit(resource.RLIMIT_AS, (int(mem_gb * 2**30),) * 2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    try:
        q.put(check(model_type, parts))
    except BaseException as e:  # noqa: BLE001
        q.put({"arch": model_type, "forward": "error", "generate": "error", "traces": None, "error": _err(e)})


def run_one(model_type: str, parts: tuple[str, ...], timeout: float, mem_gb: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(model_type, parts, q, mem_gb))
    t0 = time.perf_counter()
    p.start()
    try:
        row = q.get(timeout=timeout)
    except Exception:  # noqa: BLE001
        row = {"arch": model_type, "forward": "timeout", "generate": "timeout", "traces": None,
               "error": f"no result in {timeout:.0f} s (exit code {p.exitcode})"}
    p.join(5)
    if p.is_alive():
        p.kill()
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def fixed_traces(row: dict[str, Any]) -> bool:
    """Generate right from a fixed number of traces: one prefill and one decode trace (a cache kind
    that needs a trace of its own may add one); 8 new tokens never take 8 traces."""
    return row["generate"] == "ok" and row.get("traces") is not None and row["traces"] <= 3


def summary(rows: list[dict[str, Any]]) -> str:
    runs = [r for r in rows if r["forward"] not in ("build-fails", "eager-fails")]
    fwd_ok = sum(r["forward"] == "ok" for r in runs)
    gens = [r for r in runs if r["generate"] not in ("eager-fails", "build-fails", "skipped")]
    gen_ok = sum(r["generate"] == "ok" for r in gens)
    fixed = sum(fixed_traces(r) for r in gens)
    pct = lambda a, b: f"{100 * a / b:.0f}%" if b else "-"
    lines = [
        f"- architectures: {len(rows)}; build and run eagerly: {len(runs)}",
        f"- forward right at every size: {fwd_ok} / {len(runs)} ({pct(fwd_ok, len(runs))})",
        f"- generate eagerly: {len(gens)}; compile_generate right: {gen_ok} / {len(gens)} ({pct(gen_ok, len(gens))})",
        f"- right from a fixed number of traces (<= 3): {fixed} / {len(gens)} ({pct(fixed, len(gens))})",
        "",
        "| arch | forward | generate | traces | error |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        err = (r.get("error") or "").replace("|", "\\|")[:160]
        lines.append(f"| {r['arch']} | {r['forward']} | {r['generate']} | {r.get('traces') or ''} | {err} |")
    return "\n".join(lines) + "\n"


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archs", nargs="*", help="model types (default: every causal-LM architecture)")
    ap.add_argument("--out", type=Path, help="folder for sweep.jsonl and summary.md")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--mem-gb", type=float, default=8)
    ap.add_argument("--parts", default="forward,generate")
    ap.add_argument("--fuse-projections", action="store_true",
                    help="compile_generate(fuse_projections=True): its default is off without CUDA graphs")
    ap.add_argument("--grouped-decode", action="store_true",
                    help="compile_generate(graph_passes=[GroupedDecodeAttention()], splitting_ops=())")
    ap.add_argument("--static-cache", action="store_true", help="compile_generate(static_cache=True)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="compile_generate(keep_cache=True): one static cache kept across calls (with --static-cache)")
    ap.add_argument("--warm-start", action="store_true",
                    help="compile_generate(warm_start=True): a cold start, then a second start that loads its traces")
    ap.add_argument("--update", action="store_true",
                    help="with --out: replace only the rows of the architectures run, keep the others")
    args = ap.parse_args(argv)
    archs = args.archs or architectures()
    parts = tuple(args.parts.split(","))
    if args.fuse_projections:
        os.environ["SWEEP_FUSE_PROJECTIONS"] = "1"  # read by each architecture's child process
    if args.grouped_decode:
        os.environ["SWEEP_GROUPED_DECODE"] = "1"
    if args.static_cache:
        os.environ["SWEEP_STATIC_CACHE"] = "1"
    if args.keep_cache:
        os.environ["SWEEP_KEEP_CACHE"] = "1"
    if args.warm_start:
        import tempfile

        os.environ["SWEEP_WARM_START"] = tempfile.mkdtemp(prefix="sweep_warm_")
    import transformers

    print(f"# {len(archs)} architectures, transformers {transformers.__version__}", flush=True)
    rows: list[dict[str, Any]] = []
    from concurrent.futures import ThreadPoolExecutor

    commit = _commit()

    with ThreadPoolExecutor(args.jobs) as pool:
        for row in pool.map(lambda a: run_one(a, parts, args.timeout, args.mem_gb), archs):
            row["commit"] = commit
            rows.append(row)
            print(f"{row['arch']:<28} forward={row['forward']:<11} generate={row['generate']:<11} "
                  f"traces={row.get('traces')!s:<4} {row['seconds']:>6.1f}s  {row.get('error') or ''}"
                  + (f" rewrites={row['grouped_decode_rewrites']}" if "grouped_decode_rewrites" in row else "")
                  + (f" warm_loaded={row['warm_loaded']} ({row['warm_info'][:160]})" if "warm_info" in row else ""),
                  flush=True)
    print(summary(rows).split("\n\n")[0])
    if args.out and args.update and (args.out / "sweep.jsonl").exists():
        new = {r["arch"]: r for r in rows}
        old = [json.loads(line) for line in (args.out / "sweep.jsonl").read_text().splitlines() if line.strip()]
        rows = [new.pop(r["arch"], r) for r in old] + list(new.values())
    text = summary(rows)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        import torch

        commits = sorted({r.get("commit") or "?" for r in rows})
        head = (f"# Architecture sweep\n\ntransformers {transformers.__version__}, torch {torch.__version__}, "
                f"CPU, fp32, aot_eager; `python benchmarks/sweep_architectures.py --out {args.out}`; each row was "
                f"run at the commit in its `commit` field of sweep.jsonl (here: {', '.join(commits)})\n\n")
        (args.out / "summary.md").write_text(head + text)


if __name__ == "__main__":
    sys.exit(main())
