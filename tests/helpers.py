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


def graph_args(gm, *tensors, **named):
    """The positional arguments of ``gm`` for a call with ``tensors`` (the function's tensor
    arguments, in the order the graph first reads them) or ``named`` ({argument name: tensor},
    matched to Dynamo's ``L_<name>_`` placeholders); a SymInt placeholder takes the size (or
    stride) of the tensor whose traced layout carries that symbol."""
    from shapewise._compat import node_value, sym_expr

    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [node_value(n) for n in nodes]
    it = iter(tensors)
    out = [(named[str(n.target)[2:-1]] if named else next(it)) if isinstance(v, torch.Tensor) else None
           for n, v in zip(nodes, values)]
    for i, v in enumerate(values):
        if not isinstance(v, torch.SymInt):
            continue
        e = sym_expr(v)
        for t, real in zip(values, out):
            if isinstance(t, torch.Tensor):
                hit = [real.shape[d] for d, s in enumerate(t.shape) if sym_expr(s) == e]
                hit += [real.stride(d) for d, s in enumerate(t.stride()) if sym_expr(s) == e]
                if hit:
                    out[i] = hit[0]
                    break
        assert out[i] is not None, f"no tensor carries symbol {e}"
    return out
