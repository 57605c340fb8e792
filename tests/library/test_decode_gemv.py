"""``sw.library.DecodeGemv`` and the ``shapewise::gemv`` op: the rewrite (graph before and after) and
its gating on the CPU (where the op is ``F.linear``), the kernel itself on the GPU (marker ``gpu``)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shapewise as sw
from shapewise.library.kernels.gemv import GemvConfig, gemv_configs
from tests.helpers import assert_before_after, assert_same, dynamo_graph

CPU = dict(devices=("cpu",), dtypes=("float32",))


class FourForms(nn.Module):
    """The four spellings of a linear layer the pass knows."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(dim, 2 * dim)
        self.b = nn.Linear(2 * dim, dim, bias=False)
        self.w = nn.Parameter(torch.randn(16, dim) / dim**0.5)
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        flat = y.reshape(-1, y.shape[-1])
        return y @ self.w.t(), torch.addmm(self.bias, flat, self.w.T), torch.mm(flat, self.w.transpose(0, 1))


LINEAR_THEN_MATMUL = """
    def forward(self, l_x_, l_w_, l_b_, l_v_):
        linear = torch._C._nn.linear(l_x_, l_w_, l_b_)
        relu = torch.relu(linear)
        t = l_v_.t()
        matmul = relu @ t
        return (matmul,)
"""


def test_the_rewrite_at_a_decode_size_and_above_max_tokens():
    w, b, v = torch.randn(8, 16), torch.randn(8), torch.randn(8, 8)

    def f(x):
        return torch.relu(F.linear(x, w, b)) @ v.t()

    gm = dynamo_graph(f, torch.randn(4, 16))
    gemv = sw.library.DecodeGemv(max_tokens=4, **CPU)
    out = assert_before_after(gemv, sw.Concretize(sizes=[2])(gm), LINEAR_THEN_MATMUL, """
        def forward(self, l_x_, l_w_, l_b_, l_v_):
            gemv_default = torch.ops.shapewise.gemv.default(l_x_, l_w_, l_b_)
            relu = torch.relu(gemv_default)
            gemv_default_1 = torch.ops.shapewise.gemv.default(relu, l_v_, None)
            return (gemv_default_1,)
    """)
    (variant,) = out.compute_pieces[0].variants
    x = torch.randn(2, 16)
    assert_same(variant.gm(x, w, b, v)[0], f(x))
    assert gemv.uuid() in variant.passes
    # 8 rows: over max_tokens, the rewrite says it changed nothing and the variant keeps the piece's graph
    above = assert_before_after(gemv, sw.Concretize(sizes=[8])(gm), LINEAR_THEN_MATMUL, LINEAR_THEN_MATMUL)
    assert above.compute_pieces[0].variants[0].gm is None and not above.compute_pieces[0].variants[0].passes
    result = gemv.rewrite(gm, sw.passes.VariantSizes({"n": 8}))
    assert isinstance(result, sw.PassResult) and result.modified is False


def _gemv_count(fast, n: int) -> int:
    (piece,) = fast.program.compute_pieces
    variant = next(v for v in piece.variants if v.binding.key == (n,))
    gm = variant.gm if variant.gm is not None else piece.gm
    return gm.code.count("torch.ops.shapewise.gemv")


def test_linear_layers_become_gemv_at_static_sizes_up_to_max_tokens_and_nowhere_else():
    torch.manual_seed(0)
    model = FourForms()
    fast = sw.compile(model, sizes=[1, 2, 3, 4, 8], ranges=[(5, 7)], backend="aot_eager",
                      graph_passes=[sw.library.DecodeGemv(max_tokens=4, **CPU)])
    for n in (1, 2, 3, 4, 6, 8):
        x = torch.randn(n, 32)
        assert_same(fast(x), model(x), f"n={n}")
    rows = {r["key"]: r["passes"] for r in fast.report()}
    assert [k for k, p in rows.items() if "decode_gemv" in p] == ["{n=1}", "{n=2}", "{n=3}", "{n=4}"]
    assert all(_gemv_count(fast, n) == 5 for n in (1, 2, 3, 4))  # two F.linear, @ .t(), addmm .T, mm .transpose


