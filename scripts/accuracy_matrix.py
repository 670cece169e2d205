"""Accuracy across the input regimes users call, dplr-gen beside fla-core on the same tensors (GPU).

    python scripts/accuracy_matrix.py --out accuracy.json [--only main,length,varlen,dims] [--fla-max-configs 1]
    python scripts/accuracy_matrix.py --dry-run --out x.json    # CPU interpreter, tiny fp16 stand-ins, no fla

Each row: one input regime, one variant family (dtype; bounded gate lower_bound=-0.61 or any gate; dense or
varlen), one shape. Both systems run `chunk_dplr_delta_rule` forward and backward (gradients of <o, dO> +
<h_T, dh_T> w.r.t. q, k, v, a, b, gk and h0) on the same tensors; errors are relative norms (fla's assert_close
metric) against the float64 step-by-step reference of dplr_gen.reference.

PASS: finite wherever the reference is; o <= 7e-3, final state and every gradient <= 8e-3 (fla's own test
bounds); and each error <= 1.5 x fla-core's on the same tensors (+1e-6) where fla ran.

Regimes: rwkv7 (a = -kk, b = kk * iclr); delta (b = -a, a = normalize(rand) >= 0), delta-signed
(a = normalize(randn)), delta-beta (b = -beta * a, beta in (0, 1]); on delta inputs the gates: slow
(gk in (-0.1, 0)), masked (logsigmoid(randn), half exactly 0), bound (gk = -0.61 everywhere) and, any-gate only,
steep (logsigmoid(randn) * 10). The default gate is logsigmoid(randn) / 10. Bounded rows clamp gk at -0.61 (the
promise a caller of lower_bound keeps).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import common as C  # noqa: E402

BOUND = -0.61
O_MAX, REST_MAX = 7e-3, 8e-3
FLA_FACTOR, FLA_SLACK = 1.5, 1e-6
NAMES = ("q", "k", "v", "a", "b", "gk", "initial_state")
QUANTITIES = ("o", "ht", "dq", "dk", "dv", "da", "db", "dgk", "dinitial_state")
VARLEN = (1, 15, 16, 17, 63, 200, 2000, 37, 700, 1)
REGIMES = ("rwkv7", "delta", "delta-signed", "delta-beta", "slow", "masked", "bound", "steep")
FAMILIES = ("bounded", "any")  # lower_bound=-0.61, and no bound


@dataclass(frozen=True)
class Row:
    group: str
    dtype: str  # "bf16" | "fp16" | "fp32"
    family: str  # "bounded" | "any"
    regime: str
    K: int
    V: int
    T: int
    B: int = 2
    H: int = 2
    varlen: bool = False
    with_fla: bool = True  # the odd-dims rows of the bounded family run without fla (its compile time per dim)

    @property
    def key(self) -> str:
        shape = f"varlen{len(VARLEN)}" if self.varlen else f"B{self.B}T{self.T}"
        return f"{self.group}/{self.dtype}/{self.family}/{self.regime}/K{self.K}V{self.V}/{shape}H{self.H}"


def rows(groups: set[str], dims: list[tuple[int, int]], dtypes: list[str],
         families: tuple[str, ...] = FAMILIES) -> list[Row]:
    out: list[Row] = []
    for dt in dtypes:
        for fam in families:
            regimes = [r for r in REGIMES if not (r == "steep" and fam == "bounded")]
            if "main" in groups:
                out += [Row("main", dt, fam, r, d, d, 1000) for d in (64, 128) for r in regimes]
            if "length" in groups:
                out += [Row("length", dt, fam, r, 64, 64, t) for t in (1, 15, 63, 100, 4096)
                        for r in ("rwkv7", "delta")]
            if "varlen" in groups:
                out += [Row("varlen", dt, fam, r, d, d, sum(VARLEN), 1, 2, True) for d in (64, 128)
                        for r in ("rwkv7", "delta", "masked")]
            if "dims" in groups:
                out += [Row("dims", dt, fam, r, k, v, 1000, with_fla=fam == "any") for k, v in dims
                        for r in ("rwkv7", "delta")]
    return out


def inputs(row: Row, device: str, seed: int) -> tuple[dict[str, torch.Tensor], float]:
    """The regime's q, k, v, a, b, gk, h0 (fp32 master copies, rounded to the row's dtype) and scale."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, T = (1, row.T) if row.varlen else (row.B, row.T)
    H, K, V = row.H, row.K, row.V

    def rn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    def ru(*s: int) -> torch.Tensor:
        return torch.rand(*s, generator=g)

    q, k, v = rn(B, T, H, K), rn(B, T, H, K), rn(B, T, H, V)
    scale = K**-0.5
    if row.regime == "rwkv7":
        kk = F.normalize(rn(B, T, H, K), dim=-1)
        a, b = -kk, kk * torch.sigmoid(rn(B, T, H, K))
        k = k * K**-0.5
        gk = -0.6065 * torch.sigmoid(rn(B, T, H, K))
        scale = 1.0
    else:
        a = F.normalize(rn(B, T, H, K) if row.regime in ("delta-signed", "delta-beta") else ru(B, T, H, K), dim=-1)
        beta = ru(B, T, H, 1).clamp_min(1e-3) if row.regime == "delta-beta" else 1.0
        b = -beta * a
        gk = F.logsigmoid(rn(B, T, H, K)) / 10
        if row.regime == "slow":
            gk = -0.1 * ru(B, T, H, K)
        elif row.regime == "masked":
            gk = F.logsigmoid(rn(B, T, H, K)) * (ru(B, T, H, K) < 0.5)
        elif row.regime == "bound":
            gk = torch.full((B, T, H, K), BOUND)
        elif row.regime == "steep":
            gk = F.logsigmoid(rn(B, T, H, K)) * 10
    if row.family == "bounded":
        gk = gk.clamp_min(BOUND)
    N = len(VARLEN) if row.varlen else B
    h0 = rn(N, H, K, V)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[row.dtype]
    x = {"q": q, "k": k, "v": v, "a": a, "b": b, "gk": gk}
    out = {n: t.to(device=device, dtype=dt) for n, t in x.items()}
    out["initial_state"] = h0.to(device)
    return out, scale


