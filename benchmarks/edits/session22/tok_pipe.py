"""Session 22 prototype: the K = 64 bf16 token pass as a persistent Gluon kernel whose next work item's tiles are
copied into shared memory (cp.async, two stages) while the current one is computed. The shipped Gluon pass
(templates/chunk_dplr_bwd_gluon.py.jinja) loads every tile into registers and then computes: at 255 registers
two programs share an SM, so the memory system idles while both compute. Here the operands come from shared
memory (ldmatrix for the MMA fragments), in their logical order (no permuted-index trick).

Same arguments as the unit's chunk_dplr_bwd_kernel (dense, bounded -0.61, K = V = 64, 16-token chunks) plus
n_items (chunk slots * H); grid: up to CTAS_PER_SM programs an SM.

    python tok_pipe.py UNIT --shapes 2x1000x4,8x4096x64,4x4096x32 [--ctas 1,2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

GATE_BOUND = gl.constexpr(-0.61)
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
# the copies: 16 bytes a thread, a [16, 64] tile per 128 threads
LC = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                   order=[1, 0]))
# KPERM: the K columns of every [C, K] tile permuted as in the shipped pass (_kmem), so that the inputs are read
# from shared memory and the outputs stored with 8 bytes a thread (LQ), coalesced
LQ = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                             lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                             warp_bases=[[0, 16], [0, 32]], block_bases=[], shape=[16, 64]))
SH = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))


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
def _in(sm, KPERM: gl.constexpr):
    if KPERM:
        return gl.convert_layout(_k_logical(sm.load(LQ)), MN, assert_trivial=True).to(gl.float32)
    else:
        return sm.load(MN).to(gl.float32)


@gluon.jit
def _out(x, p_o, m_o, p_q, m_q, val, KPERM: gl.constexpr):
    if KPERM:
        gl.store(x + p_q, gl.convert_layout(_k_memory(val.to(gl.bfloat16)), LQ), mask=m_q)
    else:
        gl.store(x + p_o, val.to(gl.bfloat16), mask=m_o)


@gluon.jit
def _intra(dA1, Y1, dA2, Y2):
    zn = gl.zeros([Y1.shape[0], Y1.shape[1]], gl.float32, layout=MN)
    acc = mma_v2(gl.convert_layout(dA1, AN1), Y1, zn, input_precision="tf32")
    return mma_v2(gl.convert_layout(dA2, AN1), Y2, acc, input_precision="tf32")


@gluon.jit
def _issue(item, n_items, stage, s_do, s_dr, s_v, s_u, s_q, s_k, s_a, s_b, s_g, s_h, s_dh,
           q, k, v, a, b, gk, h, dh, u, dr, do, T, H,
           K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, KPERM: gl.constexpr):
    """Start the copies of one work item's tiles into stage ``stage`` (nothing past n_items)."""
    i_h = item % H
    slot = (item // H).to(gl.int64)
    NT = gl.cdiv(T, BC)
    i_t = (slot % NT).to(gl.int32)
    lenc = gl.where(item < n_items, gl.minimum(T - i_t * BC, BC), 0)
    t0 = (slot // NT) * T + i_t * BC
    r = gl.arange(0, BC, layout=gl.SliceLayout(1, LC))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, LC))
    m = (r[:, None] < lenc) & (c[None, :] < 64)
    p_y = ((t0 + r[:, None]) * H + i_h) * V + c[None, :]
    cp.async_copy_global_to_shared(s_do.index(stage), do + p_y, mask=m)
    cp.async_copy_global_to_shared(s_dr.index(stage), dr + p_y, mask=m)
    cp.async_copy_global_to_shared(s_v.index(stage), v + p_y, mask=m)
    cp.async_copy_global_to_shared(s_u.index(stage), u + p_y, mask=m)
    p_x = ((t0 + r[:, None]) * H + i_h) * K + c[None, :]
    cp.async_copy_global_to_shared(s_q.index(stage), q + p_x, mask=m)
    cp.async_copy_global_to_shared(s_k.index(stage), k + p_x, mask=m)
    cp.async_copy_global_to_shared(s_a.index(stage), a + p_x, mask=m)
    cp.async_copy_global_to_shared(s_b.index(stage), b + p_x, mask=m)
    cp.async_copy_global_to_shared(s_g.index(stage), gk + p_x, mask=m)
    rs = gl.arange(0, 64, layout=gl.SliceLayout(1, LC))
    if KPERM:
        rk = _kmem(rs)  # shared row r holds K column _kmem(r): the states' K in the tiles' permuted order
    else:
        rk = rs
    p_s = (slot * H + i_h) * K * V + rk[:, None] * V + c[None, :]
    m_s = (rs[:, None] < K) & (c[None, :] < V) & (lenc > 0)
    cp.async_copy_global_to_shared(s_h.index(stage), h + p_s, mask=m_s)
    cp.async_copy_global_to_shared(s_dh.index(stage), dh + p_s, mask=m_s)
    cp.commit_group()


