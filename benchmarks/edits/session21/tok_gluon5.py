"""Prototype 5 (prototype 2 with the lean order of tok_gluon.py: each [C, K] tile consumed early, each output
stored once final):

Prototype 2: the K = V = 64, 16-token, bounded (-0.61) bf16 token pass in Gluon, 4 warps, with coalesced
16- and 8-byte loads. tok_gluon.py loaded every MMA operand straight into its register fragment, 4 bytes a lane,
which left half of each 32-byte sector unused (ncu: 50% excessive sectors, L1 at 82%). Here:

* the contraction index v of the V products is permuted, the same way in every operand (a product does not
  depend on the order of its sum): a thread's 16 elements of a row then sit in 2 x 16 contiguous bytes, loaded
  in memory order and relabelled by reshape / permute, which moves no data;
* the column index K of every [C, K] tile (inputs, states' columns, outputs) is permuted too (no product
  contracts over K here): a thread's 4 columns per row are 8 contiguous bytes, read and written in memory order;
* the scans over tokens use a blocked layout that keeps MN's columns per warp, so their conversions are
  warp-local (no barrier).
Same arguments and outputs as the shipped kernel (dense units)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

GATE_BOUND = gl.constexpr(-0.61)


@gluon.jit
def _add(x, y):
    return x + y


@gluon.jit
def _v_order_rows(x):
    """[C, 64] tile loaded in memory order of its columns (v) -> the A-fragment order of k = v."""
    x = gl.reshape(x, [x.shape[0], 2, 2, 2, 2, 2, 2])
    return gl.reshape(gl.permute(x, (0, 1, 4, 5, 2, 3, 6)), [x.shape[0], 64])


@gluon.jit
def _v_order_cols(x):
    """[64, N] tile loaded in memory order of its rows (v) -> the B-fragment order of k = v."""
    x = gl.reshape(x, [2, 2, 2, 2, 2, 2, x.shape[-1]])
    return gl.reshape(gl.permute(x, (0, 3, 4, 1, 2, 5, 6)), [64, x.shape[-1]])


@gluon.jit
def _k_logical(x):
    """[C, 64] tile in memory order of K -> the accumulator's (MN) order."""
    x = gl.reshape(x, [x.shape[0], 2, 2, 2, 2, 2, 2])
    return gl.reshape(gl.permute(x, (0, 5, 1, 2, 3, 4, 6)), [x.shape[0], 64])


@gluon.jit
def _k_memory(x):
    """The inverse of _k_logical."""
    x = gl.reshape(x, [x.shape[0], 2, 2, 2, 2, 2, 2])
    return gl.reshape(gl.permute(x, (0, 2, 3, 4, 5, 1, 6)), [x.shape[0], 64])


@gluon.jit
def _kmem(n):
    """Memory column of logical column n (the inverse map of _k_logical)."""
    return (n & 1) + 2 * ((n >> 5) & 1) + 4 * ((n >> 1) & 3) + 16 * ((n >> 3) & 3)