def fwd_bwd(fn: Callable[..., Any], x: dict[str, torch.Tensor], do: torch.Tensor, dht: torch.Tensor,
            **kw: Any) -> dict[str, torch.Tensor]:
    xl = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, ht = fn(**xl, output_final_state=True, **kw)
    grads = torch.autograd.grad((o, ht), [xl[n] for n in NAMES], (do.to(o.dtype), dht))
    return {"o": o.detach(), "ht": ht.detach(), **{"d" + n: g for n, g in zip(NAMES, grads)}}


def errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: C.rel_err(got[n], ref[n]) for n in QUANTITIES}


def verdict(row: Row, err: dict[str, float], fla: dict[str, float] | None,
            ref_finite: bool) -> tuple[bool, list[str]]:
    why = []
    for n, e in err.items():
        lim = O_MAX if n == "o" else REST_MAX
        if row.dtype == "fp32":
            lim = 1e-4
        if not e < float("inf") and ref_finite:
            why.append(f"{n} not finite")
        elif e > lim:
            why.append(f"{n} {e:.2e} > {lim:.0e}")
        if fla is not None and fla.get(n, float("inf")) < float("inf") and e > FLA_FACTOR * fla[n] + FLA_SLACK:
            why.append(f"{n} {e:.2e} > {FLA_FACTOR} x fla {fla[n]:.2e}")
    return not why, why


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="main,length,varlen")
    ap.add_argument("--dims", default="16x16,60x60,100x100,256x256,64x128,100x60")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help="variant families: bounded (lower_bound=-0.61), any (no bound)")
    ap.add_argument("--fla-max-configs", type=int, default=1,
                    help="fla's autotuners keep this many configs (its error does not depend on the tile config)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--deadline", type=float, default=0.0, help="unix time: stop starting rows after it")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, T <= 40, fp16, no fla")
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import dplr_gen

    dims = [tuple(int(p) for p in d.split("x")) for d in args.dims.split(",") if d]
    families = tuple(f for f in args.families.split(",") if f)
    if not families or set(families) - set(FAMILIES):
        ap.error(f"--families: a comma-separated subset of {', '.join(FAMILIES)}, got {args.families!r}")
    todo = rows(set(args.only.split(",")), dims, args.dtypes.split(",") if not args.dry_run else ["fp16"],  # type: ignore[arg-type]
                families)
    if args.dry_run:
        todo = [Row(r.group, r.dtype, r.family, r.regime, min(r.K, 64), min(r.V, 64), min(r.T, 40), 1, 1, False)
                for r in todo if not r.varlen][:6]
    fla_fn = None
    fla_info: dict[str, Any] = {"available": False}
    if not (args.no_fla or args.dry_run):
        try:
            if args.fla_max_configs:
                C.limit_autotune_configs(args.fla_max_configs)
            from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule as fla_fn  # type: ignore
            fla_info = {"available": True, "fla_core": C.package_version("fla-core"),
                        "params": list(inspect.signature(fla_fn).parameters),
                        "autotune_configs_kept": args.fla_max_configs}
        except Exception as e:  # noqa: BLE001 - recorded, the rows then compare with float64 only
            fla_info = {"available": False, "error": f"{type(e).__name__}: {e}"}
    result: dict[str, Any] = {"script": "scripts/accuracy_matrix.py", "argv": sys.argv[1:],
                              "machine": C.machine_info(device) if device == "cuda" else {"device": "cpu"},
                              "dplr_gen_source_sha": C.source_digest(), "fla": fla_info,
                              "bounds": {"o": O_MAX, "rest": REST_MAX, "fla_factor": FLA_FACTOR}, "rows": []}
    out = Path(args.out)
    for i, row in enumerate(todo):
        if args.deadline and time.time() > args.deadline:
            result["stopped_at_deadline"] = row.key
            break
        rec: dict[str, Any] = {"row": asdict(row), "key": row.key}
        t0 = time.time()
        try:
            x, scale = inputs(row, device, seed=1000 + i)
            cu = torch.tensor([0, *torch.tensor(VARLEN).cumsum(0).tolist()], device=device) if row.varlen else None
            gen = torch.Generator(device="cpu").manual_seed(7 + i)
            o_shape = (*x["v"].shape,)
            do = torch.randn(o_shape, generator=gen).to(device)
            dht = torch.randn(x["initial_state"].shape, generator=gen).to(device)
            x64 = {n: t.double() for n, t in x.items()}
            ref = fwd_bwd(dplr_gen.naive_dplr_delta_rule, x64, do.double(), dht.double(), scale=scale, cu_seqlens=cu)
            ref_finite = all(bool(torch.isfinite(t).all()) for t in ref.values())
            kw: dict[str, Any] = {"scale": scale}
            if row.family == "bounded":
                kw["lower_bound"] = BOUND
            got = fwd_bwd(dplr_gen.chunk_dplr_delta_rule, x, do, dht,
                          cu_seqlens=None if cu is None else cu.to(torch.int32), **kw)
            rec["dplr"] = errors(got, ref)
            del got
            fla_err = None
            if fla_fn is not None and row.with_fla:
                try:
                    fkw: dict[str, Any] = {"scale": scale}
                    if row.family == "bounded" and "lower_bound" in fla_info["params"]:
                        fkw["lower_bound"] = BOUND
                    fg = fwd_bwd(fla_fn, x, do, dht, cu_seqlens=None if cu is None else cu.to(torch.int64), **fkw)
                    fla_err = rec["fla"] = errors(fg, ref)
                    rec["fla_kwargs"] = {k: v for k, v in fkw.items() if k != "scale"}
                    del fg
                except Exception as e:  # noqa: BLE001 - fla's failure is recorded, dplr-gen still judged
                    rec["fla_error"] = f"{type(e).__name__}: {e}"[:500]
            rec["pass"], rec["why"] = verdict(row, rec["dplr"], fla_err, ref_finite)
        except Exception as e:  # noqa: BLE001 - a crash is a failing row, the matrix goes on
            rec["pass"], rec["why"] = False, [f"{type(e).__name__}: {e}"[:500]]
            rec["traceback"] = traceback.format_exc()[-2000:]
        rec["seconds"] = round(time.time() - t0, 2)
        result["rows"].append(rec)
        d, f = rec.get("dplr", {}), rec.get("fla", {})
        print(f"{'PASS' if rec['pass'] else 'FAIL'} {row.key} " + " ".join(
            f"{n}={d.get(n, float('nan')):.1e}/{f.get(n, float('nan')):.1e}" for n in QUANTITIES)
            + ("" if rec["pass"] else f"  <- {'; '.join(rec['why'])}"), flush=True)
        result["summary"] = {"rows": len(result["rows"]), "pass": sum(r["pass"] for r in result["rows"])}
        out.write_text(json.dumps(C.jsonable(result), indent=1))
        if device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(result.get("summary")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