def test_rows_count_every_leading_dim_and_other_devices_or_dtypes_are_left_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(2, 3, 16)  # batch 2: rows are 2 * seq
    fast = sw.compile(model, sizes={"seq": [1, 2, 3]}, dynamic_dims={"input": {1: "seq"}}, backend="aot_eager",
                      graph_passes=[sw.library.DecodeGemv(max_tokens=4, **CPU)])
    fast(x)
    passes = {r["key"]: r["passes"] for r in fast.report()}
    assert [k for k, p in passes.items() if p] == ["{seq=1}", "{seq=2}"], passes  # 2 and 4 rows; 6 is over
    cuda_only = sw.compile(model, sizes={"seq": [1, 2]}, dynamic_dims={"input": {1: "seq"}}, backend="aot_eager",
                           graph_passes=[sw.library.DecodeGemv(max_tokens=4)])  # the default: CUDA bf16/fp16
    assert_same(cuda_only(x[:, :2]), model(x[:, :2]))
    assert not any(r["passes"] for r in cuda_only.report())


def test_training_through_the_op_matches_eager():
    torch.manual_seed(0)
    model = FourForms()
    reference = FourForms()
    reference.load_state_dict(model.state_dict())
    fast = sw.compile(model, sizes=[2, 8], backend="aot_eager",
                      graph_passes=[sw.library.DecodeGemv(max_tokens=4, **CPU)])
    for n in (2, 8):
        x = torch.randn(n, 32, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        sum(o.square().sum() for o in fast(x)).backward()
        sum(o.square().sum() for o in reference(xr)).backward()
        assert_same(x.grad, xr.grad, f"input grad at n={n}")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert_same(p.grad, q.grad, f"{name}.grad at n={n}")
            p.grad = q.grad = None
    assert _gemv_count(fast, 2) == 5 and _gemv_count(fast, 8) == 0


def test_broadcast_biases_and_autocast_outputs_are_left_alone():
    w, b1 = torch.randn(16, 32), torch.randn(1)

    def f(x):
        return torch.addmm(b1, x, w.t()), F.linear(x, w)

    fast = sw.compile(f, dynamic_dims={"x": 0}, sizes=[2], backend="aot_eager",
                      graph_passes=[sw.library.DecodeGemv(max_tokens=4, **CPU)])
    x = torch.randn(2, 32)
    assert_same(fast(x), f(x))
    assert _gemv_count(fast, 2) == 1  # F.linear only: addmm's [1] bias broadcasts, which the op does not
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the matmuls' outputs are bf16, x is float32
        auto = sw.compile(f, dynamic_dims={"x": 0}, sizes=[2], backend="aot_eager",
                          graph_passes=[sw.library.DecodeGemv(max_tokens=4, **CPU)])
        out = auto(x)
        assert [o.dtype for o in out] == [torch.bfloat16, torch.bfloat16]
    assert _gemv_count(auto, 2) == 0


def test_the_op_refuses_mismatched_shapes_at_trace_time():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.shapewise.gemv.default
    with FakeTensorMode():
        with pytest.raises(RuntimeError, match=r"bias must be \[N\] = \[8\]"):
            op(torch.randn(2, 32), torch.randn(8, 32), torch.randn(1))
        with pytest.raises(RuntimeError, match="last dim 16 != weight's K 32"):
            op(torch.randn(2, 16), torch.randn(8, 32))


def test_the_op_passes_torchs_custom_op_checks():
    x = torch.randn(3, 24, requires_grad=True)
    w = torch.randn(10, 24, requires_grad=True)
    b = torch.randn(10, requires_grad=True)
    torch.library.opcheck(torch.ops.shapewise.gemv.default, (x, w, b))
    torch.library.opcheck(torch.ops.shapewise.gemv.default, (x[None], w, None))


def test_max_tokens_beyond_the_kernel_is_refused_and_configs_fit_the_weight(monkeypatch):
    with pytest.raises(sw.ConfigError, match="between 1 and 64"):
        sw.library.DecodeGemv(max_tokens=65)
    assert sw.library.DecodeGemv(max_tokens=64).max_tokens == 64
    spelled = [sw.library.DecodeGemv(devices=d, dtypes=t) for d, t in
               (("cpu", "float32"), ((torch.device("cpu"),), (torch.float32,)), (["cpu:0"], ["torch.float32"]))]
    assert {(p.devices, p.dtypes) for p in spelled} == {(("cpu",), ("float32",))}
    for bad, match in ((dict(dtypes=("flaot32",)), "'flaot32' is not a dtype"),
                       (dict(devices=("gpu",)), "'gpu' is not a device")):
        with pytest.raises(sw.ConfigError, match=match):
            sw.library.DecodeGemv(**bad)
    for n, k in ((4096, 4096), (2048, 11008), (22016, 4096), (24, 64)):
        for cfg in gemv_configs(n, k):
            assert cfg.split_k == 1 or k >= cfg.split_k * cfg.block_k
    assert any(c.split_k > 1 for c in gemv_configs(4096, 4096))
    assert all(c.split_k == 1 for c in gemv_configs(22016, 4096) if c.block_n <= 64)  # 344+ tiles: no split
    for tile in (16, 32, 64):  # every config's pipeline fits the shared memory at its row tile
        assert all((tile + c.block_n) * c.block_k * 2 * c.num_stages <= 192 << 10 for c in gemv_configs(4096, 4096,
                                                                                                     tile=tile))
    assert len(gemv_configs(4096, 4096, tile=64)) >= 6
    # the GLU kernel stages an up tile beside each x tile: its configs fit with both, a subset of the plain ones
    for tile in (16, 64):
        glu, plain = gemv_configs(4096, 11008, tile=tile, glu=True), gemv_configs(4096, 11008, tile=tile)
        assert glu and (set(glu) < set(plain) if tile == 64 else set(glu) <= set(plain))
        assert all((2 * tile + c.block_n) * c.block_k * 2 * c.num_stages <= 192 << 10 for c in glu)
    # wdot (the weight as wgmma's M side) is timed beside dot at every tile, unless turned off.
    monkeypatch.delenv("SHAPEWISE_GEMV_WDOT", raising=False)
    for tile in (1, 16, 64):
        assert {c.kernel for c in gemv_configs(4096, 4096, tile=tile)} >= {"dot", "wdot"}
    assert str(GemvConfig(64, 128, 8, 4, 4, "wdot")) == "wdot.n64.k128.split8.w4.s4"
    monkeypatch.setenv("SHAPEWISE_GEMV_WDOT", "0")
    assert {c.kernel for c in gemv_configs(4096, 4096, tile=16)} == {"dot"}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_matches_float64_at_every_config(dtype, monkeypatch):
    monkeypatch.setenv("SHAPEWISE_GEMV_ROWS", "1")  # the rows kernel's configs too
    monkeypatch.setenv("SHAPEWISE_GEMV_WDOT_MORE", "1")  # and the experiment's wdot tilings
    from shapewise.library.kernels.gemv import _launch

    torch.manual_seed(0)
    for m, n, k, bias in ((1, 4096, 4096, False), (3, 1000, 1000, True), (16, 256, 11008, True), (8, 24, 64, False),
                          (17, 512, 1024, True), (32, 4096, 512, False), (64, 1000, 4096, True), (40, 64, 256, False)):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        from shapewise.library.kernels.gemv import row_tile

        for cfg in [*gemv_configs(n, k, tile=row_tile(m)), GemvConfig(16, 128, 4)]:
            y = _launch(x, w, b, cfg)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert y.shape == (m, n) and y.dtype == dtype and err < 1e-2, (m, n, k, bias, str(cfg), err)


@pytest.mark.gpu
@pytest.mark.parametrize("tune", ["1", "0"])
def test_a_compiled_stack_with_the_pass_and_full_cudagraphs_matches_eager(tune, monkeypatch):
    from shapewise.library.kernels.gemv import _TUNED

    # Tuning may keep F.linear where it is faster; untimed ("0"), the op always runs the kernel.
    monkeypatch.setenv("SHAPEWISE_GEMV_TUNE", tune)
    hidden = 1024 + 16 * int(tune)  # shapes of their own, so the other case's choices are not reused
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, hidden), nn.SiLU(), nn.Linear(hidden, 512)).cuda().to(torch.bfloat16)
    fast = sw.compile(model, sizes=[1, 2, 4, 8, 32], cudagraphs="full",
                      graph_passes=[sw.library.DecodeGemv(max_tokens=8)])
    with torch.no_grad():
        for n in (1, 2, 4, 8, 32, 1, 8):
            x = torch.randn(n, 512, device="cuda", dtype=torch.bfloat16)
            assert_same(fast(x), model(x), f"n={n}")
    passes = {r["key"]: r["passes"] for r in fast.report()}
    assert [k for k, p in passes.items() if p] == ["{n=1}", "{n=2}", "{n=4}", "{n=8}"], passes
    chosen = {k[:3]: cfg for k, cfg in _TUNED.items() if hidden in k[1:3]}
    assert {m for m, _, _ in chosen} == {1, 2, 4, 8}  # the op met every decode size...
    if tune == "0":
        assert all(isinstance(cfg, GemvConfig) for cfg in chosen.values())  # ...and ran the kernel


