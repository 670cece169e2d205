"""Sweep the chunk kernels' launch knobs on one GPU: correctness and per-kernel time for each setting.

    python benchmarks/tune.py [--chunks 16,32] [--dims 64,128] [--ignore-warp-caps] [--deadline EPOCH]

Each knob setting of a stage (num_warps x num_stages x block_v) is rendered into its own spec (the three
stages' settings are offset against each other so no two specs pair the same settings), built ahead of time
with `dplr_gen.toolchain.build`, and then measured in a fresh worker process per spec (an illegal memory access in one
setting cannot poison the others):
  accuracy  bf16, B=2, T=512, H=2, RWKV-7 inputs, outputs poisoned: relative-norm error of o, final state and
            every gradient against the float64 reference (computed once per head dim);
  time      do_bench medians of each stage alone: prep (chunk_dplr_prep_kernel), fwd (prep + the state pass),
            states (the backward's states-only pass), prep_bwd, prep_bwd_kept (the same where the forward kept
            the states: no W, M), prep_both (the backward's prep writing the forward's operands too),
            fwd_kept (the forward keeping the states, its own prep), fwd_train (the same with prep_both),
            bwd_dh (the reverse state pass), bwd (the chunk-parallel token pass), at (4, 4096, 32, 64) for D=64
            and (8, 2048, 16, 128) for D=128, bounded gate -0.61.
--ignore-warp-caps drops the quirk registry's stage num_warps caps for the sweep, so that a cap can be
re-examined on the hardware (the accuracy column then says whether the capped setting is actually wrong).
Writes $OUT/tune_<date>.json and prints, per stage, the settings ranked by time (wrong ones marked).
--package DIR times a built package's kernels as shipped instead (no sweep, no build).
--dry-run runs the same control flow on CPU (TRITON_INTERPRET=1, fp32, tiny shapes, no AOT build).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()
STAGES = ("prep", "fwd", "bwd_dh", "bwd")  # knob stages; prep's block_v is unused
GATE_BOUND = -0.61
ACC_SHAPE = (2, 512, 2)
TIME_SHAPES = {64: (4, 4096, 32), 128: (8, 2048, 16)}
DRY_TIME_SHAPE = (1, 48, 1)

SPEC = """
name: tune{i:02d}
targets: [{target}]
variants:
  - ops: [chunk]
    dtypes: [{dtype}]
    head_dims: {dims}
    chunk_sizes: {chunks}
    varlen: [false]
    gate_bounds: [{bound}]