@gluon.jit
def token_pass_lean5(
    q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg,
    scale, T, H,
    K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr,
):
    gl.static_assert(K == 64)
    gl.static_assert(V == 64)
    gl.static_assert(BC == 16)
    gl.static_assert(gl.num_warps() == 4)
    MN: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    MR: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    AN: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MN, k_width=2)
    BN: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MN, k_width=2)
    AR: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MR, k_width=2)  # the same register layout as AN
    BR: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MR, k_width=2)
    AN1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MN, k_width=1)
    BN1: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MN, k_width=1)
    SC: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[4, 8], warps_per_cta=[1, 4],
                                        order=[1, 0])
    # load layouts, in memory coordinates
    LA: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [8, 0]],
                                                  lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                                  warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[16, 64])
    LB: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [4, 0], [32, 0], [0, 32]],
                                                  lane_bases=[[8, 0], [16, 0], [0, 1], [0, 2], [0, 4]],
                                                  warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[64, 64])
    LBR: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [4, 0], [32, 0], [0, 8]],
                                                   lane_bases=[[8, 0], [16, 0], [0, 1], [0, 2], [0, 4]],
                                                   warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[64, 16])
    LQ: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                                  lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                  warp_bases=[[0, 16], [0, 32]], block_bases=[], shape=[16, 64])

    i_sh = gl.program_id(0)
    i_h = i_sh % H
    slot = (i_sh // H).to(gl.int64)
    NT = gl.cdiv(T, BC)
    i_n = slot // NT
    i_t = (slot % NT).to(gl.int32)
    t0 = i_n * T + i_t * BC
    lenc = gl.minimum(T - i_t * BC, BC)
    p_hs = (slot * H + i_h) * K * V

    # ---- the V products ----
    ca = gl.arange(0, BC, layout=gl.SliceLayout(1, LA))
    va = gl.arange(0, BV, layout=gl.SliceLayout(0, LA))
    p_ya = ((t0 + ca[:, None]) * H + i_h) * V + va[None, :]
    m_ya = (ca[:, None] < lenc) & (va[None, :] < V)
    b_do = gl.convert_layout(_v_order_rows(gl.load(do + p_ya, mask=m_ya, other=0.)), AN)
    b_dr = gl.convert_layout(_v_order_rows(gl.load(dr + p_ya, mask=m_ya, other=0.)), AN)
    b_v = gl.convert_layout(_v_order_rows(gl.load(v + p_ya, mask=m_ya, other=0.)), AN)
    b_u = gl.convert_layout(_v_order_rows(gl.load(u + p_ya, mask=m_ya, other=0.)), AN)
    vr = gl.arange(0, BV, layout=gl.SliceLayout(1, LBR))
    cr = gl.arange(0, BC, layout=gl.SliceLayout(0, LBR))
    p_yr = ((t0 + cr[None, :]) * H + i_h) * V + vr[:, None]
    m_yr = (cr[None, :] < lenc) & (vr[:, None] < V)
    b_vT = gl.convert_layout(_v_order_cols(gl.load(v + p_yr, mask=m_yr, other=0.)), BR)
    b_uT = gl.convert_layout(_v_order_cols(gl.load(u + p_yr, mask=m_yr, other=0.)), BR)
    vb = gl.arange(0, BV, layout=gl.SliceLayout(1, LB))
    nb = gl.arange(0, BK, layout=gl.SliceLayout(0, LB))
    p_s = p_hs + _kmem(nb)[None, :] * V + vb[:, None]
    m_s = (nb[None, :] < K) & (vb[:, None] < V) & (lenc > 0)
    S0T = gl.convert_layout(_v_order_cols(gl.load(h + p_s, mask=m_s, other=0.)), BN)
    dST = gl.convert_layout(_v_order_cols(gl.load(dh + p_s, mask=m_s, other=0.)), BN)

    zr = gl.zeros([BC, BC], gl.float32, layout=MR)
    r_do = gl.convert_layout(b_do, AR, assert_trivial=True)
    r_dr = gl.convert_layout(b_dr, AR, assert_trivial=True)
    dAqk = mma_v2(r_do, b_vT, zr)
    dAqb = mma_v2(r_do, b_uT, zr)
    dAak = mma_v2(r_dr, b_vT, zr)
    dAab = mma_v2(r_dr, b_uT, zr)
    zn = gl.zeros([BC, BK], gl.float32, layout=MN)
    dQw = mma_v2(b_do, S0T, zn)
    dAw = mma_v2(b_dr, S0T, zn)
    dKw = mma_v2(b_v, dST, zn)
    dBw = mma_v2(b_u, dST, zn)
    dgS = gl.convert_layout(gl.sum(dST.to(gl.float32) * S0T.to(gl.float32), 0), gl.SliceLayout(0, MN))

    # ---- the gates, in the accumulators' layout (columns in the permuted K order) ----
    cq = gl.arange(0, BC, layout=gl.SliceLayout(1, LQ))
    kq = gl.arange(0, BK, layout=gl.SliceLayout(0, LQ))
    p_x = ((t0 + cq[:, None]) * H + i_h) * K + kq[None, :]
    m_x = (cq[:, None] < lenc) & (kq[None, :] < K)
    b_q = gl.convert_layout(_k_logical(gl.load(q + p_x, mask=m_x, other=0.)), MN).to(gl.float32)
    b_k = gl.convert_layout(_k_logical(gl.load(k + p_x, mask=m_x, other=0.)), MN).to(gl.float32)
    b_a = gl.convert_layout(_k_logical(gl.load(a + p_x, mask=m_x, other=0.)), MN).to(gl.float32)
    b_b = gl.convert_layout(_k_logical(gl.load(b + p_x, mask=m_x, other=0.)), MN).to(gl.float32)
    g_raw = gl.convert_layout(_k_logical(gl.load(gk + p_x, mask=m_x, other=0.)), MN).to(gl.float32)
    # lean order: each [C, K] tile consumed as early as it can be, each output stored once final
    keep_g = g_raw >= GATE_BOUND
    g = gl.maximum(g_raw, GATE_BOUND)
    gam = gl.convert_layout(gl.associative_scan(gl.convert_layout(g, SC), 0, _add), MN)
    gamp = gam - g
    gCv = gl.sum(g, 0)
    ed = gl.exp(gl.expand_dims(gCv, 0) - gam)
    Bw = (b_b * ed).to(gl.bfloat16).to(gl.float32)
    Kw = (b_k * ed).to(gl.bfloat16).to(gl.float32)
    dgC = gl.exp(gCv) * dgS + gl.sum(Bw * dBw + Kw * dKw, 0)
    x = -(Kw * dKw) - Bw * dBw
    b_dk = dKw * ed
    b_db = dBw * ed
    dQw = dQw * scale
    egam = gl.exp(gam)
    x += (b_q * egam).to(gl.bfloat16).to(gl.float32) * dQw
    b_dq = dQw * egam
    egamp = gl.exp(gamp)
    xa = (b_a * egamp).to(gl.bfloat16).to(gl.float32) * dAw
    x += xa
    b_da = dAw * egamp

    cn = gl.arange(0, BC, layout=gl.SliceLayout(1, MN))
    rr = gl.arange(0, BC, layout=gl.SliceLayout(1, MR))
    cc = gl.arange(0, BC, layout=gl.SliceLayout(0, MR))
    low = rr[:, None] >= cc[None, :]
    slow = rr[:, None] > cc[None, :]
    gr = gl.expand_dims(gl.sum(gl.where(cn[:, None] == BC // 2 - 1, gam, 0.), 0), 0)
    fk = gl.exp(gr - gam)
    Kf = b_k * fk
    Bf = b_b * fk
    Kf_b = gl.convert_layout(Kf, BN1)
    Bf_b = gl.convert_layout(Bf, BN1)
    dAqk = gl.where(low, dAqk * scale, 0.)
    dAqb = gl.where(low, dAqb * scale, 0.)
    fq = gl.exp(gam - gr)
    Qf = b_q * fq
    dQf = mma_v2(gl.convert_layout(dAqb, AN1), Bf_b,
                 mma_v2(gl.convert_layout(dAqk, AN1), Kf_b, zn, input_precision="tf32"), input_precision="tf32")
    gl.store(dq + p_x, gl.convert_layout(_k_memory((b_dq + dQf * fq).to(dq.dtype.element_ty)), LQ), mask=m_x)
    x += Qf * dQf
    dAak = gl.where(slow, dAak, 0.)
    dAab = gl.where(slow, dAab, 0.)
    fa = gl.exp(gamp - gr)
    Af = b_a * fa
    dAf = mma_v2(gl.convert_layout(dAab, AN1), Bf_b,
                 mma_v2(gl.convert_layout(dAak, AN1), Kf_b, zn, input_precision="tf32"), input_precision="tf32")
    gl.store(da + p_x, gl.convert_layout(_k_memory((b_da + dAf * fa).to(da.dtype.element_ty)), LQ), mask=m_x)
    xa_i = Af * dAf
    x += xa_i
    xa += xa_i
    Qf_b = gl.convert_layout(Qf, BN1)
    Af_b = gl.convert_layout(Af, BN1)
    dKf = mma_v2(gl.convert_layout(gl.permute(dAak, (1, 0)), AN1), Af_b,
                 mma_v2(gl.convert_layout(gl.permute(dAqk, (1, 0)), AN1), Qf_b, zn, input_precision="tf32"),
                 input_precision="tf32")
    gl.store(dk + p_x, gl.convert_layout(_k_memory((b_dk + dKf * fk).to(dk.dtype.element_ty)), LQ), mask=m_x)
    x -= Kf * dKf
    dBf = mma_v2(gl.convert_layout(gl.permute(dAab, (1, 0)), AN1), Af_b,
                 mma_v2(gl.convert_layout(gl.permute(dAqb, (1, 0)), AN1), Qf_b, zn, input_precision="tf32"),
                 input_precision="tf32")
    gl.store(db + p_x, gl.convert_layout(_k_memory((b_db + dBf * fk).to(db.dtype.element_ty)), LQ), mask=m_x)
    x -= Bf * dBf
    b_dg = gl.convert_layout(gl.associative_scan(gl.convert_layout(x, SC), 0, _add, reverse=True), MN)
    b_dg = gl.where(keep_g, b_dg - xa + gl.expand_dims(dgC, 0), 0.)
    gl.store(dg + p_x, gl.convert_layout(_k_memory(b_dg.to(dg.dtype.element_ty)), LQ), mask=m_x)
