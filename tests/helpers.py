"""Small graphs used across tests."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shapewise._compat import no_zero_one_specialisation


def dynamo_graph(fn, *args, dims=None):
    """Trace ``fn`` once with Dynamo (dim 0 of the first argument dynamic, or ``dims``: {argpos: [dims]})
    and return the GraphModule Dynamo hands its backend."""
    torch._dynamo.reset()  # a fresh trace, however often the same function is traced
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            for d in (dims if dims is not None else {0: [0]}).get(i, []):
                torch._dynamo.mark_dynamic(a, d)
    with no_zero_one_specialisation():
        torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def symbolic_graph(fn, *args):
    """``make_fx(tracing_mode="symbolic")``: every dim symbolic."""
    return make_fx(fn, tracing_mode="symbolic")(*args)
