"""Probe the state chunk (spec axis state_chunk_sizes) on one GPU: accuracy and per-kernel time of the chunk
kernels with the state passes at 16, 32 or 64 tokens over 16-token chunks, at a few launch knobs.

    python benchmarks/state_chunk_probe.py [--deadline EPOCH]

Kernels are rendered from templates/chunk_dplr.py.jinja with Hopper's flags and JIT-compiled (the test
harness's loader, tests/test_chunk_kernels.py), so no spec is built. Each case runs in its own process (an
illegal address poisons a CUDA context): first all cases in parallel at the accuracy shape (bf16, B=2, T=512,
H=2, bound -0.61, vs the float64 reference; this also fills Triton's cache), then one at a time at the timing
shape, every kernel launched once and synchronised (a fault names its kernel), then do_bench medians.
Writes $OUT/state_chunk_probe_<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import common as C  # noqa: E402

SHAPES = {64: [(4, 4096, 32)], 128: [(8, 2048, 16), (1, 4096, 2)]}
# (state chunk, prep warps, passes' (warps, V tile)); the token pass keeps the shipped knobs
CASES: list[dict[str, Any]] = [
    {"D": D, "sc": sc, "prep_w": pw, "pass_w": w, "pass_bv": bv}
    for D in (64, 128)
    for sc, pw in ((None, 2), (32, 2), (64, 4))
    for w, bv in ((2, 32), (4, 64))
]
TOKEN_KNOBS = {64: (4, 32), 128: (4, 16)}


def _kernels(case: dict[str, Any]) -> tuple[Any, Any, Any]:
    os.environ["CHUNK_TEST_DEVICE"] = "cuda"
    sys.path.insert(0, str(REPO / "tests"))
    import test_chunk_kernels as t  # noqa: PLC0415 - the harness reads CHUNK_TEST_DEVICE at import

    v = t.make_variant("bf16", K=case["D"], chunk_size=16, state_chunk=case["sc"], gate_bound=C.GATE_BOUND)
    tw, tbv = TOKEN_KNOBS[case["D"]]
    tune = {
        "prep": t.knobs(num_warps=case["prep_w"], num_stages=2),
        "fwd": t.knobs(block_v=case["pass_bv"], num_warps=case["pass_w"], num_stages=2),
        "bwd_dh": t.knobs(block_v=case["pass_bv"], num_warps=case["pass_w"], num_stages=2),
        "bwd": t.knobs(block_v=tbv, num_warps=tw, num_stages=2),
    }
    return t, v, tune


def accuracy(case: dict[str, Any]) -> dict[str, Any]:
    t, v, tune = _kernels(case)
    errs = t.run_case(v, B=2, T=512, H=2, tune=tune, flags=t.FLAGS_HOPPER)
    return {"err": errs, "max_err": max(errs.values())}


def timing(case: dict[str, Any], shape: tuple[int, int, int]) -> dict[str, Any]:
    import torch

    from dplr_gen import chunk_driver as drv

    t, v, tune = _kernels(case)
    ks = t.load(v, tune, t.FLAGS_HOPPER)
    B, T, H = shape
    D = case["D"]
    x = C.rwkv7_case(B, T, H, D, dtype=torch.bfloat16, device="cuda", seed=7)
    do, dht = C.grad_outputs(x, 7)
    fwd_args = (x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], 1.0, x["h0"], None)
    o, ht, saved = drv.chunk_dplr_fwd(ks, v, *fwd_args)
    prep_args = (ks, v, x["r"], x["k"], x["a"], x["b"], x["w"], None, saved["n_slots_s"])
    w, m, y, p = drv.chunk_prep(*prep_args, for_bwd=True)
    dh, dr, _ = drv.chunk_dplr_bwd_dh(ks, v, saved, y, p, do, dht)
    h, u = saved["states"]
    fns = {
        "prep": lambda: drv.chunk_prep(*prep_args),
        "fwd": lambda: drv.chunk_dplr_fwd(ks, v, *fwd_args),
        "states": lambda: drv.chunk_states(ks, v, saved, w, m),
        "prep_bwd": lambda: drv.chunk_prep(*prep_args, for_bwd=True),
        "bwd_dh": lambda: drv.chunk_dplr_bwd_dh(ks, v, saved, y, p, do, dht),
        "bwd": lambda: drv.chunk_dplr_bwd_tokens(ks, v, saved, h, u, do, dh, dr),
    }
    for name, f in fns.items():
        f()
        try:
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - recorded with the kernel named
            return {"fault": f"{name}: {type(e).__name__}: {str(e)[:200]}"}
    ms = {name: C.bench_ms(f, "cuda", warmup=10, rep=50) for name, f in fns.items()}
    ms["fwd+bwd kernels"] = ms["fwd"] + ms["prep_bwd"] + ms["states"] + ms["bwd_dh"] + ms["bwd"]
    return {"ms": ms}


def _child(args: list[str], timeout: float) -> dict[str, Any]:
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                           timeout=max(timeout, 1), env={**os.environ, "TRITON_INTERPRET": "0"})
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    for line in r.stdout.splitlines():
        if line.startswith(C.RESULT_TAG):
            return json.loads(line[len(C.RESULT_TAG):])
    return {"error": f"rc={r.returncode}: {(r.stderr or r.stdout)[-600:]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline", type=float, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        job = json.loads(args.child)
        try:
            res = accuracy(job["case"]) if job["kind"] == "acc" else timing(job["case"], tuple(job["shape"]))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            res = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(C.RESULT_TAG + json.dumps(C.jsonable(res)), flush=True)
        return 0
    deadline = args.deadline or time.time() + 3600
    out = {"machine": C.machine_info("cuda"), "date": C.stamp(), "token_knobs": TOKEN_KNOBS, "cases": []}
    path = C.out_dir() / f"state_chunk_probe_{C.stamp()}.json"
    left = lambda: deadline - time.time()  # noqa: E731
    with ThreadPoolExecutor(8) as pool:
        accs = list(pool.map(lambda c: _child(["--child", json.dumps({"kind": "acc", "case": c})], left() - 60),
                             CASES))
    for case, acc in zip(CASES, accs):
        print(json.dumps({**case, **acc}), flush=True)
        for shape in SHAPES[case["D"]]:
            row = {**case, "shape": [*shape, case["D"]], "accuracy": acc}
            if left() > 20:
                row.update(_child(["--child", json.dumps({"kind": "time", "case": case, "shape": shape})],
                                  left() - 10))
            else:
                row["error"] = "deadline"
            print(json.dumps({k: row[k] for k in row if k != "accuracy"}), flush=True)
            out["cases"].append(row)
            C.write_json(path, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
