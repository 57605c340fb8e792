"""The Triton kernel of ``shapewise::gemv`` (``gemv.py`` says what it computes, how it is launched
and tuned); imported on the first launch, so that importing shapewise does not import Triton. Without Triton
it defines nothing (the op runs ``F.linear``: ``_fast_path``)."""

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _wait_for_producers(w_ptr, rn, k_lo, prefetch, N, K, swn, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                            ELEM: tl.constexpr, PF: tl.constexpr, EARLY: tl.constexpr):
        """PDL (kernels/pdl.py): prefetch, then wait for the kernels ahead; nothing they write is read or
        written before the wait. The prefetch: the first ``prefetch`` elements of this program's weight
        rows ``rn`` from K offset ``k_lo`` on, into L2, in PF parts a row (one bulk prefetch per thread; a
        part past the end moves nothing). ``EARLY``: the kernel behind may launch right after the wait
        (else ``_let_dependents_launch``, after the main loop, lets it)."""
        if PREFETCH:
            part = ((prefetch + PF - 1) // PF + 7) // 8 * 8
            start = k_lo + tl.arange(0, PF) * part
            size = tl.minimum(part, tl.minimum(k_lo + prefetch, K) - start)
            size = tl.where(size > 0, size * ELEM, 0).to(tl.int32)
            rows = tl.minimum(rn, N - 1)
            tl.inline_asm_elementwise(
                "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t"
                "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}", "=r,l,r",
                [w_ptr + rows[:, None] * swn + tl.minimum(start, K - 8)[None, :],
                 tl.zeros([BLOCK_N, PF], tl.int32) + size[None, :]], dtype=tl.int32, is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _let_dependents_launch(PDL: tl.constexpr, EARLY: tl.constexpr):
        """PDL: the kernel behind may launch once every program of this one has called this (or
        ended). Called after the main loop, its programs take multiprocessor slots only for this
        kernel's last programs' tails; called at the start (``EARLY``), they would sit waiting in slots
        this kernel's later programs need. (Either way they wait for this kernel's end and its writes.)"""
        if PDL and not EARLY:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _glu(g, u_ptrs, mask):
        """silu(g) * up in float32, rounded once to g's dtype (as Inductor's fused kernel does)."""
        gf = g.to(tl.float32)
        return (gf / (1.0 + tl.exp(-gf)) * tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32)).to(g.dtype)

    @triton.jit
    def _normed(x, ss, g_ptr, k_idx, K, SUM: tl.constexpr):
        """NORM (an RMSNorm before the product): ``x * g`` in x's dtype (the rows' 1 / rms scales the
        product after the loop), and with ``SUM`` the rows' sums of squares ``ss`` taken on from this tile."""
        xf = x.to(tl.float32)
        if SUM:
            ss += tl.sum(xf * xf, axis=1)
        g = tl.load(g_ptr + k_idx, mask=k_idx < K, other=0.0).to(tl.float32)
        return (xf * g[None, :]).to(x.dtype), ss

    # M (rows) is a plain argument, not specialised on its value (Triton would otherwise compile
    # apart for M == 1 and M == 16), and the number of K slices is the grid's: one binary per
    # tiling, split or not, and K's evenness serves every row count, so tuning compiles ~30
    # binaries for a model's five weights, not ~100.
    @triton.jit(do_not_specialize=["M", "prefetch"])
    def gemv_kernel(x_ptr, u_ptr, w_ptr, b_ptr, y_ptr, M, N, K, chunk, prefetch, sxm, sxk, swn, swk, g_ptr, r_ptr, eps,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                    ELEM: tl.constexpr, PF: tl.constexpr, GLU: tl.constexpr, EARLY: tl.constexpr,
                    SWAP: tl.constexpr = False, NORM: tl.constexpr = False, RES: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        k_lo = pid_k * chunk
        if PDL:
            _wait_for_producers(w_ptr, rn, k_lo, prefetch, N, K, swn, BLOCK_N, PREFETCH, ELEM, PF, EARLY)
        x_ptrs = x_ptr + rm[:, None] * sxm + (k_lo + rk)[None, :] * sxk
        u_ptrs = u_ptr + rm[:, None] * sxm + (k_lo + rk)[None, :] * sxk  # GLU: the up half (x's strides)
        w_ptrs = w_ptr + rn[:, None] * swn + (k_lo + rk)[None, :] * swk
        m_ok = rm[:, None] < M
        n_ok = rn[:, None] < N
        if SWAP:  # the weight is the product's M side (wgmma's 64-row tiles on Hopper), the rows its N side
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)  # NORM: the rows' sums of squares
        if NORM and SPLIT:  # over the whole row (this program's K slice alone would not do): x read once more
            for k0 in range(0, K, BLOCK_K):
                xs = tl.load(x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :] * sxk,
                             mask=m_ok & ((k0 + rk)[None, :] < K), other=0.0).to(tl.float32)
                ss += tl.sum(xs * xs, axis=1)
        for kk in range(0, chunk, BLOCK_K):
            if EVEN_K:
                x_ok = m_ok
                w = tl.load(w_ptrs, mask=n_ok, other=0.0)
            else:
                k_ok = (k_lo + kk + rk)[None, :] < K
                x_ok = m_ok & k_ok
                w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0.0)
            x = tl.load(x_ptrs, mask=x_ok, other=0.0)
            if GLU:  # x is silu(gate) * up
                x = _glu(x, u_ptrs, x_ok)
                u_ptrs += BLOCK_K * sxk
            if NORM:  # x * g now, the rows' 1 / rms after the loop (_normed)
                x, ss = _normed(x, ss, g_ptr, k_lo + kk + rk, K, not SPLIT)
            if SWAP:
                acc += tl.dot(w, tl.trans(x))
            else:
                acc += tl.dot(x, tl.trans(w))
            x_ptrs += BLOCK_K * sxk
            w_ptrs += BLOCK_K * swk
        _let_dependents_launch(PDL, EARLY)
        if SWAP:
            acc = tl.trans(acc)
        if NORM:
            acc = acc * tl.rsqrt(ss / K + eps)[:, None]
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
        y_ptrs = y_ptr + rm[:, None] * N + rn[None, :]
        y_ok = m_ok & (rn[None, :] < N)
        if RES:  # the residual added (by the first K slice's programs where split)
            res = tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=y_ok, other=0.0).to(tl.float32)
            acc += tl.where(pid_k == 0, res, 0.0)
        if not SPLIT:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
        else:
            tl.atomic_add(y_ptrs, acc, mask=y_ok)

    # The one-to-four-row kernel: no tensor cores (a dot pads the rows to 16) and no split-K: each
    # program takes BLOCK_N (1-8) whole weight rows, loads [BLOCK_N, BLOCK_K] weight tiles with 16-byte
    # vector loads, multiplies in float32 and sums along K. Small programs, many a multiprocessor: the
    # bytes in flight come from the number of programs, and no partial sums cross programs (no memset,
    # atomics or conversion kernel).
    @triton.jit(do_not_specialize=["M", "prefetch"])
    def gemv_rows_kernel(x_ptr, u_ptr, w_ptr, b_ptr, y_ptr, M, N, K, prefetch, sxm, sxk, swn, swk, g_ptr, r_ptr, eps,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                         ELEM: tl.constexpr, PF: tl.constexpr, GLU: tl.constexpr, EARLY: tl.constexpr,
                         NORM: tl.constexpr = False, RES: tl.constexpr = False):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rm = tl.arange(0, BLOCK_M)
        if PDL:
            _wait_for_producers(w_ptr, rn, 0, prefetch, N, K, swn, BLOCK_N, PREFETCH, ELEM, PF, EARLY)
        n_ok = rn[:, None] < N
        m_ok = rm[:, None] < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            if EVEN_K:
                w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :] * swk, mask=n_ok, other=0.0)
                x_ok = m_ok
            else:
                k_ok = kk[None, :] < K
                w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :] * swk, mask=n_ok & k_ok, other=0.0)
                x_ok = m_ok & k_ok
            x_off = rm[:, None] * sxm + kk[None, :] * sxk
            x = tl.load(x_ptr + x_off, mask=x_ok, other=0.0)
            if GLU:
                x = _glu(x, u_ptr + x_off, x_ok)
            if NORM:
                x, ss = _normed(x, ss, g_ptr, kk, K, True)
            if BLOCK_M == 1:
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
            else:
                acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        _let_dependents_launch(PDL, EARLY)
        if NORM:
            acc = acc * tl.rsqrt(ss / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y_ok = m_ok & (rn[None, :] < N)
        if RES:
            acc += tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=y_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_ok)
