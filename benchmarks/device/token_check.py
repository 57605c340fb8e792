"""Device script: do compile_generate's bf16 tokens differ from eager's on the 1B shapes because of
numerics (the step where they part has eager's top two logits within bf16 noise) or because of the
generate loop (defer_stop: the same compiled forward through transformers' own loop gives other tokens)?

    PYTHONPATH=. python3 benchmarks/device/token_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import shapewise as sw  # noqa: E402
from benchmarks.bench_generate import LLAMA_1B, llama  # noqa: E402


def main() -> None:
    model = llama(LLAMA_1B, "cuda", torch.bfloat16)
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 64), device="cuda")
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        model.generation_config.disable_compile = True
        want = model.generate(ids, cache_implementation="static", **kw)
        sw.compile_generate(model, prompt_sizes=[64], max_length=512, static_cache=True, cudagraphs="full",
                            progress=False)
        got = model.generate(ids, **kw)  # deferred stop (the default on a GPU)
        plain = model.generate.__wrapped__(ids, **kw)  # transformers' own loop over the same compiled forward
    print("GPU", torch.cuda.get_device_name(), "torch", torch.__version__)
    for name, out in (("compile_generate", got), ("same forward, transformers' loop", plain)):
        same = torch.equal(out.sequences, want.sequences)
        print(f"{name}: tokens equal eager's: {same}")
        for step, (a, b) in enumerate(zip(out.logits, want.logits)):
            top2 = b[0].float().topk(2).values
            rel = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            print(f"  step {step}: argmax {a[0].argmax().item()} vs eager {b[0].argmax().item()}, eager's top-2 margin "
                  f"{(top2[0] - top2[1]).item():.4f}, max rel. logit diff {rel:.2e}")
            if a[0].argmax() != b[0].argmax():
                break


if __name__ == "__main__":
    main()
