"""Train a small causal LM on packed sequences, with one static compile per token-count bucket.

Each step packs a few synthetic documents of random lengths into one flat token stream, so
its token count varies from step to step. The steps' token counts are padded up to a small
ladder of buckets that ``shapewise.plan_sizes`` picks from the counts this data produces
(the fewest padded tokens for at most ``--buckets`` sizes). ``shapewise.compile`` traces the
model once and compiles, per bucket, a static forward and backward of every piece between
the attention calls; attention is a custom op with its own autograd formula (per-document
causal masking), run between the compiled pieces. Then an ordinary AdamW loop.

    python examples/train_packed.py                 # CPU, Inductor, a few minutes
    python examples/train_packed.py --tiny          # a few seconds after the compiles
    python examples/train_packed.py --device cuda   # on a GPU
    python examples/train_packed.py --model hf-llama --tiny   # a transformers LlamaForCausalLM

With ``--model hf-llama`` the model is transformers' ``LlamaForCausalLM`` (random weights,
SDPA attention, split there), fed the packed stream as ``input_ids`` / ``position_ids`` /
``labels`` of shape ``[1, T]``: positions restart at every document, from which transformers
builds the per-document causal mask; the loss is the model's own.

The synthetic task: a document starts with a marker token that fixes its stride; every next
token is the previous one plus that stride (mod the alphabet). Predicting it needs attention
to the document's own first token, so attention that leaks across packed documents would hurt.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shapewise as sw  # noqa: E402

ATTENTION = "train_packed::attention"
IGNORE = -100  # cross_entropy's ignore_index: padding and each document's last token


# -- attention over packed documents: a custom op with an autograd formula ---------------------
def _packed_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Causal attention within each document of a packed stream: [T, H, D] (+ doc ids [T])."""
    t = q.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    mask = causal & (doc[:, None] == doc[None, :])
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


@torch.library.custom_op(ATTENTION, mutates_args=())
def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Stands for a fused varlen attention kernel (flash-attention style): shapewise splits here."""
    return _packed_sdpa(q, k, v, doc).contiguous()


@packed_attention.register_fake
def _(q, k, v, doc):
    torch._check(doc.shape[0] == q.shape[0])  # one token count: doc's size is the same symbol
    return torch.empty_like(q)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    q, k, v, doc = ctx.saved_tensors
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
        dq, dk, dv = torch.autograd.grad(_packed_sdpa(q_, k_, v_, doc), (q_, k_, v_), grad)
    return dq, dk, dv, None


packed_attention.register_autograd(_backward, setup_context=_setup)


# -- a small Llama-style model over flattened tokens --------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, self.head_dim).unbind(1)
        a = torch.ops.train_packed.attention(rotate(q, cos, sin), rotate(k, cos, sin), v, doc)
        x = x + self.o(a.reshape(t, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PackedLM(nn.Module):
    """(ids, positions within their document, document ids, targets), all ``[T]`` → mean loss."""

    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        hd = dim // heads
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), persistent=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        angles = (pos[:, None].float() * self.inv_freq)[:, None, :]  # [T, 1, hd/2]
        x = self.embed(ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, doc)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits, targets, ignore_index=IGNORE)


# -- synthetic packed data ------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One packed step: flat token stream ``[T]`` and what the model needs besides it."""

    ids: np.ndarray
    pos: np.ndarray
    doc: np.ndarray
    targets: np.ndarray

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def padded(self, size: int, device: str) -> tuple[torch.Tensor, ...]:
        """Tensors padded to ``size`` tokens: pad tokens form their own document, ignored by the loss."""
        pad = size - self.tokens
        cols = [(self.ids, 0), (self.pos, 0), (self.doc, -1), (self.targets, IGNORE)]
        return tuple(torch.from_numpy(np.concatenate([a, np.full(pad, fill, dtype=np.int64)])).to(device)
                     for a, fill in cols)


