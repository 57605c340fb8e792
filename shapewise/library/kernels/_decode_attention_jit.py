"""The Triton kernels of ``shapewise::decode_attention`` (``decode_attention.py`` says what they
compute and how they are launched); imported on the first launch, so that importing shapewise
does not import Triton. Without Triton it defines nothing (the op runs SDPA: ``_fast_path``)."""

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def combine(part_ml_ptr, part_acc_ptr, out_ptr, bh, b, h, parts, rows, sob, soh, son,
                PARTS_P2: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr, DV_P2: tl.constexpr):
        """Head ``bh``'s output from its slices' partial sums (read past L1: other programs wrote them)."""
        rp = tl.arange(0, PARTS_P2)
        rn = tl.arange(0, BLOCK_N)
        rdv = tl.arange(0, DV_P2)
        first = bh * parts * BLOCK_N
        m = tl.load(part_ml_ptr + (first + rp[:, None] * BLOCK_N + rn[None, :]) * 2, mask=(rp < parts)[:, None],
                    other=float("-inf"), cache_modifier=".cg")  # [PARTS_P2, BLOCK_N]: each slice's max, per row
        m_all = tl.max(m, 0)
        m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
        total = tl.zeros((BLOCK_N,), tl.float32)
        acc = tl.zeros((BLOCK_N, DV_P2), tl.float32)
        for p in range(0, parts):
            row = first + p * BLOCK_N + rn
            w = tl.exp(tl.load(part_ml_ptr + row * 2, cache_modifier=".cg") - m_use)
            total += w * tl.load(part_ml_ptr + row * 2 + 1, cache_modifier=".cg")
            acc += w[:, None] * tl.load(part_acc_ptr + row[:, None] * DV_P2 + rdv[None, :], cache_modifier=".cg")
        out = acc / total[:, None]
        tl.store(out_ptr + b * sob + h * soh + rn[:, None] * son + rdv[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(rn[:, None] < rows) & (rdv[None, :] < DV))


    @triton.jit
    def attend_slices(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ml_ptr, part_acc_ptr, count_ptr,
                      H, S, chunk, scale, rows,
                      sqb, sqh, sqn, skb, skh, sks, svb, svh, svs, smb, sms_, sob, soh, son,
                      HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, SPLIT: tl.constexpr,
                      LAST_COMBINES: tl.constexpr, PARTS_P2: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                      DV: tl.constexpr, DV_P2: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # (kernels/pdl.py) the query, the cache and the counters are the kernels ahead's
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bh = tl.program_id(0)
        part = tl.program_id(1)
        b = bh // H
        h = bh % H
        rn = tl.arange(0, BLOCK_N)
        rd = tl.arange(0, D_P2)
        rdv = tl.arange(0, DV_P2)
        n_ok = rn < rows
        q = tl.load(q_ptr + b * sqb + h * sqh + rn[:, None] * sqn + rd[None, :],
                    mask=n_ok[:, None] & (rd[None, :] < D), other=0.0)
        k_base = k_ptr + b * skb + h * skh
        v_base = v_ptr + b * svb + h * svh
        m_i = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_N,), tl.float32)
        acc = tl.zeros((BLOCK_N, DV_P2), tl.float32)
        lo = part * chunk
        for step in range(0, chunk, BLOCK_S):  # (the last slice's tiles past S load nothing)
            rs = lo + step + tl.arange(0, BLOCK_S)
            s_ok = rs < S
            k = tl.load(k_base + rs[:, None] * sks + rd[None, :], mask=s_ok[:, None] & (rd[None, :] < D), other=0.0)
            qk = tl.dot(q, tl.trans(k)) * scale
            if HAS_MASK:
                if MASK_BOOL:
                    keep = tl.load(mask_ptr + b * smb + rs * sms_, mask=s_ok, other=0)
                    qk = tl.where(keep[None, :] != 0, qk, float("-inf"))
                else:
                    qk += tl.load(mask_ptr + b * smb + rs * sms_, mask=s_ok, other=0.0).to(tl.float32)[None, :]
            qk = tl.where(s_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing attended yet
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(qk - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + rs[:, None] * svs + rdv[None, :], mask=s_ok[:, None] & (rdv[None, :] < DV),
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLIT:
            parts = tl.num_programs(1)
            row = (bh * parts + part) * BLOCK_N + rn
            tl.store(part_ml_ptr + row * 2, m_i)
            tl.store(part_ml_ptr + row * 2 + 1, l_i)
            tl.store(part_acc_ptr + row[:, None] * DV_P2 + rdv[None, :], acc)
            if LAST_COMBINES:
                # Every thread's stores issued, then one atomic (acquire-release, GPU scope) counts
                # this program done: the program that counts last sees every slice's sums.
                tl.debug_barrier()
                done = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu")
                if done == parts - 1:
                    combine(part_ml_ptr, part_acc_ptr, out_ptr, bh, b, h, parts, rows, sob, soh, son,
                            PARTS_P2, BLOCK_N, DV, DV_P2)
                    tl.atomic_xchg(count_ptr + bh, 0, sem="relaxed", scope="gpu")  # ready for the next call
        else:
            out = acc / l_i[:, None]
            tl.store(out_ptr + b * sob + h * soh + rn[:, None] * son + rdv[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & (rdv[None, :] < DV))


    @triton.jit
    def combine_slices(part_ml_ptr, part_acc_ptr, out_ptr, H, parts, rows, sob, soh, son,
                       PARTS_P2: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr, DV_P2: tl.constexpr):
        bh = tl.program_id(0)
        combine(part_ml_ptr, part_acc_ptr, out_ptr, bh, bh // H, bh % H, parts, rows, sob, soh, son,
                PARTS_P2, BLOCK_N, DV, DV_P2)
