"""``sw.library.FuseProjections``, ``sw.library.pack_projections`` and the ``shapewise::linear_group``
op: the rewrite (graph before and after), the packing of a transformers model's parameters, answers
against eager on the zoo's decoders, what happens when a user assigns new weights, and the bf16
decode on the GPU (marker ``gpu``)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import shapewise as sw
from shapewise.library.fuse_projections import packed_run
from tests.helpers import assert_before_after, assert_same, dynamo_graph

transformers = pytest.importorskip("transformers")
from tests.models.configs import DECODERS, VOCAB  # noqa: E402

OP = "shapewise.linear_group"


def fused_groups(fast) -> int:
    """How many ``linear_group`` calls the compiled variants hold, over every trace."""
    return sum(str(n.target).startswith(OP) for r in fast.runnables for p in r.program.compute_pieces
               for v in p.variants for n in (v.gm if v.gm is not None else p.gm).graph.nodes)


def decoder(name: str, dtype=torch.float32) -> torch.nn.Module:
    factory, cls = DECODERS[name]
    config = factory()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(config).eval().to(dtype)


def bf16_decode_against_fp32(name: str, **options):
    """``compile_generate`` of ``name``'s bf16 decoder on the GPU (static cache, full CUDA graphs,
    ``options``), two generate()s (the second replays the captured graphs), its logits checked
    against an fp32 eager reference within what bf16 itself costs; (compiled forward, model)."""
    reference = decoder(name).cuda()
    eager16 = decoder(name, torch.bfloat16).cuda()
    model = decoder(name, torch.bfloat16).cuda()
    fast = sw.compile_generate(model, prompt_sizes=[8], max_length=40, static_cache=True, cudagraphs="full", **options)
    ids = torch.randint(0, VOCAB, (1, 8), device="cuda")
    run = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12, return_dict_in_generate=True,
               output_logits=True, cache_implementation="static")
    with torch.no_grad():
        # The references eager: with a static cache on a GPU, generate() would compile their forward
        # itself (transformers' auto-compile, torch's CUDA graph trees), a compile the test is not about.
        want = reference.generate(ids, **run, disable_compile=True)
        bf16 = eager16.generate(ids, **run, disable_compile=True)
        for _ in range(2):
            got = model.generate(ids, **run)
    assert_bf16_logits_close(got, want, bf16, prompt=8)
    return fast, model


def assert_bf16_logits_close(got, want, bf16, prompt: int) -> None:
    """Per generated step, ``got``'s bf16 logits against the fp32 reference ``want`` within twice
    what bf16 itself costs (the plain bf16 model's error ``bf16``, with margin), up to the first
    step where the tokens part (a near-tie flipped: later steps see other inputs)."""
    for step in range(min(len(got.logits), len(bf16.logits))):
        if not torch.equal(got.sequences[:, :prompt + step], want.sequences[:, :prompt + step]):
            break
        ref = want.logits[step].float()
        err = (got.logits[step].float() - ref).abs().max() / ref.abs().max()
        err16 = (bf16.logits[step].float() - ref).abs().max() / ref.abs().max()
        assert err <= 2 * err16 + 1e-2, (step, err.item(), err16.item())


THREE_AND_ONE = """
    def forward(self, l_x_, l_wq_, l_wk_, l_wv_, l_w_other_):
        linear = torch._C._nn.linear(l_x_, l_wq_)
        linear_1 = torch._C._nn.linear(l_x_, l_wk_)
        add = linear + linear_1
        linear_2 = torch._C._nn.linear(l_x_, l_wv_)
        add_1 = add + linear_2
        linear_3 = torch._C._nn.linear(l_x_, l_w_other_)
        add_2 = add_1 + linear_3
        return (add_2,)
"""


def test_the_rewrite_fuses_the_packed_run_and_leaves_the_other_weight():
    packed = torch.randn(24, 16)
    wq, wk, wv = packed[:8], packed[8:16], packed[16:]  # one storage, consecutive: as pack_projections leaves them
    w_other = torch.randn(8, 16)  # reads the same x, but in a storage of its own

    def f(x):
        return F.linear(x, wq) + F.linear(x, wk) + F.linear(x, wv) + F.linear(x, w_other)

    gm = dynamo_graph(f, torch.randn(4, 16))
    out = assert_before_after(sw.library.FuseProjections(), sw.Concretize(sizes=[3])(gm), THREE_AND_ONE, """
        def forward(self, l_x_, l_wq_, l_wk_, l_wv_, l_w_other_):
            linear_group_default = torch.ops.shapewise.linear_group.default(l_x_, [l_wq_, l_wk_, l_wv_], [])
            split = linear_group_default.split([8, 8, 8], -1)
            getitem = split[0]
            getitem_1 = split[1]
            getitem_2 = split[2]
            contiguous = getitem.contiguous()
            contiguous_1 = getitem_1.contiguous()
            contiguous_2 = getitem_2.contiguous()
            add = contiguous + contiguous_1
            add_1 = add + contiguous_2
            linear_3 = torch._C._nn.linear(l_x_, l_w_other_)
            add_2 = add_1 + linear_3
            return (add_2,)
    """)
    (variant,) = out.compute_pieces[0].variants
    x = torch.randn(3, 16)
    assert_same(variant.gm(x, wq, wk, wv, w_other)[0], f(x))
    # Every node the pass adds has a traced value, as Dynamo's do (AOT autograd's cache, and so the
    # artifact cache, refuses a graph with a method called on a node without one).
    new = [n for n in variant.gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert all("example_value" in n.meta for n in new), [n.name for n in new if "example_value" not in n.meta]
    (split,) = variant.gm.graph.find_nodes(op="call_method", target="split")
    assert [v.shape[-1] for v in split.meta["example_value"]] == [8, 8, 8]
    # The order of the run is the storage's, whatever the graph's order: v, q, k is fused as q, k, v.
    gm2 = dynamo_graph(lambda x: F.linear(x, wv) * F.linear(x, wq) - F.linear(x, wk), torch.randn(4, 16))
    (variant,) = sw.library.FuseProjections()(sw.Concretize(sizes=[3])(gm2)).compute_pieces[0].variants
    (group,) = [n for n in variant.gm.graph.nodes if str(n.target).startswith(OP)]
    assert [a.name for a in group.args[1]] == ["l_wq_", "l_wk_", "l_wv_"]
    assert_same(variant.gm(x, wv, wq, wk)[0], F.linear(x, wv) * F.linear(x, wq) - F.linear(x, wk))


def test_weights_that_are_not_one_run_are_left_alone(caplog):
    wq, wk = torch.randn(8, 16), torch.randn(8, 16)  # separate storages
    gap = torch.randn(24, 16)
    wa, wb = gap[:8], gap[16:]  # one storage with a gap between them

    def f(x):
        y = x * 2
        return F.linear(x, wq) + F.linear(x, wk), F.linear(y, wa) + F.linear(y, wb)

    program = sw.Concretize(sizes=[3])(dynamo_graph(f, torch.randn(4, 16)))
    with caplog.at_level(logging.DEBUG, logger="shapewise"):
        out = sw.library.FuseProjections()(program)
    (variant,) = out.compute_pieces[0].variants
    assert variant.gm is None or not any(str(n.target).startswith(OP) for n in variant.gm.graph.nodes)
    assert sum("not one packed run" in r.getMessage() for r in caplog.records) == 2


def test_a_change_in_place_between_the_layers_keeps_them_apart():
    # Found by review: the fused matmul runs where the first layer ran, so an in-place change of
    # its input between the layers would be read before it happened.
    packed = torch.randn(16, 8)
    wq, wk = packed[:8], packed[8:]

    def f(h):
        x = h * 1.0
        q = F.linear(x, wq)
        x.add_(1.0)
        return q + F.linear(x, wk)

    out = sw.library.FuseProjections()(sw.Concretize(sizes=[3])(dynamo_graph(f, torch.randn(4, 8))))
    (variant,) = out.compute_pieces[0].variants
    assert variant.gm is None or not any(str(n.target).startswith(OP) for n in variant.gm.graph.nodes)
    h = torch.randn(3, 8)
    assert_same((variant.gm or out.compute_pieces[0].gm)(h, wq, wk)[0], f(h))


def test_max_tokens_gates_by_rows_and_bad_options_are_refused():
    packed = torch.randn(16, 8)
    w1, w2 = packed[:8], packed[8:]
    program = sw.Concretize(sizes=[2, 8])(dynamo_graph(lambda x: F.linear(x, w1) * F.linear(x, w2), torch.randn(4, 8)))
    out = sw.library.FuseProjections(max_tokens=4)(program)
    fused = {v.binding.static_values()[next(iter(v.binding.static_values()))]: any(
        str(n.target).startswith(OP) for n in (v.gm or out.compute_pieces[0].gm).graph.nodes)
        for v in out.compute_pieces[0].variants}
    assert fused == {2: True, 8: False}
    every = sw.library.FuseProjections()(program)  # without max_tokens: one rewrite, shared by both sizes
    assert len({id(v.gm) for v in every.compute_pieces[0].variants}) == 1 and every.compute_pieces[0].variants[0].gm
    with pytest.raises(sw.ConfigError, match="max_tokens=0"):
        sw.library.FuseProjections(max_tokens=0)
    with pytest.raises(sw.ConfigError, match="give the torch.nn.Module"):
        sw.library.pack_projections("model")


def test_pack_projections_makes_the_parameters_views_of_one_buffer():
    model = decoder("llama")
    x = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        before = model(x).logits
    attn = model.model.layers[0].self_attn
    params = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight]
    storages = len({p.untyped_storage().data_ptr() for p in model.parameters()})
    packed = sw.library.pack_projections(model)
    assert [str(p) for p in packed] == [
        "model.layers.0.self_attn.{q_proj, k_proj, v_proj, o_proj} -> [96, 32]",
        "model.layers.0.mlp.{gate_proj, up_proj} -> [128, 32]",
        "model.layers.1.self_attn.{q_proj, k_proj, v_proj, o_proj} -> [96, 32]",
        "model.layers.1.mlp.{gate_proj, up_proj} -> [128, 32]"]
    # the same Parameter objects (an optimizer or a hook holding them still does), now one run of one buffer
    assert [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight] == params
    assert packed_run(params) is not None and all(isinstance(p, torch.nn.Parameter) for p in params)
    # weight memory does not grow: 4 + 2 storages per layer became 1 + 1
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == storages - 2 * (3 + 1)
    # lm_head is the one linear layer of its module: left where it is
    assert model.lm_head.weight.untyped_storage().size() == model.lm_head.weight.nbytes
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)
    assert sw.library.pack_projections(model) == []  # packed already


def test_weights_tied_by_storage_are_not_packed():
    # Two Parameter objects over one storage (a tie made with .data): packing would part them.
    model = decoder("llama")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    attn.q_proj.weight.data = mlp.gate_proj.weight.data[:32]
    packed = [str(p) for p in sw.library.pack_projections(model)]
    assert not any(p.startswith("model.layers.0.") for p in packed), packed
    assert attn.q_proj.weight.data_ptr() == mlp.gate_proj.weight.data_ptr()


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3", "opt"])
def test_zoo_decoders_fused_give_eager_answers(name):
    # qwen2 and opt have biases on q, k, v (opt's MLP is fc1 then fc2: nothing to fuse there); phi3
    # has qkv_proj and gate_up_proj fused in its own code: nothing to fuse.
    model = decoder(name)
    reference = decoder(name)
    sw.library.pack_projections(model)
    fast = sw.compile(model, dynamic_dims={"input_ids": 1}, sizes=[1, 4], ranges=[(5, 12)], backend="aot_eager",
                      graph_passes=[sw.library.FuseProjections()])
    with torch.no_grad():
        for n in (4, 1, 9):
            ids = torch.randint(0, VOCAB, (2, n))
            assert_same(fast(input_ids=ids, use_cache=False).logits,
                        reference(input_ids=ids, use_cache=False).logits, f"{name} seq={n}")
    expected = {"llama": 2, "qwen2": 2, "opt": 1, "phi3": 0}[name]
    # per layer (2 layers) and variant (3 variants over 2 traces)
    assert fused_groups(fast) == expected * 2 * 3, fused_groups(fast)


def _count(fast, target: str) -> int:
    return sum(str(n.target).startswith(target) for r in fast.runnables for p in r.program.compute_pieces
               for v in p.variants for n in (v.gm if v.gm is not None else p.gm).graph.nodes)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_decode_gemv_after_fusion_takes_the_fused_groups_at_few_rows(name):
    # DecodeGemv after FuseProjections: a linear_group at <= max_tokens rows becomes gemv_group (the
    # kernel over the packed weights; on the CPU the op is F.linear), the rest of the linears gemv;
    # the range variant keeps linear_group. Same answers as eager, biases (qwen2) and all.
    model, reference = decoder(name), decoder(name)
    sw.library.pack_projections(model)
    gemv = sw.library.DecodeGemv(max_tokens=4, devices=("cpu",), dtypes=("float32",))
    fast = sw.compile(model, dynamic_dims={"input_ids": 1}, sizes=[1, 8], ranges=[(2, 7)], backend="aot_eager",
                      graph_passes=[sw.library.FuseProjections(), gemv])
    with torch.no_grad():
        for n in (1, 8, 3):
            ids = torch.randint(0, VOCAB, (1, n))
            assert_same(fast(input_ids=ids, use_cache=False).logits,
                        reference(input_ids=ids, use_cache=False).logits, f"{name} seq={n}")
    # 2 groups per layer, 2 layers: at seq=1 in gemv_group; at 8 (over max_tokens) and the range, linear_group
    assert _count(fast, "shapewise.gemv_group") == 4, _count(fast, "shapewise.gemv_group")
    assert _count(fast, "shapewise.linear_group") == 8, _count(fast, "shapewise.linear_group")
    assert _count(fast, "shapewise.gemv.") > 0  # o_proj, down_proj, lm_head at seq=1


def test_a_new_parameter_is_still_right_and_packing_again_reads_in_place(caplog):
    # direct_call=False: a direct call holds the parameters the trace read (shapewise.direct), so
    # it would not see a replaced Parameter at all; through Dynamo's frame each call reads them.
    model, reference = decoder("llama"), decoder("llama")
    fast = sw.compile_generate(model, prompt_sizes=[6], max_length=32, backend="aot_eager", direct_call=False,
                               fuse_projections=True)  # on the CPU without CUDA graphs it is off by default
    ids = torch.randint(0, VOCAB, (1, 6))
    run = dict(do_sample=False, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)

    def check():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shapewise"):
            got, want = model.generate(ids, **run), reference.generate(ids, **run)
        assert torch.equal(got.sequences, want.sequences)
        assert_same(got.logits, want.logits, "logits per step")
        return [r.getMessage() for r in caplog.records if "not one packed buffer" in r.getMessage()]

    with torch.no_grad():
        assert check() == []
        assert fused_groups(fast) > 0
        # In place (load_state_dict copies into the parameters): stays packed, new answers.
        state = {k: torch.randn_like(v) if "proj" in k else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        reference.load_state_dict(state)
        attn = model.model.layers[1].self_attn
        assert packed_run([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
        assert check() == []
        # A new Parameter: the same answers through a copy per call, and a warning that says what to do.
        new = torch.randn_like(attn.k_proj.weight)
        attn.k_proj.weight = torch.nn.Parameter(new)
        reference.model.layers[1].self_attn.k_proj.weight = torch.nn.Parameter(new.clone())
        (warning,) = check()
        assert "pack_projections(model) again" in warning
        assert [str(p) for p in sw.library.pack_projections(model)] == [
            "model.layers.1.self_attn.{q_proj, k_proj, v_proj, o_proj} -> [96, 32]"]
        assert check() == []


def test_compile_generate_fuses_by_default_only_where_steps_replay_cuda_graphs():
    # Without graphs the op's host cost per call outweighs the launches it saves (generate.py).
    model = decoder("llama")
    fast = sw.compile_generate(model, prompt_sizes=[6], max_length=32, backend="aot_eager")
    with torch.no_grad():
        model.generate(torch.randint(0, VOCAB, (1, 6)), do_sample=False, max_new_tokens=2)
    assert fused_groups(fast) == 0
    attn = model.model.layers[0].self_attn
    assert packed_run([attn.q_proj.weight, attn.k_proj.weight]) is None  # not packed either


def test_a_graph_that_computes_gradients_is_not_fused():
    model = decoder("llama").train()
    reference = decoder("llama").train()
    sw.library.pack_projections(model)
    fast = sw.compile(model, dynamic_dims={"input_ids": 1}, sizes=[4], backend="aot_eager",
                      graph_passes=[sw.library.FuseProjections()])
    ids = torch.randint(0, VOCAB, (2, 4))
    fast(input_ids=ids, use_cache=False).logits.sum().backward()
    reference(input_ids=ids, use_cache=False).logits.sum().backward()
    assert fused_groups(fast) == 0
    q, q_ref = model.model.layers[0].self_attn.q_proj.weight, reference.model.layers[0].self_attn.q_proj.weight
    assert_same(q.grad, q_ref.grad, "q_proj grad")


@pytest.mark.gpu
@pytest.mark.parametrize("name, gemv", [("llama", False), ("qwen2", False), ("llama", True), ("qwen2", True)])
def test_bf16_decode_in_full_cuda_graphs_against_fp32(name, gemv):
    # Inductor and full CUDA graphs on the GPU: bf16 logits against an fp32 eager reference, within
    # what bf16 itself costs (the unfused bf16 eager model's error, with margin); with DecodeGemv
    # after the fusion too (the fused groups in the Triton GEMV: gemv_group).
    # (DecodeGemv is compile_generate's default there since 2026-12-06: decode_gemv=False leaves it out)
    fast, _ = bf16_decode_against_fp32(name, **({"graph_passes": [sw.library.DecodeGemv()]} if gemv
                                                else {"decode_gemv": False}))
    # With DecodeGemv every group at <= 16 rows (the 8-token prefill too) is a gemv_group.
    assert (_count(fast, "shapewise.gemv_group") > 0) == gemv and fused_groups(fast) + _count(
        fast, "shapewise.gemv_group") > 0
