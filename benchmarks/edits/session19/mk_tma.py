"""Session 19: the token pass's TMA forms with device-side descriptors (tl.make_tensor_descriptor): writes
tma_k64.json and tma_k128.json, edits for scripts/time_token_edits.py on the hopper bf16 bound gbf16 dense units
(docs/perf_notes.md 43)."""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELP = '''@triton.jit
def _tile(base, nrows, ncols, r0, c0, BR: tl.constexpr, BCOL: tl.constexpr):
    """A [BR, BCOL] tile of the row-major [nrows, ncols] view at (r0, c0) through a TMA copy (rows past nrows
    read as zero)."""
    d = tl.make_tensor_descriptor(base, shape=[nrows, ncols], strides=[ncols, 1], block_shape=[BR, BCOL])
    return d.load([r0, c0])


@triton.jit
def _put(base, nrows, ncols, r0, c0, x, BR: tl.constexpr, BCOL: tl.constexpr):
    d = tl.make_tensor_descriptor(base, shape=[nrows, ncols], strides=[ncols, 1], block_shape=[BR, BCOL])
    d.store([r0, c0], x)


@triton.jit
def chunk_dplr_bwd_kernel('''
IN_OLD = "    r_q, r_k, r_a, r_b, r_g = _load_inputs(q, k, a, b, gk, p_x, m_x)\n\n    # U and dR"
IN_NEW = '''    nr = (t0 + lenc).to(tl.int32)
    r0 = t0.to(tl.int32)
    c0 = (i_h * K + i_kb * BK).to(tl.int32)
    r_q = _tile(q, nr, H * K, r0, c0, BC, BK)
    r_k = _tile(k, nr, H * K, r0, c0, BC, BK)
    r_a = _tile(a, nr, H * K, r0, c0, BC, BK)
    r_b = _tile(b, nr, H * K, r0, c0, BC, BK)
    r_g = _tile(gk, nr, H * K, r0, c0, BC, BK)

    # U and dR'''
ST_OLD = '''        S0 = tl.load(h + p_hs + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
        S0T = tl.load(h + p_hs + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.).to(tl.bfloat16)
        dS = tl.load(dh + p_hs + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
        dST = tl.load(dh + p_hs + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.).to(tl.bfloat16)'''
ST_NEW = '''        hr = ((slot * H + i_h) * K + i_kb * BK).to(tl.int32)
        S0b = _tile(h, hr + BK, V, hr, i_v * BV, BK, BV)
        dSb = _tile(dh, hr + BK, V, hr, i_v * BV, BK, BV)
        S0 = S0b.to(tl.float32)
        S0T = tl.trans(S0b)
        dS = dSb.to(tl.float32)
        dST = tl.trans(dSb)'''
Y_OLD = '''        b_v = tl.load(v + p_y, mask=m_y, other=0.).to(tl.bfloat16)
        b_vT = tl.load(v + p_yT, mask=m_yT, other=0.).to(tl.bfloat16)
        b_do = tl.load(do + p_y, mask=m_y, other=0.).to(tl.bfloat16)
        U = tl.load(u + p_y, mask=m_y, other=0.)
        UT = tl.load(u + p_yT, mask=m_yT, other=0.)
        dR = tl.load(dr + p_y, mask=m_y, other=0.)'''
Y_NEW = '''        yc = i_h * V + i_v * BV
        b_v = _tile(v, nr, H * V, r0, yc, BC, BV)
        b_vT = tl.trans(b_v)
        b_do = _tile(do, nr, H * V, r0, yc, BC, BV)
        U = _tile(u, nr, H * V, r0, yc, BC, BV)
        UT = tl.trans(U)
        dR = _tile(dr, nr, H * V, r0, yc, BC, BV)'''
Y_NEW_T = '''        yc = i_h * V + i_v * BV
        b_v = _tile(v, nr, H * V, r0, yc, BC, BV)
        b_vT = tl.load(v + p_yT, mask=m_yT, other=0.).to(tl.bfloat16)
        b_do = _tile(do, nr, H * V, r0, yc, BC, BV)
        U = _tile(u, nr, H * V, r0, yc, BC, BV)
        UT = tl.load(u + p_yT, mask=m_yT, other=0.)
        dR = _tile(dr, nr, H * V, r0, yc, BC, BV)'''
OUT_OLD = '''    tl.store(dq + p_x, b_dq.to(dq.dtype.element_ty), mask=m_x)
    tl.store(dk + p_x, b_dk.to(dk.dtype.element_ty), mask=m_x)
    tl.store(da + p_x, b_da.to(da.dtype.element_ty), mask=m_x)
    tl.store(db + p_x, b_db.to(db.dtype.element_ty), mask=m_x)
    tl.store(dg + p_x, b_dg.to(dg.dtype.element_ty), mask=m_x)'''
OUT_NEW = '''    _put(dq, nr, H * K, r0, c0, b_dq.to(dq.dtype.element_ty), BC, BK)
    _put(dk, nr, H * K, r0, c0, b_dk.to(dk.dtype.element_ty), BC, BK)
    _put(da, nr, H * K, r0, c0, b_da.to(da.dtype.element_ty), BC, BK)
    _put(db, nr, H * K, r0, c0, b_db.to(db.dtype.element_ty), BC, BK)
    _put(dg, nr, H * K, r0, c0, b_dg.to(dg.dtype.element_ty), BC, BK)'''
H = ["@triton.jit\ndef chunk_dplr_bwd_kernel(", HELP]
base = [H, [IN_OLD, IN_NEW]]
E = {
  "tma_in": {"replace": base},
  "tma_in_st": {"replace": base + [[ST_OLD, ST_NEW]]},
  "tma_in_st_y": {"replace": base + [[ST_OLD, ST_NEW], [Y_OLD, Y_NEW]]},
  "tma_in_st_yT": {"replace": base + [[ST_OLD, ST_NEW], [Y_OLD, Y_NEW_T]]},
  "tma_all": {"replace": base + [[ST_OLD, ST_NEW], [Y_OLD, Y_NEW], [OUT_OLD, OUT_NEW]]},
  "tma_all_nocap": {"replace": base + [[ST_OLD, ST_NEW], [Y_OLD, Y_NEW], [OUT_OLD, OUT_NEW]], "launch": {"maxnreg": None}},
  "tma_in_out": {"replace": base + [[OUT_OLD, OUT_NEW]]},
}
json.dump(E, open(str(HERE / "tma_k64.json"), "w"), indent=1)
E128 = {
  "tma_in": {"replace": base},
  "tma_in_y": {"replace": base + [[Y_OLD, Y_NEW]]},
  "tma_in_yT": {"replace": base + [[Y_OLD, Y_NEW_T]]},
  "tma_in_out": {"replace": base + [[OUT_OLD, OUT_NEW]]},
  "tma_all": {"replace": base + [[Y_OLD, Y_NEW], [OUT_OLD, OUT_NEW]]},
}
json.dump(E128, open(str(HERE / "tma_k128.json"), "w"), indent=1)
