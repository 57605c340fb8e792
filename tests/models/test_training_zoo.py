"""Training through ``sw.compile`` on transformers models (tiny random configs, SDPA attention,
dropout 0, float32, ``.train()``): at every size, exact or inside a range, the loss and every
parameter gradient match eager; then one AdamW step updates the parameters as eager's does, and
the compiled model's next call sees the new weights."""

from __future__ import annotations

import copy

import pytest
import torch

import shapewise as sw
from tests.helpers import assert_same

T = pytest.importorskip("transformers")

from tests.models.configs import VOCAB, ZOO  # noqa: E402 - config factories (hidden 32, 2 layers, 4 heads)

BATCH = 2
LM_DIMS = {"input_ids": 1, "labels": 1}


def lm_inputs(t: int) -> dict:
    ids = torch.randint(3, VOCAB, (BATCH, t))
    return {"input_ids": ids, "labels": ids}


def mlm_inputs(t: int) -> dict:
    ids = torch.randint(3, VOCAB, (BATCH, t))
    keep = torch.rand(BATCH, t) < 0.15  # the 15% of positions that carry a label; the rest are -100
    keep[:, 0] = True  # at least one labelled position per row: the loss is never a mean over nothing
    mask = torch.ones(BATCH, t, dtype=torch.long)
    mask[1, t - 3:] = 0  # row 1 padded at the end
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(~keep, -100)}


def seq2seq_inputs(src_tgt: tuple[int, int]) -> dict:
    src, tgt = src_tgt
    return {"input_ids": torch.randint(3, VOCAB, (BATCH, src)), "labels": torch.randint(3, VOCAB, (BATCH, tgt))}


T5_OPTIONS = dict(dynamic_dims={"input_ids": {1: "src"}, "labels": {1: "tgt"}},
                  sizes={"src": [8, 16], "tgt": [4, 8]}, ranges={"src": [(17, 32)]})
T5_CALLS = ((8, 4), (16, 8), (8, 8), (16, 4), (24, 4), (32, 8))  # (src, tgt); src 24 and 32 in the range

# name -> (zoo config, model class, inputs(size), sw.compile options, sizes to call)
CASES = {
    **{name: (name, cls, lm_inputs, dict(dynamic_dims=LM_DIMS, sizes=[8, 16], ranges=[(17, 40)]),
              (8, 16, 17, 29, 40))
       for name, cls in (("llama", T.LlamaForCausalLM), ("qwen2", T.Qwen2ForCausalLM), ("gpt2", T.GPT2LMHeadModel))},
    "bert_mlm": ("bert", T.BertForMaskedLM, mlm_inputs,
                 dict(dynamic_dims={**LM_DIMS, "attention_mask": 1}, sizes=[8, 16], ranges=[(17, 40)]),
                 (8, 16, 17, 29, 40)),
    # T5's learned relative position bias is SDPA's float attn_mask; on CPU SDPA lays its output
    # out otherwise when the mask needs grad, which shapewise's layout observation must see (it
    # did not, and the piece after attention was compiled for the other layout).
    "t5": ("t5", T.T5ForConditionalGeneration, seq2seq_inputs, T5_OPTIONS, T5_CALLS),
}


def build(zoo_name: str, cls) -> torch.nn.Module:
    config = ZOO[zoo_name][0]()
    config._attn_implementation = "sdpa"
    for key, value in config.to_dict().items():  # every dropout probability to 0: eager is deterministic
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    model = cls(config).train()
    if model.loss_type is None:
        # GPT2LMHeadModel: no loss matches its class name, and the fallback to ForCausalLM calls
        # logger.warning_once, which Dynamo cannot trace in one graph; name the same loss outright.
        model.loss_type = "ForCausalLM"
    return model


def loss_and_grads(model: torch.nn.Module, call, inputs: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = call(**inputs).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", list(CASES))
def test_training_matches_eager(case):
    zoo_name, cls, make_inputs, options, calls = CASES[case]
    model = build(zoo_name, cls)
    ref = copy.deepcopy(model)  # the eager side: same initial weights
    fast = sw.compile(model, splitting_ops=["sdpa"], backend="aot_eager", **options)
    for size in calls:
        inputs = make_inputs(size)
        loss, grads = loss_and_grads(model, fast, inputs)
        ref_loss, ref_grads = loss_and_grads(ref, ref, inputs)
        assert_same(loss, ref_loss, f"{case} {size} loss")
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert g is not None, f"{case} {size}: no gradient reached {name}"
            assert_same(g, ref_grads[name], f"{case} {size} grad {name}")

    # One AdamW step from the last call's gradients, then a call with the updated weights.
    for m in (model, ref):
        torch.optim.AdamW(m.parameters(), lr=1e-3).step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), f"{case} {name} after the step")
    inputs = make_inputs(calls[0])
    assert_same(fast(**inputs).loss, ref(**inputs).loss, f"{case} loss after the step")
    assert fast.traces == 1  # no call at length 1 (which transformers' SDPA path guards on), no grad-mode change
