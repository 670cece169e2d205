"""Session 19: the token pass's TMA forms with host-side descriptors (the edit key "desc" of
scripts/time_token_edits.py): writes hd_k64.json and hd_k128.json (docs/perf_notes.md 43)."""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
exec((HERE / "mk_tma.py").read_text().split("H = [")[0])  # the shipped texts (IN_OLD, ST_OLD, Y_OLD, OUT_OLD)
IN_HD = '''    bi = i_n.to(tl.int32)
    r0 = (i_t * BC).to(tl.int32)
    c0 = (i_h * K + i_kb * BK).to(tl.int32)
    r_q = q.load([bi, r0, c0]).reshape(BC, BK)
    r_k = k.load([bi, r0, c0]).reshape(BC, BK)
    r_a = a.load([bi, r0, c0]).reshape(BC, BK)
    r_b = b.load([bi, r0, c0]).reshape(BC, BK)
    r_g = gk.load([bi, r0, c0]).reshape(BC, BK)

    # U and dR'''
ST_HD = '''        hr = ((slot * H + i_h) * K + i_kb * BK).to(tl.int32)
        S0b = h.load([hr, i_v * BV])
        dSb = dh.load([hr, i_v * BV])
        S0 = S0b.to(tl.float32)
        S0T = tl.trans(S0b)
        dS = dSb.to(tl.float32)
        dST = tl.trans(dSb)'''
Y_HD = '''        yc = i_h * V + i_v * BV
        b_v = v.load([bi, r0, yc]).reshape(BC, BV)
        b_vT = tl.trans(b_v)
        b_do = do.load([bi, r0, yc]).reshape(BC, BV)
        U = u.load([bi, r0, yc]).reshape(BC, BV)
        UT = tl.trans(U)
        dR = dr.load([bi, r0, yc]).reshape(BC, BV)'''
Y_HD_T = '''        yc = i_h * V + i_v * BV
        b_v = v.load([bi, r0, yc]).reshape(BC, BV)
        b_vT = tl.load(v.base + p_yT, mask=m_yT, other=0.).to(tl.bfloat16)
        b_do = do.load([bi, r0, yc]).reshape(BC, BV)
        U = u.load([bi, r0, yc]).reshape(BC, BV)
        UT = tl.load(u.base + p_yT, mask=m_yT, other=0.)
        dR = dr.load([bi, r0, yc]).reshape(BC, BV)'''
OUT_HD = '''    dq.store([bi, r0, c0], b_dq.to(dq.dtype).reshape(1, BC, BK))
    dk.store([bi, r0, c0], b_dk.to(dk.dtype).reshape(1, BC, BK))
    da.store([bi, r0, c0], b_da.to(da.dtype).reshape(1, BC, BK))
    db.store([bi, r0, c0], b_db.to(db.dtype).reshape(1, BC, BK))
    dg.store([bi, r0, c0], b_dg.to(dg.dtype).reshape(1, BC, BK))'''
CLAMP_OLD = "    g_raw = tl.load(gk + p_x, mask=m_x, other=0.).to(tl.float32)"
CLAMP_NEW = "    g_raw = gk.load([bi, r0, c0]).reshape(BC, BK).to(tl.float32)"
def d(names, blk):
    return {n: ["btc", blk] for n in names}
def mk(BC, BK, BV, K):
    X = d("q k a b gk".split(), [1, BC, BK])
    Y = d("v do u dr".split(), [1, BC, BV])
    O = d("dq dk da db dg".split(), [1, BC, BK])
    S = {"h": ["rc", [BK, BV]], "dh": ["rc", [BK, BV]]}
    inn = [[IN_OLD, IN_HD], [CLAMP_OLD, CLAMP_NEW]]
    E = {
      "hd_in": {"replace": inn, "desc": X},
      "hd_in_y": {"replace": inn + [[Y_OLD, Y_HD]], "desc": {**X, **Y}},
      "hd_in_out": {"replace": inn + [[OUT_OLD, OUT_HD]], "desc": {**X, **O}},
      "hd_all": {"replace": inn + [[Y_OLD, Y_HD], [OUT_OLD, OUT_HD]], "desc": {**X, **Y, **O}},
    }
    if K == 128:  # its deriving steps read u, v, do, dr through pointers: those stay pointers
        del E["hd_in_y"], E["hd_all"]
    if K == 64:
        E["hd_in_st"] = {"replace": inn + [[ST_OLD, ST_HD]], "desc": {**X, **S}}
        E["hd_all_st"] = {"replace": inn + [[ST_OLD, ST_HD], [Y_OLD, Y_HD], [OUT_OLD, OUT_HD]], "desc": {**X, **Y, **O, **S}}
        E["hd_all_st_nocap"] = {**E["hd_all_st"], "launch": {"maxnreg": None}}
        E["hd_all_nocap"] = {**E["hd_all"], "launch": {"maxnreg": None}}
    return E
json.dump(mk(16, 64, 64, 64), open(str(HERE / "hd_k64.json"), "w"), indent=1)
json.dump(mk(16, 64, 64, 128), open(str(HERE / "hd_k128.json"), "w"), indent=1)
