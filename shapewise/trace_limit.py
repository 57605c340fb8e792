"""``max_traces``: a bound on one compiled model's Dynamo traces.

A call whose guards no trace passes makes a new trace. Most models need a fixed number (prefill and
decode; a trace per prompt length where the model fixes the length in Python). Some need one per call:
a cache tensor that grows along a dim no mark covers (DeepSeek-V4's compressor buffers, a token a
step), a Python int the model bumps every call. Each such trace costs seconds to minutes, so a decode
of 256 tokens would trace 256 times. shapewise traces past Dynamo's own ``recompile_limit`` (each model
has a budget of its own: ``_compat.own_recompile_budget``), so the bound is here: past ``max_traces``
traces, a call that fits none of them runs uncompiled, with one warning; the traces made still serve
the calls they fit (Dynamo's guards, under ``torch.compiler.set_stance("eager_on_recompile")``, which
checks them without tracing). ``"auto"`` (the default): 8 (Dynamo's default limit) plus one per size
and range asked for (a model that fixes its sizes needs a trace for each). ``None``: no bound.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shapewise.errors import ConfigError

__all__ = ["TraceLimit"]

log = logging.getLogger("shapewise")

#: Dynamo's default ``recompile_limit``: the traces "auto" allows beyond one per size and range.
AUTO_EXTRA = 8


class TraceLimit:
    """``max_traces`` resolved for one model (``limit``: None for no bound), and whether it was reached."""

    def __init__(self, option: Any, sizes: Sequence[Any] = (), ranges: Sequence[Any] = ()) -> None:
        if option == "auto":
            self.limit: int | None = AUTO_EXTRA + _count(sizes) + _count(ranges)
        elif option is None or isinstance(option, int) and not isinstance(option, bool) and option >= 1:
            self.limit = option
        else:
            raise ConfigError(f"max_traces must be 'auto', None (no bound) or an int >= 1 (the most traces "
                              f"of this model), got {option!r}")
        self.reached = False

    def allows(self, traces: int) -> bool:
        """Whether a model with ``traces`` traces may make another."""
        return self.limit is None or traces < self.limit

    def past(self, name: str, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """The first call past the bound: warn, and give the compiled function to call from now
        on (``compiled`` under ``eager_on_recompile``: its traces serve, the rest runs uncompiled)."""
        self.reached = True
        log.warning("shapewise: %s has made %d traces (max_traces=%s): calls that fit none of them run "
                    "uncompiled from now on, without a new trace each. A model that needs a trace per call keeps a "
                    "tensor that grows along a dim no mark covers, or an int it changes every call (dynamic_dims "
                    "can name either); TORCH_LOGS=recompiles shows why each trace was made. A larger max_traces "
                    "(None: no bound) traces on", name, self.limit, self.limit)
        return torch.compiler.set_stance("eager_on_recompile")(compiled)


def _count(sizes: Any) -> int:
    """How many sizes (or ranges) ``sizes`` asks for: its length, or for ``{name: [sizes]}`` their product."""
    if isinstance(sizes, Mapping):
        return math.prod(len(v) if isinstance(v, (list, tuple)) else 1 for v in sizes.values())
    return len(sizes or ())
