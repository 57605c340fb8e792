"""``sw.library.BatchInputUpdates``: in-place additions to a piece's inputs moved to its end, all
of one amount in one ``_foreach_add_``. Which adds move (nothing reads the input after; no other
input shares its memory; a number as amount; two or more of one amount), the answers and the
inputs' new values against eager, and a transformers decoder's static-cache counters through
``compile_generate``."""

from __future__ import annotations

import pytest
import torch

import shapewise as sw
from tests.helpers import assert_before_after, assert_same, dynamo_graph


def counters(x, a, b, c, d):
    y = x * a  # each counter read before its add, as a cache layer reads its token count
    a.add_(1)
    y = y + b
    b.add_(1)
    c.add_(2)  # the only add of 2: stays where it is
    y = y * d
    d.add_(1)
    return y + d  # d read after its add: stays where it is


BEFORE = """
    def forward(self, l_x_, l_a_, l_b_, l_c_, l_d_):
        y = l_x_ * l_a_
        add_ = l_a_.add_(1)
        y_1 = y + l_b_
        add__1 = l_b_.add_(1)
        add__2 = l_c_.add_(2)
        y_2 = y_1 * l_d_
        add__3 = l_d_.add_(1)
        add_1 = y_2 + l_d_
        return (add_1,)
"""

AFTER = """
    def forward(self, l_x_, l_a_, l_b_, l_c_, l_d_):
        y = l_x_ * l_a_
        y_1 = y + l_b_
        add__2 = l_c_.add_(2)
        y_2 = y_1 * l_d_
        add__3 = l_d_.add_(1)
        add_1 = y_2 + l_d_
        _foreach_add__scalar = torch.ops.aten._foreach_add_.Scalar([l_a_, l_b_], 1)
        return (add_1,)
"""


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(4, 3), *(torch.randn(3) for _ in range(4))]


def test_adds_nothing_reads_after_move_to_one_foreach_add_at_the_end():
    gm = dynamo_graph(counters, *_inputs())
    out = assert_before_after(sw.library.BatchInputUpdates(), sw.Concretize(sizes=[4])(gm), BEFORE, AFTER)
    (variant,) = out.compute_pieces[0].variants
    got, want = _inputs(), _inputs()
    assert_same(variant.gm(*got)[0], counters(*want))
    for g, w in zip(got, want):  # every input's new value, the moved adds' included
        assert_same(g, w)
    two = sw.library.BatchInputUpdates()(sw.Concretize(sizes=[2, 4])(gm))  # one rewrite, shared by both sizes
    assert len({id(v.gm) for v in two.compute_pieces[0].variants}) == 1 and two.compute_pieces[0].variants[0].gm


def test_an_input_that_shares_memory_or_a_lone_amount_is_left_alone():
    def aliased(x, a, b):
        y = x * a
        a.add_(1)
        b.add_(1)
        return y

    base = torch.zeros(6)
    gm = dynamo_graph(aliased, torch.randn(4, 3), base[:3], base[3:])  # two views of one tensor
    assert sw.library.BatchInputUpdates().rewrite(gm, sw.passes.VariantSizes({})).modified is False
    def through_a_view(x, a, b):
        av = a.view(-1)
        a.add_(1)
        b.add_(1)
        return x * av  # reads a, after its add, through a view made before it

    gm = dynamo_graph(through_a_view, torch.randn(4, 3), torch.randn(3), torch.randn(3))
    assert sw.library.BatchInputUpdates().rewrite(gm, sw.passes.VariantSizes({})).modified is False
    one = dynamo_graph(lambda x, a: (x * a, a.add_(3))[0], torch.randn(4, 3), torch.randn(3))
    assert sw.library.BatchInputUpdates().rewrite(one, sw.passes.VariantSizes({})).modified is False


transformers = pytest.importorskip("transformers")


def test_a_static_cache_decoders_counters_in_one_add_and_its_tokens_are_eagers():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                              disable_compile=True)
    fast = sw.compile_generate(model, prompt_sizes=[8], max_length=32, static_cache=True, backend="aot_eager",
                               splitting_ops=(), graph_passes=[sw.library.BatchInputUpdates()])
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
    graphs = [v.gm for r in fast.runnables for p in r.program.compute_pieces for v in p.variants if v.gm is not None]
    adds = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.aten._foreach_add_.Scalar]
    # decode's counters, one per layer, in one add (prefill's are made inside its trace: not inputs, left alone)
    assert len(adds) == 1 and len(adds[0].args[0]) == config.num_hidden_layers, graphs
    assert not any(n.target == "add_" and n.args[0].op == "placeholder" for gm in graphs for n in gm.graph.nodes)