def test_a_transformers_llama_is_rewritten_at_decode_sizes_and_answers_as_eager():
    pytest.importorskip("transformers")
    from tests.models.configs import DECODERS

    torch.manual_seed(0)
    config, cls = DECODERS["llama"]
    model = cls(config()).eval()
    fast = sw.compile(model, dynamic_dims={"input_ids": {1: "seq"}}, sizes={"seq": [1, 4, 8]}, backend="aot_eager",
                      graph_passes=[sw.library.DecodeGemv(max_tokens=4, glu=True, **CPU)])
    with torch.no_grad():
        for seq in (1, 4, 8):
            ids = torch.randint(3, 128, (1, seq))
            assert_same(fast(input_ids=ids).logits, model(input_ids=ids).logits, f"seq={seq}")
    gemvs = {}
    for runnable in fast.runnables:  # seq=1 is traced on its own (transformers branches on it)
        for piece in runnable.program.compute_pieces:
            for v in piece.variants:
                gm = v.gm if v.gm is not None else piece.gm
                gemvs[v.binding.key or ("fixed",)] = (gm.code.count("torch.ops.shapewise.gemv"),
                                                      gm.code.count("torch.ops.shapewise.gemv_glu"))
    # q, k, v, o, gate, up, down per layer (2 layers) and the head: 15 at 1 and 4 tokens (each down
    # projection with its silu(gate) * up), none at 8
    assert sorted(gemvs.values()) == [(0, 0), (15, 2), (15, 2)], gemvs


