"""Hand-written kernels that shapewise's own passes put into graphs, each a torch custom op
with a fake implementation (so Dynamo, AOTAutograd and Inductor trace it) and a plain torch
fallback where its fast path cannot run (CPU, no Triton, shapes it was not written for).

Standalone: imports torch (and Triton, lazily), filelock and ``shapewise.cache_dir`` only. Tuning
results persist in ``store.py``'s ``TuningStore`` (``<shapewise cache>/<kernel>-tuning/``).
"""

from shapewise.library.kernels.decode_attention import decode_attention
from shapewise.library.kernels.gemv import GemvConfig, gemv, gemv_config, gemv_configs, triton_gemv_available, tune

__all__ = ["GemvConfig", "decode_attention", "gemv", "gemv_config", "gemv_configs", "triton_gemv_available", "tune"]
