"""Session 25 prototype: the K = 128 deriving token pass (bf16, dense, w in bf16, bound -0.61, 16-token chunks,
states kept every 32 tokens) as a persistent Gluon kernel that copies the next V tile's tiles (and the next work
item's K-half tiles) into shared memory while it computes the current one. Work item = (chunk slot, head, K half);
the two V tiles of an item take the two tile stages, the item's own [C, BK] and [BK, C] tiles alternate between
two item stages. Same arguments as the shipped unit's chunk_dplr_bwd_kernel plus n_items (work items).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

GATE_BOUND = gl.constexpr(-0.61)
HC = gl.constexpr(32)  # tokens per kept state

MN = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8]))
MR = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]))
AN = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MN, k_width=2))
AR = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MR, k_width=2))
BN = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MN, k_width=2))
BR = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MR, k_width=2))
AN1 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MN, k_width=1))
BN1 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MN, k_width=1))
SC = gl.constexpr(gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[4, 8], warps_per_cta=[1, 4],
                                   order=[1, 0]))
# copies: 16 bytes a thread; [16, 64] per 128 threads (wraps over [64, 64]); [64, 16] per 128 threads
LC = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                   order=[1, 0]))
LX = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[16, 2], warps_per_cta=[4, 1],
                                   order=[1, 0]))
SH = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
SX = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=4, max_phase=2, order=[1, 0]))
LQ = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                             lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                             warp_bases=[[0, 16], [0, 32]], block_bases=[], shape=[16, 64]))


@gluon.jit
def _g_add(x, y):
    return x + y


@gluon.jit
def _g_cumsum(x, reverse: gl.constexpr):
    return gl.convert_layout(gl.associative_scan(gl.convert_layout(x, SC), 0, _g_add, reverse=reverse), MN)


@gluon.jit
def _k_logical(x):
    x = gl.reshape(x, [x.shape[0], 2, 2, 2, 2, 2, 2])
    return gl.reshape(gl.permute(x, (0, 5, 1, 2, 3, 4, 6)), [x.shape[0], 64])


@gluon.jit
def _k_memory(x):
    x = gl.reshape(x, [x.shape[0], 2, 2, 2, 2, 2, 2])
    return gl.reshape(gl.permute(x, (0, 2, 3, 4, 5, 1, 6)), [x.shape[0], 64])


@gluon.jit
def _kmem(n):
    return (n & 1) + 2 * ((n >> 5) & 1) + 4 * ((n >> 1) & 3) + 16 * ((n >> 3) & 3)


@gluon.jit
def _rows_mr(r):
    return (r & 7) + 32 * ((r >> 3) & 1) + 8 * ((r >> 4) & 3)


@gluon.jit
def _mr_to_k(x):
    x = gl.reshape(x, [2, 2, 2, 8, x.shape[1]])
    return gl.reshape(gl.permute(x, (2, 0, 1, 3, 4)), [64, x.shape[4]])


@gluon.jit
def _k_to_mr(x):
    x = gl.reshape(x, [2, 2, 2, 8, x.shape[1]])
    return gl.reshape(gl.permute(x, (1, 2, 0, 3, 4)), [64, x.shape[4]])


@gluon.jit
def _in_mn(s):
    return gl.convert_layout(_k_logical(s.load(LQ)), MN, assert_trivial=True).to(gl.float32)


@gluon.jit
def _store_q(x, p, m, val):
    gl.store(x + p, gl.convert_layout(_k_memory(val.to(x.dtype.element_ty)), LQ), mask=m)


@gluon.jit
def _intra(dA1, Y1, dA2, Y2):
    zn = gl.zeros([Y1.shape[0], Y1.shape[1]], gl.float32, layout=MN)
    acc = mma_v2(gl.convert_layout(dA1, AN1), Y1, zn, input_precision="tf32")
    return mma_v2(gl.convert_layout(dA2, AN1), Y2, acc, input_precision="tf32")


@gluon.jit
def _locate(item, n_items, T, H, scale, K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr):
    """Where work item ``item`` (chunk slot * H + head) * 2 + K half lies: (first token, valid rows, head,
    first K column, offset of its kept state pair, whether it derives S (odd chunk) or dS (even chunk with a
    chunk after it), and the step's chunk slot * H + head, first token, rows and scale); nothing past n_items."""
    k0 = (item % (K // BK)) * BK
    sh = item // (K // BK)
    i_h = sh % H
    slot = (sh // H).to(gl.int64)
    NT = gl.cdiv(T, BC)
    i_t = (slot % NT).to(gl.int32)
    i_n = slot // NT
    t0 = i_n * T + i_t * BC
    lenc = gl.where(item < n_items, gl.minimum(T - i_t * BC, BC), 0)
    p_hs = ((i_n * gl.cdiv(T, HC) + i_t // 2) * H + i_h) * K * V
    odd = ((i_t % 2) == 1) & (lenc > 0)
    lenn = gl.minimum(T - (i_t + 1) * BC, BC)
    has_next = ((i_t % 2) == 0) & (lenn > 0) & (lenc > 0)
    p_op = gl.where(odd, slot - 1, slot + 1) * H + i_h
    t_op = gl.where(odd, t0 - BC, t0 + BC)
    len_op = gl.where(odd, BC, gl.where(has_next, lenn, 0))
    c_op = gl.where(odd, 1.0, scale)
    return t0, lenc, i_h, k0, p_hs, odd, has_next, p_op, t_op, len_op, c_op


@gluon.jit
def _issue_tile(item, i_v, s_do, s_dr, s_v, s_u, s_x, s_y, s_h, s_dh, v, h, dh, u, dr, do, n_items, T, H, scale,
                K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr):
    """Copies of V tile i_v of ``item`` into tile stage i_v: its rows of dO, dR, V, U, the step's rows of
    (U, V) or (dO, dR), and the kept S and dS [BK, BV] blocks (K rows in MN's order)."""
    t0, lenc, i_h, k0, p_hs, odd, has_next, p_op, t_op, len_op, c_op = _locate(item, n_items, T, H, scale,
                                                                               K, V, BC, BK)
    r = gl.arange(0, BC, layout=gl.SliceLayout(1, LC))
    c = gl.arange(0, BV, layout=gl.SliceLayout(0, LC))
    m = (r[:, None] < lenc) & (c[None, :] < BV)
    p_y = ((t0 + r[:, None]) * H + i_h) * V + i_v * BV + c[None, :]
    cp.async_copy_global_to_shared(s_do.index(i_v), do + p_y, mask=m)
    cp.async_copy_global_to_shared(s_dr.index(i_v), dr + p_y, mask=m)
    cp.async_copy_global_to_shared(s_v.index(i_v), v + p_y, mask=m)
    cp.async_copy_global_to_shared(s_u.index(i_v), u + p_y, mask=m)
    m_o = (r[:, None] < len_op) & (c[None, :] < BV)
    p_o = ((t_op + r[:, None]) * H + i_h) * V + i_v * BV + c[None, :]
    cp.async_copy_global_to_shared(s_x.index(i_v), gl.where(odd, u, do) + p_o, mask=m_o)
    cp.async_copy_global_to_shared(s_y.index(i_v), gl.where(odd, v, dr) + p_o, mask=m_o)
    rs = gl.arange(0, BK, layout=gl.SliceLayout(1, LC))
    p_s = p_hs + (k0 + _kmem(rs))[:, None] * V + i_v * BV + c[None, :]
    m_s = (rs[:, None] < BK) & (c[None, :] < BV) & (lenc > 0)
    cp.async_copy_global_to_shared(s_h.index(i_v), h + p_s, mask=m_s)
    cp.async_copy_global_to_shared(s_dh.index(i_v), dh + p_s, mask=m_s)


@gluon.jit
def _issue_item(item, st, s_q, s_k, s_a, s_b, s_g, s_xt, s_yt, q, k, a, b, gk, egc, bwt, kwt, qwt, awt,
                n_items, T, H, scale, K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr,
                COPY: gl.constexpr = True):
    """Copies of ``item``'s own [C, BK] input tiles and its step's [BK, C] operands (rows renamed for MR,
    _rows_mr) into item stage ``st``; returns the step's e^gamma_C rows (a plain load, used an item later)."""
    t0, lenc, i_h, k0, p_hs, odd, has_next, p_op, t_op, len_op, c_op = _locate(item, n_items, T, H, scale,
                                                                               K, V, BC, BK)
    steps = odd | has_next
    if COPY:
        r = gl.arange(0, BC, layout=gl.SliceLayout(1, LC))
        c = gl.arange(0, BK, layout=gl.SliceLayout(0, LC))
        m = (r[:, None] < lenc) & (c[None, :] < BK)
        p_x = ((t0 + r[:, None]) * H + i_h) * K + k0 + c[None, :]
        cp.async_copy_global_to_shared(s_q.index(st), q + p_x, mask=m)
        cp.async_copy_global_to_shared(s_k.index(st), k + p_x, mask=m)
        cp.async_copy_global_to_shared(s_a.index(st), a + p_x, mask=m)
        cp.async_copy_global_to_shared(s_b.index(st), b + p_x, mask=m)
        cp.async_copy_global_to_shared(s_g.index(st), gk + p_x, mask=m)
        steps = odd | has_next
        rx = gl.arange(0, BK, layout=gl.SliceLayout(1, LX))
        cx = gl.arange(0, BC, layout=gl.SliceLayout(0, LX))
        p_xt = p_op * BC * K + (k0 + _kmem(_rows_mr(rx)))[:, None] * BC + cx[None, :]
        m_xt = (rx[:, None] < BK) & (cx[None, :] < BC) & steps
        cp.async_copy_global_to_shared(s_xt.index(st), gl.where(odd, bwt, qwt) + p_xt, mask=m_xt)
        cp.async_copy_global_to_shared(s_yt.index(st), gl.where(odd, kwt, awt) + p_xt, mask=m_xt)
    re = gl.arange(0, BK, layout=gl.SliceLayout(1, MR))
    return gl.load(egc + p_op * K + k0 + _kmem(_rows_mr(re)), mask=(re < BK) & steps, other=0.)


@gluon.jit
def _kept_step(ST, eg, b_xt, b_yt, b_x, b_y, c):
    """S e^gamma_C + c X^T x + Y^T y over one chunk (the states pass's step over the chunk before, or the reverse
    pass's over the chunk after), ST the kept state's [BV, BK] block as a B operand; returned as ST is."""
    S = gl.convert_layout(_k_to_mr(gl.permute(ST, (1, 0))), MR, assert_trivial=True).to(gl.float32) * eg[:, None]
    S = mma_v2(b_xt, b_x, gl.zeros([S.shape[0], S.shape[1]], gl.float32, layout=MR)) * c + S
    S = mma_v2(b_yt, b_y, S)
    return gl.convert_layout(gl.permute(_mr_to_k(S.to(ST.dtype)), (1, 0)), BN, assert_trivial=True)


@gluon.jit
def chunk_dplr_bwd_kernel(
    q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg,
    egc, bwt, kwt, qwt, awt,
    scale, T, H, n_items,
    K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr,
):
    gl.static_assert(V // BV == 2)  # the two V tiles of an item take the two tile stages
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    s_do = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BV], SH)
    s_dr = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BV], SH)
    s_v = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BV], SH)
    s_u = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BV], SH)
    s_x = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BV], SH)
    s_y = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BV], SH)
    s_h = gl.allocate_shared_memory(h.dtype.element_ty, [2, BK, BV], SH)
    s_dh = gl.allocate_shared_memory(dh.dtype.element_ty, [2, BK, BV], SH)
    s_q = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BK], SH)
    s_k = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BK], SH)
    s_a = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BK], SH)
    s_b = gl.allocate_shared_memory(gl.bfloat16, [2, BC, BK], SH)
    s_g = gl.allocate_shared_memory(gk.dtype.element_ty, [2, BC, BK], SH)
    s_xt = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BC], SX)
    s_yt = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BC], SX)
    eg = _issue_item(pid, 0, s_q, s_k, s_a, s_b, s_g, s_xt, s_yt, q, k, a, b, gk, egc, bwt, kwt, qwt, awt,
                     n_items, T, H, scale, K, V, BC, BK)
    _issue_tile(pid, 0, s_do, s_dr, s_v, s_u, s_x, s_y, s_h, s_dh, v, h, dh, u, dr, do, n_items, T, H, scale,
                K, V, BC, BK, BV)
    cp.commit_group()
    for item in range(pid, n_items, nprog):
        ist = ((item - pid) // nprog) % 2
        t0, lenc, i_h, k0, p_hs, odd, has_next, p_op, t_op, len_op, c_op = _locate(item, n_items, T, H, scale,
                                                                                   K, V, BC, BK)
        dAqk = gl.zeros([BC, BC], gl.float32, layout=MR)
        dAqb = gl.zeros([BC, BC], gl.float32, layout=MR)
        dAak = gl.zeros([BC, BC], gl.float32, layout=MR)
        dAab = gl.zeros([BC, BC], gl.float32, layout=MR)
        dQw = gl.zeros([BC, BK], gl.float32, layout=MN)
        dAw = gl.zeros([BC, BK], gl.float32, layout=MN)
        dKw = gl.zeros([BC, BK], gl.float32, layout=MN)
        dBw = gl.zeros([BC, BK], gl.float32, layout=MN)
        dgS = gl.zeros([BK], gl.float32, layout=gl.SliceLayout(0, MN))
        eg_next = eg
        for i_v in gl.static_range(2):
            cp.wait_group(i_v)  # at the second tile the next item's own tiles may still be in flight
            gl.thread_barrier()  # this tile's copies visible to every warp; every warp done with the other stage
            if i_v == 0:
                _issue_tile(item, 1, s_do, s_dr, s_v, s_u, s_x, s_y, s_h, s_dh, v, h, dh, u, dr, do, n_items, T,
                            H, scale, K, V, BC, BK, BV)
                cp.commit_group()
                _issue_item(item + nprog, 1 - ist, s_q, s_k, s_a, s_b, s_g, s_xt, s_yt, q, k, a, b, gk,
                            egc, bwt, kwt, qwt, awt, n_items, T, H, scale, K, V, BC, BK)
            else:
                eg_next = _issue_item(item + nprog, 1 - ist, s_q, s_k, s_a, s_b, s_g, s_xt, s_yt, q, k, a, b, gk,
                                      egc, bwt, kwt, qwt, awt, n_items, T, H, scale, K, V, BC, BK, COPY=False)
                _issue_tile(item + nprog, 0, s_do, s_dr, s_v, s_u, s_x, s_y, s_h, s_dh, v, h, dh, u, dr, do,
                            n_items, T, H, scale, K, V, BC, BK, BV)
            cp.commit_group()
            b_vT = s_v.index(i_v).permute((1, 0)).load(BR)
            b_uT = s_u.index(i_v).permute((1, 0)).load(BR)
            b_do = s_do.index(i_v).load(AN)
            r_do = gl.convert_layout(b_do, AR, assert_trivial=True)
            dAqk = mma_v2(r_do, b_vT, dAqk)
            dAqb = mma_v2(r_do, b_uT, dAqb)
            b_dr = s_dr.index(i_v).load(AN)
            r_dr = gl.convert_layout(b_dr, AR, assert_trivial=True)
            dAak = mma_v2(r_dr, b_vT, dAak)
            dAab = mma_v2(r_dr, b_uT, dAab)
            S0T = s_h.index(i_v).permute((1, 0)).load(BN)
            dST = s_dh.index(i_v).permute((1, 0)).load(BN)
            D = _kept_step(gl.where(odd, S0T, dST), eg, s_xt.index(ist).load(AR), s_yt.index(ist).load(AR),
                           s_x.index(i_v).load(BR), s_y.index(i_v).load(BR), c_op)
            S0T = gl.where(odd, D, S0T)
            dST = gl.where(has_next, D, dST)
            dQw = mma_v2(b_do, S0T, dQw)
            dAw = mma_v2(b_dr, S0T, dAw)
            dgS += gl.convert_layout(gl.sum(dST.to(gl.float32) * S0T.to(gl.float32), 0), gl.SliceLayout(0, MN))
            dKw = mma_v2(s_v.index(i_v).load(AN), dST, dKw)
            dBw = mma_v2(s_u.index(i_v).load(AN), dST, dBw)
        eg = eg_next

        g = gl.maximum(_in_mn(s_g.index(ist)), GATE_BOUND)
        gam = _g_cumsum(g, False)
        gamp = gam - g
        gCv = gl.sum(g, 0)
        ed = gl.exp(gl.expand_dims(gCv, 0) - gam)
        Qw = (_in_mn(s_q.index(ist)) * gl.exp(gam)).to(gl.bfloat16).to(gl.float32)
        Aw = (_in_mn(s_a.index(ist)) * gl.exp(gamp)).to(gl.bfloat16).to(gl.float32)
        Bw = (_in_mn(s_b.index(ist)) * ed).to(gl.bfloat16).to(gl.float32)
        Kw = (_in_mn(s_k.index(ist)) * ed).to(gl.bfloat16).to(gl.float32)
        dgC = gl.exp(gCv) * dgS + gl.sum(Bw * dBw + Kw * dKw, 0)
        dQw = dQw * scale
        xa = Aw * dAw
        x = Qw * dQw - Kw * dKw - Bw * dBw + xa

        cn = gl.arange(0, BC, layout=gl.SliceLayout(1, MN))
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
        Kf_b = gl.convert_layout(_in_mn(s_k.index(ist)) * fk, BN1)
        Bf_b = gl.convert_layout(_in_mn(s_b.index(ist)) * fk, BN1)
        Qf_b = gl.convert_layout(_in_mn(s_q.index(ist)) * fq, BN1)
        Af_b = gl.convert_layout(_in_mn(s_a.index(ist)) * fa, BN1)
        dQf = _intra(dAqk, Kf_b, dAqb, Bf_b)
        dAf = _intra(dAak, Kf_b, dAab, Bf_b)
        dKf = _intra(gl.permute(dAqk, (1, 0)), Qf_b, gl.permute(dAak, (1, 0)), Af_b)
        dBf = _intra(gl.permute(dAqb, (1, 0)), Qf_b, gl.permute(dAab, (1, 0)), Af_b)
        xa_i = _in_mn(s_a.index(ist)) * fa * dAf
        x_i = _in_mn(s_q.index(ist)) * fq * dQf - _in_mn(s_k.index(ist)) * fk * dKf \
            - _in_mn(s_b.index(ist)) * fk * dBf + xa_i

        cq = gl.arange(0, BC, layout=gl.SliceLayout(1, LQ))
        kq = gl.arange(0, BK, layout=gl.SliceLayout(0, LQ))
        p_x = ((t0 + cq[:, None]) * H + i_h) * K + k0 + kq[None, :]
        m_x = (cq[:, None] < lenc) & (kq[None, :] < BK)
        _store_q(dq, p_x, m_x, dQw * gl.exp(gam) + dQf * fq)
        _store_q(dk, p_x, m_x, dKw * ed + dKf * fk)
        _store_q(da, p_x, m_x, dAw * gl.exp(gamp) + dAf * fa)
        _store_q(db, p_x, m_x, dBw * ed + dBf * fk)
        b_dg = gl.where(_in_mn(s_g.index(ist)) >= GATE_BOUND,
                        _g_cumsum(x + x_i, True) - (xa + xa_i) + gl.expand_dims(dgC, 0), 0.)
        _store_q(dg, p_x, m_x, b_dg)
    cp.wait_group(0)


_P = "*bf16"
SIGNATURES = {"chunk_dplr_bwd_kernel": {
    "q": _P, "k": _P, "v": _P, "a": _P, "b": _P, "gk": _P, "h": _P, "dh": _P, "u": _P, "dr": _P, "do": _P,
    "dq": _P, "dk": _P, "da": _P, "db": _P, "dg": _P,
    "egc": "*fp32", "bwt": _P, "kwt": _P, "qwt": _P, "awt": _P,
    "scale": "fp32", "T": "i32", "H": "i32", "n_items": "i32"}}
CONSTEXPRS = {"chunk_dplr_bwd_kernel": {"K": 128, "V": 128, "BC": 16, "BK": 64, "BV": 64}}
LAUNCH = {"chunk_dplr_bwd_kernel": {"num_warps": 4, "num_stages": 1}}
