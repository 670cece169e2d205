"""Prototype: the K = V = 64, 16-token, bounded (-0.61) bf16 token pass (chunk_dplr_bwd_kernel) written in Gluon
with every MMA operand loaded straight from global memory into its register fragment, and the elementwise work
done in the MMA accumulator layout, so that the program needs (almost) no shared memory and no barriers.
Same arguments and outputs as the shipped kernel (dense units)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

GATE_BOUND = gl.constexpr(-0.61)


@gluon.jit
def _add(x, y):
    return x + y


@gluon.jit
def _iop(x, layout: gl.constexpr, BF16: gl.constexpr):
    """An operand of the intra-chunk products: fp32 (tf32 products, as shipped) or rounded to bf16."""
    if BF16:
        return gl.convert_layout(x.to(gl.bfloat16), layout)
    else:
        return gl.convert_layout(x, layout)


@gluon.jit
def _token_pass(
    q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg,
    scale, T, H,
    K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr,
    CC_SPLIT: gl.constexpr, LEAN: gl.constexpr, IBF16: gl.constexpr = False,
):
    # [C, K] accumulators and every elementwise tile: warps split K (16 columns each), a warp holds all C rows
    NW: gl.constexpr = gl.num_warps()
    MN: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    # [C, C] products: every warp computes the whole 16 x 16 tile (replicated), so that their use as an A operand
    # later is warp-local
    # (CC_SPLIT: the [C, C] products split over the warps like the [C, K] ones, not replicated)
    if CC_SPLIT:
        MR: gl.constexpr = MN
    else:
        MR: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    AN: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MN, k_width=2)
    BN: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MN, k_width=2)
    AR: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MR, k_width=2)
    BR: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MR, k_width=2)
    # tf32 operands of the intra-chunk products (fp32, as the shipped kernel's)
    AN1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MN, k_width=2 if IBF16 else 1)
    # the scans over tokens (Triton lowers tt.scan on blocked layouts only): each warp keeps its 16 columns,
    # a thread 4 consecutive tokens, so that the conversions from and to MN stay within a warp
    SC: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, BK // NW // 8], threads_per_warp=[4, 8], warps_per_cta=[1, NW],
                                        order=[1, 0])
    BN1: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MN, k_width=2 if IBF16 else 1)

    i_sh = gl.program_id(0)
    i_h = i_sh % H
    slot = (i_sh // H).to(gl.int64)
    NT = gl.cdiv(T, BC)
    i_n = slot // NT
    i_t = (slot % NT).to(gl.int32)
    t0 = i_n * T + i_t * BC
    lenc = gl.minimum(T - i_t * BC, BC)
    p_hs = (slot * H + i_h) * K * V

    # ---- the V products (V = BV: one tile) ----
    # A operands [C, V]: rows = tokens, columns = v
    ca = gl.arange(0, BC, layout=gl.SliceLayout(1, AN))
    va = gl.arange(0, BV, layout=gl.SliceLayout(0, AN))
    p_ya = ((t0 + ca[:, None]) * H + i_h) * V + va[None, :]
    m_ya = (ca[:, None] < lenc) & (va[None, :] < V)
    b_do = gl.load(do + p_ya, mask=m_ya, other=0.)
    b_dr = gl.load(dr + p_ya, mask=m_ya, other=0.)
    b_v = gl.load(v + p_ya, mask=m_ya, other=0.)
    b_u = gl.load(u + p_ya, mask=m_ya, other=0.)
    # B operands [V, C] of the [C, C] products
    vr = gl.arange(0, BV, layout=gl.SliceLayout(1, BR))
    cr = gl.arange(0, BC, layout=gl.SliceLayout(0, BR))
    p_yr = ((t0 + cr[None, :]) * H + i_h) * V + vr[:, None]
    m_yr = (cr[None, :] < lenc) & (vr[:, None] < V)
    b_vT = gl.load(v + p_yr, mask=m_yr, other=0.)
    b_uT = gl.load(u + p_yr, mask=m_yr, other=0.)
    # B operands [V, K] of the [C, K] products: the states, stored [K, V]
    vb = gl.arange(0, BV, layout=gl.SliceLayout(1, BN))
    kb = gl.arange(0, BK, layout=gl.SliceLayout(0, BN))
    p_s = p_hs + kb[None, :] * V + vb[:, None]
    m_s = (kb[None, :] < K) & (vb[:, None] < V) & (lenc > 0)
    S0T = gl.load(h + p_s, mask=m_s, other=0.)
    dST = gl.load(dh + p_s, mask=m_s, other=0.)

    zr = gl.zeros([BC, BC], gl.float32, layout=MR)
    dAqk = mma_v2(gl.convert_layout(b_do, AR), b_vT, zr)
    dAqb = mma_v2(gl.convert_layout(b_do, AR), b_uT, zr)
    dAak = mma_v2(gl.convert_layout(b_dr, AR), b_vT, zr)
    dAab = mma_v2(gl.convert_layout(b_dr, AR), b_uT, zr)
    zn = gl.zeros([BC, BK], gl.float32, layout=MN)
    dQw = mma_v2(b_do, S0T, zn)
    dAw = mma_v2(b_dr, S0T, zn)
    dKw = mma_v2(b_v, dST, zn)
    dBw = mma_v2(b_u, dST, zn)
    dgS = gl.sum(dST.to(gl.float32) * S0T.to(gl.float32), 0)  # [K]: sum over v of dS * S0
    dgS = gl.convert_layout(dgS, gl.SliceLayout(0, MN))

    # ---- the gates, in the accumulators' layout ----
    cn = gl.arange(0, BC, layout=gl.SliceLayout(1, MN))
    kn = gl.arange(0, BK, layout=gl.SliceLayout(0, MN))
    p_x = ((t0 + cn[:, None]) * H + i_h) * K + kn[None, :]
    m_x = (cn[:, None] < lenc) & (kn[None, :] < K)
    g_raw = gl.load(gk + p_x, mask=m_x, other=0.).to(gl.float32)
    b_q = gl.load(q + p_x, mask=m_x, other=0.).to(gl.float32)
    b_k = gl.load(k + p_x, mask=m_x, other=0.).to(gl.float32)
    b_a = gl.load(a + p_x, mask=m_x, other=0.).to(gl.float32)
    b_b = gl.load(b + p_x, mask=m_x, other=0.).to(gl.float32)
    if LEAN:
        # every tile consumed as early as it can be: the state-path terms first, each output stored once final
        keep_g = g_raw >= GATE_BOUND
        g = gl.maximum(g_raw, GATE_BOUND)
        gam = gl.convert_layout(gl.associative_scan(gl.convert_layout(g, SC), 0, _add), MN)
        gamp = gam - g
        gCv = gl.sum(g, 0)
        ed = gl.exp(gl.expand_dims(gCv, 0) - gam)
        Bw = (b_b * ed).to(gl.bfloat16).to(gl.float32)
        Kw = (b_k * ed).to(gl.bfloat16).to(gl.float32)
        dgC = gl.exp(gCv) * dgS + gl.sum(Bw * dBw + Kw * dKw, 0)
        dQw = dQw * scale
        egam = gl.exp(gam)
        egamp = gl.exp(gamp)
        Aw = (b_a * egamp).to(gl.bfloat16).to(gl.float32)
        xa = Aw * dAw
        x = (b_q * egam).to(gl.bfloat16).to(gl.float32) * dQw - Kw * dKw - Bw * dBw + xa
        b_dq = dQw * egam
        b_da = dAw * egamp
        b_dk = dKw * ed
        b_db = dBw * ed

        rr = gl.arange(0, BC, layout=gl.SliceLayout(1, MR))
        cc = gl.arange(0, BC, layout=gl.SliceLayout(0, MR))
        low = rr[:, None] >= cc[None, :]
        slow = rr[:, None] > cc[None, :]
        gr = gl.expand_dims(gl.sum(gl.where(cn[:, None] == BC // 2 - 1, gam, 0.), 0), 0)
        fk = gl.exp(gr - gam)
        Kf = b_k * fk
        Bf = b_b * fk
        Kf_b = _iop(Kf, BN1, IBF16)
        Bf_b = _iop(Bf, BN1, IBF16)
        dAqk = gl.where(low, dAqk * scale, 0.)
        dAqb = gl.where(low, dAqb * scale, 0.)
        fq = gl.exp(gam - gr)
        Qf = b_q * fq
        dQf = mma_v2(_iop(dAqb, AN1, IBF16), Bf_b, mma_v2(_iop(dAqk, AN1, IBF16), Kf_b, zn,
                                                                    input_precision="tf32"), input_precision="tf32")
        gl.store(dq + p_x, (b_dq + dQf * fq).to(dq.dtype.element_ty), mask=m_x)
        x += Qf * dQf
        dAak = gl.where(slow, dAak, 0.)
        dAab = gl.where(slow, dAab, 0.)
        fa = gl.exp(gamp - gr)
        Af = b_a * fa
        dAf = mma_v2(_iop(dAab, AN1, IBF16), Bf_b, mma_v2(_iop(dAak, AN1, IBF16), Kf_b, zn,
                                                                    input_precision="tf32"), input_precision="tf32")
        gl.store(da + p_x, (b_da + dAf * fa).to(da.dtype.element_ty), mask=m_x)
        xa_i = Af * dAf
        x += xa_i
        xa += xa_i
        Qf_b = _iop(Qf, BN1, IBF16)
        Af_b = _iop(Af, BN1, IBF16)
        dKf = mma_v2(_iop(gl.permute(dAak, (1, 0)), AN1, IBF16), Af_b,
                     mma_v2(_iop(gl.permute(dAqk, (1, 0)), AN1, IBF16), Qf_b, zn, input_precision="tf32"),
                     input_precision="tf32")
        gl.store(dk + p_x, (b_dk + dKf * fk).to(dk.dtype.element_ty), mask=m_x)
        x -= Kf * dKf
        dBf = mma_v2(_iop(gl.permute(dAab, (1, 0)), AN1, IBF16), Af_b,
                     mma_v2(_iop(gl.permute(dAqb, (1, 0)), AN1, IBF16), Qf_b, zn, input_precision="tf32"),
                     input_precision="tf32")
        gl.store(db + p_x, (b_db + dBf * fk).to(db.dtype.element_ty), mask=m_x)
        x -= Bf * dBf
        b_dg = gl.convert_layout(gl.associative_scan(gl.convert_layout(x, SC), 0, _add, reverse=True), MN)
        b_dg = gl.where(keep_g, b_dg - xa + gl.expand_dims(dgC, 0), 0.)
        gl.store(dg + p_x, b_dg.to(dg.dtype.element_ty), mask=m_x)
    else:
        g = gl.maximum(g_raw, GATE_BOUND)
        gam = gl.convert_layout(gl.associative_scan(gl.convert_layout(g, SC), 0, _add), MN)
        gamp = gam - g
        gCv = gl.sum(g, 0)
        gC = gl.expand_dims(gCv, 0)
        ed = gl.exp(gC - gam)
        Qw = (b_q * gl.exp(gam)).to(gl.bfloat16).to(gl.float32)
        Aw = (b_a * gl.exp(gamp)).to(gl.bfloat16).to(gl.float32)
        Bw = (b_b * ed).to(gl.bfloat16).to(gl.float32)
        Kw = (b_k * ed).to(gl.bfloat16).to(gl.float32)
        dgC = gl.exp(gCv) * dgS + gl.sum(Bw * dBw + Kw * dKw, 0)

        # ---- the intra-chunk gradients (factored form, centred at row BC/2 - 1) ----
        rr = gl.arange(0, BC, layout=gl.SliceLayout(1, MR))
        cc = gl.arange(0, BC, layout=gl.SliceLayout(0, MR))
        low = rr[:, None] >= cc[None, :]
        slow = rr[:, None] > cc[None, :]
        dAqk = gl.where(low, dAqk * scale, 0.)
        dAqb = gl.where(low, dAqb * scale, 0.)
        dAak = gl.where(slow, dAak, 0.)
        dAab = gl.where(slow, dAab, 0.)
        gr = gl.expand_dims(gl.sum(gl.where(cn[:, None] == BC // 2 - 1, gam, 0.), 0), 0)
        fq = gl.exp(gam - gr)
        fk = gl.exp(gr - gam)
        fa = gl.exp(gamp - gr)
        Qf = b_q * fq
        Kf = b_k * fk
        Bf = b_b * fk
        Af = b_a * fa
        Kf_b = _iop(Kf, BN1, IBF16)
        Bf_b = _iop(Bf, BN1, IBF16)
        Qf_b = _iop(Qf, BN1, IBF16)
        Af_b = _iop(Af, BN1, IBF16)
        dQf = mma_v2(_iop(dAqb, AN1, IBF16), Bf_b, mma_v2(_iop(dAqk, AN1, IBF16), Kf_b, zn,
                                                                    input_precision="tf32"), input_precision="tf32")
        dAf = mma_v2(_iop(dAab, AN1, IBF16), Bf_b, mma_v2(_iop(dAak, AN1, IBF16), Kf_b, zn,
                                                                    input_precision="tf32"), input_precision="tf32")
        dKf = mma_v2(_iop(gl.permute(dAak, (1, 0)), AN1, IBF16), Af_b,
                     mma_v2(_iop(gl.permute(dAqk, (1, 0)), AN1, IBF16), Qf_b, zn, input_precision="tf32"),
                     input_precision="tf32")
        dBf = mma_v2(_iop(gl.permute(dAab, (1, 0)), AN1, IBF16), Af_b,
                     mma_v2(_iop(gl.permute(dAqb, (1, 0)), AN1, IBF16), Qf_b, zn, input_precision="tf32"),
                     input_precision="tf32")
        xa_i = Af * dAf
        x_i = Qf * dQf - Kf * dKf - Bf * dBf + xa_i

        # ---- combine and store ----
        dQw = dQw * scale
        b_dq = dQw * gl.exp(gam) + dQf * fq
        b_da = dAw * gl.exp(gamp) + dAf * fa
        b_dk = dKw * ed + dKf * fk
        b_db = dBw * ed + dBf * fk
        xa = Aw * dAw + xa_i
        x = Qw * dQw - Kw * dKw - Bw * dBw + Aw * dAw + x_i
        b_dg = gl.convert_layout(gl.associative_scan(gl.convert_layout(x, SC), 0, _add, reverse=True), MN) - xa + gl.expand_dims(dgC, 0)
        b_dg = gl.where(g_raw >= GATE_BOUND, b_dg, 0.)
        gl.store(dq + p_x, b_dq.to(dq.dtype.element_ty), mask=m_x)
        gl.store(dk + p_x, b_dk.to(dk.dtype.element_ty), mask=m_x)
        gl.store(da + p_x, b_da.to(da.dtype.element_ty), mask=m_x)
        gl.store(db + p_x, b_db.to(db.dtype.element_ty), mask=m_x)
        gl.store(dg + p_x, b_dg.to(dg.dtype.element_ty), mask=m_x)



@gluon.jit
def token_pass_gluon(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H,
                     K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr):
    _token_pass(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H, K, V, BC, BK, BV, False, False)


@gluon.jit
def token_pass_split(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H,
                     K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr):
    _token_pass(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H, K, V, BC, BK, BV, True, False)


@gluon.jit
def token_pass_lean(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H,
                    K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr):
    _token_pass(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H, K, V, BC, BK, BV, False, True)


@gluon.jit
def token_pass_lean_split(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H,
                          K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr,
                          BV: gl.constexpr):
    _token_pass(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H, K, V, BC, BK, BV, True, True)


@gluon.jit
def token_pass_lean_bf16(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H,
                         K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr):
    _token_pass(q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H, K, V, BC, BK, BV, False, True,
                True)