tuning:
{tuning}
"""


def settings(warps: list[int], stages: list[int], block_v: list[int]) -> list[dict[str, int]]:
    return [{"num_warps": w, "num_stages": s, "block_v": bv} for w, s, bv in itertools.product(warps, stages, block_v)]


def spec_settings(grid: list[dict[str, int]]) -> list[dict[str, dict[str, int]]]:
    """One dict stage -> setting per spec; stage j uses grid[(i + j * n/3) % n] so pairings differ."""
    n = len(grid)
    return [{st: grid[(i + j * (n // len(STAGES))) % n] for j, st in enumerate(STAGES)} for i in range(n)]


def drop_warp_caps() -> None:
    """Remove the registry's num_warps caps from this process's view of it (sweep only)."""
    from dplr_gen.spec import quirks

    kept = tuple(q for q in quirks.load_quirks() if not (q.avoid.stage_max_num_warps or q.avoid.max_num_warps))
    quirks.load_quirks = lambda: kept  # type: ignore[assignment]


# ----------------------------------------------------------------------------------------------------------
# worker: one spec package, one job per (head dim, chunk): "D64:C16"


def worker(cfg: dict[str, Any], jobs: list[str]) -> int:
    C.worker_setup(cfg["device"])
    if cfg["ignore_warp_caps"]:
        drop_warp_caps()

    def run(job: str) -> dict[str, Any]:
        import torch

        from dplr_gen.runtime import chunk_driver as drv
        from dplr_gen.runtime import ops
        from dplr_gen.runtime.loader import package_at

        D, chunk = (int(p[1:]) for p in job.split(":"))
        dev, dtype = cfg["device"], getattr(torch, cfg["dtype"])
        pkg = package_at(cfg["package"])
        row: dict[str, Any] = {"spec": pkg.name, "D": D, "chunk": chunk}
        # the variant the public op runs for RWKV-7 inputs (w in the inputs' dtype)
        name = ops._select(str(pkg.dir), "chunk", dtype, D, D, False, chunk, GATE_BOUND, dtype)
        info = pkg.variants[name]
        ks = pkg.kernel_set(name, pkg.target_for(torch.device(dev)))
        row["constexprs"] = {k: ks.constexprs(k) for k in (drv.PREP, drv.FWD, drv.BWD_DH, drv.BWD)}
        # accuracy, outputs poisoned, through the public op with this chunk size
        ref = torch.load(cfg["refs"])[D]
        system = C.System("tune", "dplr", "sweep", (("lower_bound", GATE_BOUND), ("chunk_size", chunk)))
        op, _ = C.load_op(system, cfg["package"])
        x = C.leaves({n: None if t is None else t.to(dev) for n, t in ref["x"].items()})
        with drv.forced(poison=True):
            got = C.fwd_bwd(op, x, ref["do"].to(dev), ref["dht"].to(dev))
            _synchronize("accuracy run", dev)
        row["err"] = C.errors(got, ref["ref"])
        # per-kernel time, the driver called directly
        B, T, H = cfg["time_shape"] or TIME_SHAPES[D]
        x = C.rwkv7_case(B, T, H, D, dtype=dtype, device=dev, seed=7)
        # the driver takes gk in the variant's gate dtype as is (the public op converts it; here it must be
        # done: a bf16 gk read as fp32 runs past its buffer)
        x["w"] = x["w"].to(ops.TORCH_DTYPES[info.gate_dtype])
        fwd_args = (x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], 1.0, x["h0"], None)
        o, ht, saved = drv.chunk_dplr_fwd(ks, info, *fwd_args)
        do, dht = C.grad_outputs(x, 7)
        prep_args = (ks, info, x["r"], x["k"], x["a"], x["b"], x["w"], None, saved["n_slots"])
        pr = drv.chunk_prep(*prep_args, for_bwd=True)
        dh, dr = drv.chunk_dplr_bwd_dh(ks, info, saved, pr, do, dht)[:2]
        h, u = saved["states"]
        # a variant whose token pass derives every second state reads the backward prep's step operands
        steps = drv.state_step_operands(pr) if drv.derives_states(ks) else ()
        fns = {
            "prep": lambda: drv.chunk_prep(*prep_args),
            # as a training forward runs it: the backward recomputes the states
            "fwd": lambda: drv.chunk_dplr_fwd(ks, info, *fwd_args, keep_states=False),
            "states": lambda: drv.chunk_states(ks, info, saved, pr),
            "prep_bwd": lambda: drv.chunk_prep(*prep_args, for_bwd=True),
            # as the backward runs it where the forward kept the states (no states pass: no W, M)
            "prep_bwd_kept": lambda: drv.chunk_prep(*prep_args, for_bwd=True, pass_ops=False),
            # as a forward that keeps the states for a backward runs it: one prep for both directions
            "prep_both": lambda: drv.chunk_prep(*prep_args, for_bwd=True, fwd_ops=True),
            # the forward keeping the states (for disable_recompute=True) with its own prep, and with the backward's
            "fwd_kept": lambda: drv.chunk_dplr_fwd(ks, info, *fwd_args, keep_states=True),
            "fwd_train": lambda: drv.chunk_dplr_fwd(ks, info, *fwd_args, keep_states=True, prep_for_bwd=True),
            "bwd_dh": lambda: drv.chunk_dplr_bwd_dh(ks, info, saved, pr, do, dht),
            "bwd": lambda: drv.chunk_dplr_bwd_tokens(ks, info, saved, h, u, do, dh, dr, steps=steps),
        }
        fns_kernels = (drv.PREP, drv.FWD, drv.FWD_H, drv.PREP_BWD, drv.BWD_DH, drv.BWD)
        for st, f in fns.items():  # once each, synchronised: a fault names its stage
            f()
            _synchronize(f"stage {st}", dev)
        row["resources"] = {k: ks.aot[k].resources() for k in fns_kernels if k in ks.aot}
        row["shape"] = [B, T, H, D]
        row["ms"] = {st: C.bench_ms(f, dev, warmup=10, rep=50) for st, f in fns.items()}
        return row

    return C.worker_loop(jobs, run, cfg["device"])


def _synchronize(what: str, device: str) -> None:
    """common.sync, with an asynchronous fault reported as coming from ``what``."""
    try:
        C.sync(device)
    except Exception as e:  # noqa: BLE001 - re-raised with the stage named
        raise RuntimeError(f"{what}: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------------------------------------
# parent


def make_refs(dims: list[int], acc_shape: tuple[int, int, int], dtype: str, device: str, path: Path) -> None:
    """Inputs, cotangents and the float64 reference per head dim, computed once for every worker."""
    import torch

    refs = {}
    for D in dims:
        x = C.rwkv7_case(*acc_shape, D, dtype=getattr(torch, dtype), device=device, seed=1000 + D)
        do, dht = C.grad_outputs(x, 1000 + D)
        ref = C.reference(x, do, dht)
        cpu = lambda d: {n: None if t is None else t.detach().cpu() for n, t in d.items()}  # noqa: E731
        refs[D] = {"x": cpu(x), "do": do.cpu(), "dht": dht.cpu(), "ref": cpu(ref)}
    torch.save(refs, path)


def ranked(rows: list[dict[str, Any]], settings_of: dict[str, dict[str, dict[str, int]]]) -> str:
    """Per (D, chunk, stage): settings sorted by time; '!' marks a setting whose run had an error > 2e-2."""
    lines = []
    keys = sorted({(r["D"], r["chunk"]) for r in rows})
    for D, chunk in keys:
        for st in STAGES:
            cells = []
            for r in rows:
                if (r["D"], r["chunk"]) != (D, chunk):
                    continue
                s = settings_of[r["spec"]][st]
                tag = f"w{s['num_warps']}s{s['num_stages']}v{s['block_v']}"
                if "ms" in r:
                    bad = max(r["err"].values()) > 2e-2
                    cells.append((r["ms"][st], f"{tag} {r['ms'][st]:.3f}{'!' if bad else ''}"))
                else:
                    cells.append((float("inf"), f"{tag} ERR"))
            lines.append(f"D={D} C={chunk} {st:6s}: " + ", ".join(c for _, c in sorted(cells)))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="16,32")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--num-stages", default="1,2")
    ap.add_argument("--block-v", default="16,32,64")
    ap.add_argument("--ignore-warp-caps", action="store_true")
    ap.add_argument("--time-shape", default=None, help="BxTxH for the timings (default: per head dim, see above)")
    ap.add_argument("--build-jobs", type=int, default=16, help="parallel compiles for the sweep's builds")
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds: jobs not done by then are recorded")
    ap.add_argument("--package", default=None,
                    help="no sweep: time this built package's chunk kernels (e.g. generated/hopper) as shipped")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--jobs", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker), args.jobs.split(","))

    from dplr_gen.toolchain import build as b

    if args.ignore_warp_caps:
        drop_warp_caps()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    chunks, dims = ints(args.chunks), ints(args.dims)
    dry = args.dry_run
    device, dtype = ("cpu", "float32") if dry else ("cuda", "bfloat16")
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
        target = "sm_90"
    else:
        import torch

        major, minor = torch.cuda.get_device_capability()
        target = f"sm_{major * 10 + minor}"
    time_shape = None
    if args.time_shape:
        time_shape = [int(x) for x in args.time_shape.lower().split("x") if x.isdigit()]
        if len(time_shape) != 3 or min(time_shape) < 1:
            ap.error(f"--time-shape {args.time_shape!r}: give BxTxH, e.g. 1x4096x2")
    if args.package and not (Path(args.package) / "index.json").is_file():
        ap.error(f"--package {args.package!r}: not a generated package folder (no index.json); give e.g. "
                 "generated/hopper after `dplr-gen build specs/hopper.yaml`")
    grid = settings(ints(args.warps), ints(args.num_stages), ints(args.block_v))
    per_spec = [] if args.package else spec_settings(grid)
    tmp = Path(tempfile.mkdtemp(prefix="dplr-tune-"))
    specs, settings_of = [], {}
    for i, st in enumerate(per_spec):
        tuning = "\n".join(f"  chunk.{s}: {json.dumps(k)}" for s, k in st.items())
        path = tmp / f"tune{i:02d}.yaml"
        path.write_text(SPEC.format(i=i, target=target, dtype={"bfloat16": "bf16", "float32": "fp32"}[dtype],
                                    dims=json.dumps(dims), chunks=json.dumps(chunks), bound=GATE_BOUND,
                                    tuning=tuning))
        specs.append(path)
        settings_of[f"tune{i:02d}"] = st
    out = C.out_dir()
    result: dict[str, Any] = {"machine": C.machine_info(device), "date": C.stamp(), "target": target,
                              "ignore_warp_caps": args.ignore_warp_caps, "settings": settings_of, "rows": [],
                              "build": {}}
    res_path = out / f"tune_{C.stamp()}.json"

    t0 = time.perf_counter()
    if dry:  # (--package: no specs, nothing to build)
        for p in specs:
            b.write_package(b.plan(p, tmp / "gen"))
    else:
        jobs_each = max(1, args.build_jobs // 4)
        with ThreadPoolExecutor(4) as pool:
            reports = list(pool.map(lambda p: b.build(p, jobs=jobs_each, out_root=tmp / "gen"), specs))
        for r in reports:
            result["build"][r.spec] = [{"unit": o.unit, "error": o.error[:500]} for o in r.failures]
    result["build_s"] = time.perf_counter() - t0
    print(f"built {len(specs)} specs in {result['build_s']:.0f} s", flush=True)

    refs = tmp / "refs.pt"
    make_refs(dims, (1, 20, 1) if dry else ACC_SHAPE, dtype, device, refs)
    deadline = args.deadline or time.time() + 7 * 86400
    packages = [Path(args.package).resolve()] if args.package else [tmp / "gen" / p.stem for p in specs]
    for pkg_dir in packages:
        cfg = {"package": str(pkg_dir), "refs": str(refs), "device": device, "dtype": dtype,
               "ignore_warp_caps": args.ignore_warp_caps,
               "time_shape": DRY_TIME_SHAPE if dry else time_shape}
        jobs = [f"D{D}:C{c}" for D in dims for c in chunks]
        got = C.run_jobs(C.worker_cmd(SCRIPT, cfg), jobs, deadline, C.worker_env(device, allow_jit=args.package is None))
        for job, r in got.items():
            D, c = (int(p[1:]) for p in job.split(":"))
            row = {"spec": pkg_dir.name, "D": D, "chunk": c, **{k: v for k, v in r.items() if k != "job"}}
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
        C.write_json(res_path, result)
    table = ranked(result["rows"], settings_of) if settings_of else "\n".join(
        f"D={r['D']} C={r['chunk']} " + " ".join(f"{st} {ms:.3f}" for st, ms in r.get("ms", {}).items())
        for r in result["rows"])
    print(table)
    result["table"] = table.splitlines()
    C.write_json(res_path, result)
    print(f"wrote {res_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