@gluon.jit
def token_pass_pipe(
    q, k, v, a, b, gk, h, dh, u, dr, do, dq, dk, da, db, dg, scale, T, H, n_items,
    K: gl.constexpr, V: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr,
    KPERM: gl.constexpr = False,
):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    # one allocation per tile (two stages each): the copies into different allocations need no barrier between
    # them (Triton's barrier analysis orders writes to one allocation, even to disjoint parts of it)
    s_do = gl.allocate_shared_memory(gl.bfloat16, [2, BC, 64], SH)
    s_dr = gl.allocate_shared_memory(gl.bfloat16, [2, BC, 64], SH)
    s_v = gl.allocate_shared_memory(gl.bfloat16, [2, BC, 64], SH)
    s_u = gl.allocate_shared_memory(gl.bfloat16, [2, BC, 64], SH)
    s_q = gl.allocate_shared_memory(gl.bfloat16, [2, BC, 64], SH)
    s_k = gl.allocate_shared_memory(gl.bfloat16, [2, BC, 64], SH)
    s_a = gl.allocate_shared_memory(gl.bfloat16, [2, BC, 64], SH)
    s_b = gl.allocate_shared_memory(gl.bfloat16, [2, BC, 64], SH)
    s_g = gl.allocate_shared_memory(gl.bfloat16, [2, BC, 64], SH)
    s_h = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], SH)
    s_dh = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], SH)
    _issue(pid, n_items, 0, s_do, s_dr, s_v, s_u, s_q, s_k, s_a, s_b, s_g, s_h, s_dh,
           q, k, v, a, b, gk, h, dh, u, dr, do, T, H, K, V, BC, KPERM)
    cn = gl.arange(0, BC, layout=gl.SliceLayout(1, MN))
    kn = gl.arange(0, BK, layout=gl.SliceLayout(0, MN))
    rr = gl.arange(0, BC, layout=gl.SliceLayout(1, MR))
    cc = gl.arange(0, BC, layout=gl.SliceLayout(0, MR))
    low = rr[:, None] >= cc[None, :]
    slow = rr[:, None] > cc[None, :]
    NT = gl.cdiv(T, BC)
    for item in range(pid, n_items, nprog):
        stage = ((item - pid) // nprog) % 2
        cp.wait_group(0)
        gl.thread_barrier()  # this stage's tiles visible to every warp; every warp done with the other stage
        _issue(item + nprog, n_items, 1 - stage, s_do, s_dr, s_v, s_u, s_q, s_k, s_a, s_b, s_g, s_h, s_dh,
               q, k, v, a, b, gk, h, dh, u, dr, do, T, H, K, V, BC, KPERM)
        i_h = item % H
        slot = (item // H).to(gl.int64)
        i_t = (slot % NT).to(gl.int32)
        lenc = gl.minimum(T - i_t * BC, BC)
        t0 = (slot // NT) * T + i_t * BC

        b_do = s_do.index(stage).load(AN)
        b_dr = s_dr.index(stage).load(AN)
        b_v = s_v.index(stage).load(AN)
        b_u = s_u.index(stage).load(AN)
        b_vT = s_v.index(stage).permute((1, 0)).load(BR)
        b_uT = s_u.index(stage).permute((1, 0)).load(BR)
        S0T = s_h.index(stage).permute((1, 0)).load(BN)
        dST = s_dh.index(stage).permute((1, 0)).load(BN)
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

        b_q = _in(s_q.index(stage), KPERM)
        b_k = _in(s_k.index(stage), KPERM)
        b_a = _in(s_a.index(stage), KPERM)
        b_b = _in(s_b.index(stage), KPERM)
        g_raw = _in(s_g.index(stage), KPERM)
        g = gl.maximum(g_raw, GATE_BOUND)
        gam = _g_cumsum(g, False)
        gamp = gam - g
        gCv = gl.sum(g, 0)
        ed = gl.exp(gl.expand_dims(gCv, 0) - gam)
        Qw = (b_q * gl.exp(gam)).to(gl.bfloat16).to(gl.float32)
        Aw = (b_a * gl.exp(gamp)).to(gl.bfloat16).to(gl.float32)
        Bw = (b_b * ed).to(gl.bfloat16).to(gl.float32)
        Kw = (b_k * ed).to(gl.bfloat16).to(gl.float32)
        dgC = gl.exp(gCv) * dgS + gl.sum(Bw * dBw + Kw * dKw, 0)

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
        Kf_b = gl.convert_layout(Kf, BN1)
        Bf_b = gl.convert_layout(Bf, BN1)
        Qf_b = gl.convert_layout(Qf, BN1)
        Af_b = gl.convert_layout(Af, BN1)
        dQf = _intra(dAqk, Kf_b, dAqb, Bf_b)
        dAf = _intra(dAak, Kf_b, dAab, Bf_b)
        dKf = _intra(gl.permute(dAqk, (1, 0)), Qf_b, gl.permute(dAak, (1, 0)), Af_b)
        dBf = _intra(gl.permute(dAqb, (1, 0)), Qf_b, gl.permute(dAab, (1, 0)), Af_b)
        xa_i = Af * dAf
        x_i = Qf * dQf - Kf * dKf - Bf * dBf + xa_i

        dQw = dQw * scale
        xa = Aw * dAw + xa_i
        x = Qw * dQw - Kw * dKw - Bw * dBw + Aw * dAw + x_i
        b_dg = gl.where(g_raw >= GATE_BOUND, _g_cumsum(x, True) - xa + gl.expand_dims(dgC, 0), 0.)
        p_o = ((t0 + cn[:, None]) * H + i_h) * K + kn[None, :]
        m_o = (cn[:, None] < lenc) & (kn[None, :] < K)
        cq = gl.arange(0, BC, layout=gl.SliceLayout(1, LQ))
        kq = gl.arange(0, BK, layout=gl.SliceLayout(0, LQ))
        p_q = ((t0 + cq[:, None]) * H + i_h) * K + kq[None, :]
        m_q = (cq[:, None] < lenc) & (kq[None, :] < K)
        _out(dq, p_o, m_o, p_q, m_q, dQw * gl.exp(gam) + dQf * fq, KPERM)
        _out(dk, p_o, m_o, p_q, m_q, dKw * ed + dKf * fk, KPERM)
        _out(da, p_o, m_o, p_q, m_q, dAw * gl.exp(gamp) + dAf * fa, KPERM)
        _out(db, p_o, m_o, p_q, m_q, dBw * ed + dBf * fk, KPERM)
        _out(dg, p_o, m_o, p_q, m_q, b_dg, KPERM)
    cp.wait_group(0)


FORMS = {"pipe": token_pass_pipe}


def main() -> None:
    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root))
    sys.path.insert(0, str(root / "scripts"))
    from dplr_gen.compile import import_source
    from time_token_edits import OUTPUTS, inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("unit", type=Path)
    ap.add_argument("--shapes", default="2x1000x4,8x4096x64,4x4096x32")
    ap.add_argument("--ctas", default="1,2")
    ap.add_argument("--regs", default="255")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kperm", default="0,1")
    args = ap.parse_args()
    kernel = "chunk_dplr_bwd_kernel"
    unit = import_source(args.unit, "unit_shipped")
    sig, consts, launch = unit.SIGNATURES[kernel], unit.CONSTEXPRS[kernel], dict(unit.LAUNCH[kernel])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in args.shapes.split(","):
        B, T, H = (int(x) for x in shape.split("x"))
        xs = inputs(sig, B, T, H, consts["K"], consts["BC"])
        n_items = B * triton.cdiv(T, consts["BC"]) * H
        outs = {n: x for n, x in zip(sig, xs) if n in OUTPUTS["bwd"]}
        forms = [("shipped", lambda: getattr(unit, kernel)[(n_items,)](*xs, **consts, **launch))]
        for c in args.ctas.split(","):
            for reg in args.regs.split(","):
                for kp in args.kperm.split(","):
                    lo = {"num_warps": 4, "maxnreg": int(reg)}
                    grid = (min(n_items, int(c) * sms),)
                    forms.append((f"pipe_c{c}_r{reg}_kp{kp}", lambda grid=grid, lo=lo, kp=kp: token_pass_pipe[grid](
                        *xs, n_items, **consts, KPERM=bool(int(kp)), **lo)))
        ref = None
        runs = {}
        for name, run in forms:
            for x in outs.values():
                x.fill_(float("nan"))
            try:
                run()
                torch.cuda.synchronize()
            except Exception as ex:  # noqa: BLE001
                print(f"{shape} {name}: FAILED {type(ex).__name__}: {str(ex)[-1500:]}", flush=True)
                rows.append({"shape": shape, "form": name, "error": str(ex)[-1500:]})
                continue
            if ref is None:
                ref = {n: x.clone() for n, x in outs.items()}
            cmp = {}
            for n, x in outs.items():
                d = x.double() - ref[n].double()
                cmp[n] = {"nan": int(torch.isnan(x).sum()), "rel_norm": float(d.norm() / ref[n].double().norm())}
            runs[name] = run
            rows.append({"shape": shape, "form": name, "vs_shipped": cmp, "ms": []})
            print(f"{shape} {name}: " + " ".join(f"{n}={v['rel_norm']:.1e}/nan{v['nan']}" for n, v in cmp.items()),
                  flush=True)
        if B * T * H < 2 ** 17:
            continue
        for r in range(args.rounds):
            for row in rows:
                if row["shape"] == shape and row["form"] in runs:
                    ms = triton.testing.do_bench(runs[row["form"]], warmup=25, rep=200)
                    row["ms"].append(round(ms, 4))
                    print(f"{shape} round {r} {row['form']}: {ms:.4f} ms", flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tok_pipe.json").write_text(json.dumps({
        "unit": str(args.unit), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
