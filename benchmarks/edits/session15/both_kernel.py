

@triton.jit
def chunk_dplr_states_both_kernel(
    kwt, v, bwt, egc, w, m, h0, h, ht, u,
    qwt, awt, y, p, aqkt, aakt, do, dht, dh, dh0, dr, dv,
    scale, T, H,
    K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    R: tl.constexpr, HC: tl.constexpr,
):
    # the states pass (chunks forwards) and the reverse pass (chunks backwards) of one (sequence * head,
    # V-block) in one loop: two independent dependency chains per step
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos, L, slot0 = _sequence(i_n, T, BC)
    hslot0 = _sequence(i_n, T, HC)[2]
    NT = tl.cdiv(L, BC)
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    o_ck = o_c[:, None] * K + o_k[None, :]
    o_kc = o_k[:, None] * BC + o_c[None, :]
    o_ck_t = o_c[:, None] + o_k[None, :] * BC
    o_cc = o_c[:, None] * BC + o_c[None, :]
    S = tl.load(h0 + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.)
    dS = tl.load(dht + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.)
    for i_f in range(NT):
        # ---- forward step over chunk i_f
        t0 = bos + i_f * BC
        lenc = tl.minimum(L - i_f * BC, BC)
        m_c = o_c < lenc
        p_s = (slot0 + i_f) * H + i_h
        p_h = (hslot0 + i_f // R) * H + i_h
        tl.store(h + p_h * K * V + o_kv, S.to(h.dtype.element_ty), mask=m_kv & (i_f % R == 0))
        p_y = ((t0 + o_c[:, None]) * H + i_h) * V + o_v[None, :]
        m_y = m_c[:, None] & m_v[None, :]
        b_v = tl.load(v + p_y, mask=m_y, other=0.).to(tl.bfloat16)
        p_cc = p_s * BC * BC + o_cc
        b_w = tl.load(w + p_s * BC * K + o_ck, mask=m_k[None, :], other=0.)
        b_m = tl.load(m + p_cc)
        b_bwt = tl.load(bwt + p_s * BC * K + o_kc, mask=m_k[:, None], other=0.)
        b_kwt = tl.load(kwt + p_s * BC * K + o_kc, mask=m_k[:, None], other=0.)
        b_eg = tl.load(egc + p_s * K + o_k, mask=m_k, other=0.)
        U = (_dot(b_w, S.to(tl.bfloat16)) + _dot(b_m, b_v)).to(tl.bfloat16)
        tl.store(u + p_y, U, mask=m_y)
        S = S * b_eg[:, None] + _dot(b_bwt, U) + _dot(b_kwt, b_v)
        # ---- reverse step over chunk NT - 1 - i_f
        i_t = NT - 1 - i_f
        t0r = bos + i_t * BC
        lenr = tl.minimum(L - i_t * BC, BC)
        m_cr = o_c < lenr
        p_sr = (slot0 + i_t) * H + i_h
        p_hr = (hslot0 + i_t // R) * H + i_h
        tl.store(dh + p_hr * K * V + o_kv, dS.to(dh.dtype.element_ty),
                 mask=m_kv & ((i_t % R == R - 1) | (i_t == NT - 1)))
        p_yr = ((t0r + o_c[:, None]) * H + i_h) * V + o_v[None, :]
        m_yr = m_cr[:, None] & m_v[None, :]
        b_do = tl.load(do + p_yr, mask=m_yr, other=0.).to(tl.bfloat16)
        b_y = tl.load(y + p_sr * BC * K + o_ck, mask=m_k[None, :], other=0.)
        b_p = tl.load(p + p_sr * BC * BC + o_cc)
        b_qwt = tl.load(qwt + p_sr * BC * K + o_kc, mask=m_k[:, None], other=0.)
        b_awt = tl.load(awt + p_sr * BC * K + o_kc, mask=m_k[:, None], other=0.)
        b_egr = tl.load(egc + p_sr * K + o_k, mask=m_k, other=0.)
        dS_dt = dS.to(tl.bfloat16)
        dR = (scale * _dot(b_p, b_do) + _dot(b_y, dS_dt)).to(tl.bfloat16)
        tl.store(dr + p_yr, dR, mask=m_yr)
        b_kw = tl.load(kwt + p_sr * BC * K + o_ck_t, mask=m_k[None, :], other=0.)
        b_dv = _dot_acc(b_kw, dS_dt, scale * _dot(tl.load(aqkt + p_sr * BC * BC + o_cc), b_do))
        b_dv = _dot_acc(tl.load(aakt + p_sr * BC * BC + o_cc), dR, b_dv)
        tl.store(dv + p_yr, b_dv.to(dv.dtype.element_ty), mask=m_yr)
        dS = dS * b_egr[:, None] + scale * _dot(b_qwt, b_do) + _dot(b_awt, dR)
    tl.store(ht + i_nh.to(tl.int64) * K * V + o_kv, S, mask=m_kv)
    tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_kv, dS, mask=m_kv)