def synthetic_steps(n: int, docs_per_step: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[Step]:
    """``n`` steps of ``docs_per_step`` documents each, lengths log-uniform in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    markers = 8  # the last 8 tokens are markers; marker m means stride m + 1
    alphabet = vocab - markers
    steps = []
    for _ in range(n):
        ids, pos, doc, targets = [], [], [], []
        for d in range(docs_per_step):
            length = int(round(math.exp(rng.uniform(math.log(min_len), math.log(max_len)))))
            marker = int(rng.integers(markers))
            body = (int(rng.integers(alphabet)) + (marker + 1) * np.arange(length - 1)) % alphabet
            tokens = np.concatenate([[alphabet + marker], body]).astype(np.int64)
            ids.append(tokens)
            pos.append(np.arange(length, dtype=np.int64))
            doc.append(np.full(length, d, dtype=np.int64))
            targets.append(np.concatenate([tokens[1:], [IGNORE]]).astype(np.int64))
        steps.append(Step(*(np.concatenate(c) for c in (ids, pos, doc, targets))))
    return steps


# -- the run --------------------------------------------------------------------------------
def bucket_report(rows: Sequence[dict[str, Any]]) -> list[tuple[str, int, float]]:
    """(bucket, compiled pieces, compile seconds) per bucket, from ``fast.report()`` rows."""
    seconds: dict[str, float] = {}
    pieces: Counter[str] = Counter()
    for r in rows:
        seconds[r["key"]] = seconds.get(r["key"], 0.0) + float(r["seconds"])
        pieces[r["key"]] += 1
    return [(k, pieces[k], s) for k, s in seconds.items()]


def hf_llama(vocab: int, dim: int, heads: int, hidden: int, layers: int, max_tokens: int) -> nn.Module:
    """transformers' LlamaForCausalLM with random weights, SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_tokens,
                         attention_dropout=0.0, use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def hf_batch(batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """A packed step as transformers takes it: ``[1, T]`` ids, per-document positions, and labels
    (the model shifts them itself: a document's first token, and padding, are not predicted)."""
    ids, pos, doc, _ = batch
    labels = torch.where((pos == 0) | (doc < 0), IGNORE, ids)
    return {"input_ids": ids[None], "position_ids": pos[None], "labels": labels[None]}


def loss_of(call: Any, batch: tuple[torch.Tensor, ...], hf: bool) -> torch.Tensor:
    return call(**hf_batch(batch)).loss if hf else call(*batch)


def check_against_eager(model: nn.Module, fast: Any, batch: tuple[torch.Tensor, ...], hf: bool = False) -> float:
    """Largest relative difference of the loss and every gradient, compiled vs eager."""
    ref = copy.deepcopy(model)
    loss, ref_loss = loss_of(fast, batch, hf), loss_of(ref, batch, hf)
    loss.backward()
    ref_loss.backward()
    worst = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        worst = max(worst, ((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12)).item())
    model.zero_grad(set_to_none=True)
    return worst


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model and data (CI)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor", help="inductor, aot_eager or eager")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--buckets", type=int, default=None, help="at most this many bucket sizes")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="packed", choices=("packed", "hf-llama"),
                    help="the model here (packed attention op) or transformers' LlamaForCausalLM")
    args = ap.parse_args(argv)
    if args.tiny:
        cfg = dict(vocab=40, dim=32, heads=2, hidden=64, layers=1)
        steps, docs, min_len, max_len, buckets, align, lr = 60, 3, 4, 24, 3, 8, 1e-2
    else:
        cfg = dict(vocab=72, dim=128, heads=4, hidden=256, layers=3)
        steps, docs, min_len, max_len, buckets, align, lr = 300, 4, 8, 160, 4, 64, 3e-3
    steps, buckets, lr = args.steps or steps, args.buckets or buckets, args.lr or lr
    torch.manual_seed(args.seed)

    data = synthetic_steps(steps, docs, min_len, max_len, cfg["vocab"], args.seed)
    observed = [s.tokens for s in data]
    top = -(-max(observed) // align) * align
    plan = sw.plan_sizes(observed, max_sizes=buckets, candidates=range(align, top + 1, align))
    print(f"token counts per step: {min(observed)}..{max(observed)}; buckets (multiples of {align}) from "
          f"shapewise.plan_sizes: {list(plan.sizes)}, padding {plan.waste:.1%} of the padded tokens")
    print(plan.table())

    hf = args.model == "hf-llama"
    if hf:
        model = hf_llama(**cfg, max_tokens=max(plan.sizes)).to(args.device).train()
        tokens = {name: {1: "tokens"} for name in ("input_ids", "position_ids", "labels")}
        fast = sw.compile(model, dynamic_dims=tokens, sizes=list(plan.sizes), splitting_ops=["sdpa"],
                          backend=args.backend)
    else:
        model = PackedLM(**cfg).to(args.device)
        tokens = {name: {0: "tokens"} for name in ("ids", "pos", "doc", "targets")}
        fast = sw.compile(model, dynamic_dims=tokens, sizes=list(plan.sizes), splitting_ops=[ATTENTION],
                          backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    first = data[0].padded(plan.bucket_of(data[0].tokens), args.device)
    t0 = time.perf_counter()
    worst = check_against_eager(model, fast, first, hf)  # the first call traces once and compiles every bucket
    compile_s = time.perf_counter() - t0
    print(f"traced {fast.traces}x, compiled {len(plan.sizes)} buckets in {compile_s:.1f} s "
          f"({args.backend}); step 0 loss and grads vs eager: max rel. diff {worst:.1e}")
    print(f"{'bucket':>16}  {'pieces':>6}  {'compile s':>9}  (each piece: forward + backward)")
    for key, n, s in bucket_report(list(fast.report())):
        print(f"{key:>16}  {n:>6}  {s:>9.2f}")

    losses, times, used = [], [], Counter()
    for i, step in enumerate(data):
        size = plan.bucket_of(step.tokens)
        used[size] += 1
        batch = step.padded(size, args.device)
        t = time.perf_counter()
        loss = loss_of(fast, batch, hf)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
        if i % max(1, steps // 10) == 0 or i == steps - 1:
            print(f"step {i:4d}  tokens {step.tokens:5d} -> bucket {size:5d}  loss {losses[-1]:.3f}  "
                  f"{times[-1] * 1e3:6.1f} ms")
    k = max(1, steps // 10)
    start, end = statistics.mean(losses[:k]), statistics.mean(losses[-k:])
    print(f"loss {start:.3f} -> {end:.3f} (mean of the first / last {k} steps); steps per bucket "
          f"{dict(sorted(used.items()))}; median step {statistics.median(times) * 1e3:.1f} ms; "
          f"Dynamo traces: {fast.traces}")
    return {"losses": losses, "buckets": list(plan.sizes), "traces": fast.traces, "compile_s": compile_s,
            "max_rel_diff": worst, "steps_per_bucket": dict(used), "loss_start": start, "loss_end": end}


if __name__ == "__main__":
    main()