def test_pdl_is_an_argument_of_the_ops_the_pass_writes_and_a_no_op_off_the_gpu():
    torch.manual_seed(0)
    model = FourForms()
    fast = sw.compile(model, sizes=[2], backend="aot_eager", graph_passes=[sw.library.DecodeGemv(pdl=True, **CPU)])
    x = torch.randn(2, 32)
    with torch.no_grad():
        for got, want in zip(fast(x), model(x)):
            assert_same(got, want, "pdl=True on the CPU")
    code = next(v.gm for r in fast.runnables for p in r.program.compute_pieces for v in p.variants).code
    assert code.count("torch.ops.shapewise.gemv.default") == 5 and code.count(", True)") == 5, code
    with pytest.raises(sw.ConfigError, match="pdl="):
        sw.library.DecodeGemv(pdl="yes")
    x, w = torch.randn(3, 64), torch.randn(8, 64)
    assert torch.equal(torch.ops.shapewise.gemv(x, w, None, True), F.linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_chain_of_pdl_launches_in_a_cuda_graph_reads_what_the_kernel_ahead_wrote(prefetch, monkeypatch):
    """Each GEMV reads the one ahead's output (and one a plain kernel's): launched with PDL, each must
    wait for the kernel ahead, in a CUDA graph replayed on new inputs, split-K configs included."""
    monkeypatch.setenv("SHAPEWISE_GEMV_ROWS", "1")
    import importlib

    from shapewise.library.kernels.gemv import _launch

    launch_module = importlib.import_module("shapewise.library.kernels.gemv_launch")
    from shapewise.library.kernels.pdl import pdl_supported

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0 and Triton's gdc ops")
    if not prefetch:  # as for a misaligned weight: no bulk prefetch, the wait alone
        monkeypatch.setattr(launch_module, "prefetch_elements", lambda *a: 0)
    torch.manual_seed(0)
    dims = (2048, 3072, 2048, 8192, 2048)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for k, n in zip(dims, dims[1:])]
    split = [c for c in gemv_configs(2048, 8192) if c.split_k > 1][0]
    cfgs = [gemv_configs(w.shape[0], w.shape[1])[0] for w in ws]
    cfgs[3] = split  # ws[3] is [2048, 8192]: its K in slices summed with atomics
    cfgs[0] = [c for c in gemv_configs(3072, 2048, tile=4) if c.kernel == "rows"][0]  # the rows kernel, 4 rows
    x = torch.empty(4, dims[0], device="cuda", dtype=torch.bfloat16)

    def chain(pdl):
        y = x
        for i, (w, cfg) in enumerate(zip(ws, cfgs)):
            y = _launch(y, w, None, cfg, pdl=pdl)
            if i == 1:
                y = torch.relu(y) * 0.5  # a kernel without PDL between two with it
        return y

    x.copy_(torch.randn_like(x))
    chain(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = chain(False)
        torch.cuda.synchronize()
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 2e-2, err


class GatedMlp(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("fused", [False, True])
def test_a_gated_mlps_down_projection_takes_its_activation_into_the_kernel(fused):
    # silu(gate) * up, then down: one gemv_glu (the product and the silu gone), with FuseProjections'
    # split halves read in place (their .contiguous() left out); glu=False keeps the three ops.
    torch.manual_seed(0)
    model = GatedMlp()
    passes = [*([sw.library.FuseProjections()] if fused else []), sw.library.DecodeGemv(glu=True, **CPU)]
    fast = sw.compile(model, sizes=[1, 3], backend="aot_eager", graph_passes=passes)
    plain = sw.compile(model, sizes=[1, 3], backend="aot_eager",
                       graph_passes=[*passes[:-1], sw.library.DecodeGemv(glu=False, **CPU)])
    with torch.no_grad():
        for n in (1, 3):
            x = torch.randn(n, 32)
            assert_same(fast(x), model(x), f"n={n}")
            assert_same(plain(x), model(x), f"n={n}, glu=False")
    code = next(v.gm for r in fast.runnables for p in r.program.compute_pieces for v in p.variants).code
    assert code.count("shapewise.gemv_glu.default") == 1 and "silu" not in code and "contiguous" not in code, code
    plain_code = next(v.gm for r in plain.runnables for p in r.program.compute_pieces for v in p.variants).code
    assert "gemv_glu" not in plain_code and "silu" in plain_code


@pytest.mark.parametrize("pays", [True, False])
def test_the_activation_goes_into_the_kernel_only_where_its_timing_says_it_pays(monkeypatch, pays):
    # Where the pass can time (a GPU), it asks glu_pays for each gated product's shape: where the kernel
    # with the activation is slower than the plain product and the activation's own kernel, the
    # product stays gemv of silu(gate) * up.
    decode_gemv = importlib.import_module("shapewise.library.decode_gemv")
    asked = []
    monkeypatch.setattr(decode_gemv, "_can_tune", lambda device, n: True)
    monkeypatch.setattr(decode_gemv, "glu_pays", lambda *shape, linear: asked.append((*shape[:3], linear)) or pays)
    monkeypatch.setattr(decode_gemv, "tune", lambda *a, **kw: None)
    torch.manual_seed(0)
    model = GatedMlp()
    fast = sw.compile(model, sizes=[3], backend="aot_eager", graph_passes=[sw.library.DecodeGemv(glu=True, **CPU)])
    with torch.no_grad():
        x = torch.randn(3, 32)
        assert_same(fast(x), model(x), "n=3")
    code = next(v.gm for r in fast.runnables for p in r.program.compute_pieces for v in p.variants).code
    assert asked == [(3, 32, 64, True)]  # (linear: the kernel or F.linear, as timed; without PDL)
    assert code.count("shapewise.gemv_glu.default") == int(pays) and ("silu" in code) is not pays, code


def test_gemv_glu_is_the_three_ops_and_trains():
    import shapewise.library.decode_gemv  # noqa: F401 - registers shapewise::gemv_glu
    torch.manual_seed(0)
    gate, up = torch.randn(2, 3, 16, requires_grad=True), torch.randn(2, 3, 16, requires_grad=True)
    w, b = torch.randn(8, 16, requires_grad=True), torch.randn(8, requires_grad=True)
    got = torch.ops.shapewise.gemv_glu(gate, up, w, b)
    want = F.linear(F.silu(gate) * up, w, b)
    assert_same(got, want, "forward")
    grads = torch.autograd.grad(got.square().sum(), (gate, up, w, b))
    for g, r in zip(grads, torch.autograd.grad(want.square().sum(), (gate, up, w, b))):
        assert_same(g, r, "backward")
    torch.library.opcheck(torch.ops.shapewise.gemv_glu.default, (gate.detach(), up.detach(), w.detach(), b.detach()))


@pytest.mark.gpu
def test_the_glu_kernel_matches_float64_on_split_halves(monkeypatch):
    monkeypatch.setenv("SHAPEWISE_GEMV_ROWS", "1")  # the rows kernel's configs too
    import shapewise.library.decode_gemv  # noqa: F401 - registers shapewise::gemv_glu
    from shapewise.library.kernels.gemv import _launch, row_tile

    torch.manual_seed(0)
    for m, k, n in ((1, 8192, 2048), (3, 1000, 300), (5, 1000, 300), (16, 11008, 4096)):
        both = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        gate, up = both.split(k, -1)  # views with the packed row stride, as FuseProjections' halves
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ref = F.linear(F.silu(gate.double()) * up.double(), w.double())
        configs = gemv_configs(n, k, tile=row_tile(m))
        wdot = [c for c in configs if c.kernel == "wdot"]
        for cfg in configs[:4] + [c for c in configs if c.kernel == "rows"] + wdot[:1] + wdot[-1:]:  # (rows: 1-4 rows)
            y = _launch(gate, w, None, cfg, up=up)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (m, k, n, str(cfg), err)
        y = torch.ops.shapewise.gemv_glu(gate, up, w)
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
def test_on_the_gpu_the_pass_times_the_activation_in_the_kernel_and_answers_as_eager():
    # A gated MLP in bf16 on the GPU, FuseProjections' halves: DecodeGemv(glu=True) asks glu_pays (the GLU
    # kernel timed against the plain product and the activation's kernel), rewrites as it answers, and
    # either way the result matches float64.
    gemv_module = importlib.import_module("shapewise.library.kernels.gemv")
    torch.manual_seed(0)
    hidden = 2048 + 96  # a shape no other test tunes
    model = GatedMlp(512, hidden).cuda().to(torch.bfloat16)
    before = len(gemv_module.GLU_DECISIONS)
    fast = sw.compile(model, sizes=[3], graph_passes=[sw.library.FuseProjections(), sw.library.DecodeGemv(glu=True)])
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = fast(x)
        ref = model.double()(x.double())
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2
    (decision,) = [d for d in gemv_module.GLU_DECISIONS[before:] if (d["rows"], d["n"], d["k"]) == (3, 512, hidden)]
    code = next(v.gm for r in fast.runnables for p in r.program.compute_pieces for v in p.variants).code
    assert ("gemv_glu" in code) is decision["pays"], (decision, code)


def test_compile_generate_adds_the_pass_only_where_asked_or_on_by_default():
    # On the CPU (no CUDA graphs) compile_generate leaves it out; decode_gemv=True adds one, and a
    # DecodeGemv of the user's own in graph_passes is used as given, not joined by a second.
    pytest.importorskip("transformers")
    from tests.models.configs import DECODERS

    config, cls = DECODERS["llama"]
    kw = dict(prompt_sizes=[6], max_length=16, static_cache=True, backend="aot_eager", splitting_ops=())
    plain = sw.compile_generate(cls(config()).eval(), **kw)
    assert not any(isinstance(p, sw.library.DecodeGemv) for p in plain._options.get("graph_passes", ()))
    asked = sw.compile_generate(cls(config()).eval(), decode_gemv=True, **kw)
    assert [p for p in asked._options["graph_passes"] if isinstance(p, sw.library.DecodeGemv)] == \
        [sw.library.DecodeGemv(norm=True)]  # gemv_norm: on by default where the pass is
    unnormed = sw.compile_generate(cls(config()).eval(), decode_gemv=True, gemv_norm=False, **kw)
    assert [p for p in unnormed._options["graph_passes"] if isinstance(p, sw.library.DecodeGemv)] == \
        [sw.library.DecodeGemv()]
    mine = sw.library.DecodeGemv(max_tokens=2, **CPU)
    given = sw.compile_generate(cls(config()).eval(), decode_gemv=True, graph_passes=[mine], **kw)
    assert [p for p in given._options["graph_passes"] if isinstance(p, sw.library.DecodeGemv)] == [mine]
    # pdl=True makes the user's pass a PDL one; compile_generate's own stays tuned against cuBLAS
    ours = sw.compile_generate(cls(config()).eval(), decode_gemv=True, pdl=True, **kw)
    assert [p for p in ours._options["graph_passes"] if isinstance(p, sw.library.DecodeGemv)] == \
        [sw.library.DecodeGemv(norm=True)]
    given = sw.compile_generate(cls(config()).eval(), decode_gemv=True, pdl=True, graph_passes=[mine], **kw)
    assert [p for p in given._options["graph_passes"] if isinstance(p, sw.library.DecodeGemv)] == \
        [sw.library.DecodeGemv(max_tokens=2, pdl=True, **CPU)]


@pytest.mark.gpu
@pytest.mark.parametrize("decode_gemv", [None, False])
def test_compile_generate_runs_the_gemv_by_default_under_full_graphs(decode_gemv):
    # bf16 on the GPU under full CUDA graphs: by default (None) each decode linear is a shapewise::gemv
    # (or gemv_group after FuseProjections), logits within bf16's own error of fp32; False leaves none.
    from tests.library.test_fuse_projections import bf16_decode_against_fp32

    fast, model = bf16_decode_against_fp32("llama", decode_gemv=decode_gemv)
    code = "".join((v.gm or p.gm).code for p in fast.runnables[-1].program.compute_pieces for v in p.variants)
    # gemv, gemv_group and (by default, gemv_norm: the one-row products whose kernel the tuner chose) gemv_norm
    ops = code.count("torch.ops.shapewise.gemv")
    # per layer: the packed q/k/v group, o, the packed gate/up group, down; and the head
    assert ops == (4 * model.config.num_hidden_layers + 1 if decode_gemv is None else 0), code.count("gemv")


def test_dtensor_weights_are_left_to_the_linear():
    # A tensor-parallel rank's weights (DTensor, a gloo mesh of one here): the op has no sharding
    # rule, so the pass leaves those linears alone (before, the compile failed in Lower).
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if dist.is_initialized():
        pytest.skip("a process group exists already in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
        parallelize_module(model, DeviceMesh("cpu", [0]), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fast = sw.compile(model, dynamic_dims={"input": {0: "n"}}, sizes={"n": [1, 4]}, backend="aot_eager",
                          graph_passes=[sw.library.DecodeGemv(**CPU)])
        with torch.no_grad():
            for n in (1, 4):
                x = torch.randn(n, 32)
                assert_same(fast(x), model(x), f"n={n}")
        codes = [(v.gm or p.gm).code for r in fast.runnables for p in r.program.compute_pieces for v in p.variants]
        assert len(codes) == 2 and not any("shapewise.gemv" in c for c in codes)
    finally:
        dist.destroy_process_group()
