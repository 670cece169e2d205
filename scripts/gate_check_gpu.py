"""The lower_bound promise's check on a GPU (dplr_gen.runtime.gate_check): each case in a process of its own, since a
broken promise ends that process's CUDA context with a device-side assert.

    python scripts/gate_check_gpu.py OUT.json [--device cuda|cpu]

Cases (bf16, B=2, T=1024, H=4, K=V=64 RWKV-7 inputs, gates clamped to >= -0.6, chunk_rwkv7-style call of
chunk_dplr_delta_rule with lower_bound=-0.61, forward and backward):
  clean, clean-keep, clean-compile    a kept promise runs to the end (keep: disable_recompute=True, whose forward
                                      runs the backward's prep; compile: torch.compile fullgraph)
  broken, nan, broken-keep, broken-compile, broken-tail
                                      one gate of -1 (NaN; the last token) fails with the device-side assert
  broken-sync                         DPLR_GEN_CHECK_LOWER_BOUND=sync: a ValueError naming lower_bound
  broken-off                          DPLR_GEN_CHECK_LOWER_BOUND=0: runs to the end (unchecked)
  graph                               a kept promise, forward+backward captured in a CUDA graph, replayed
PASS/FAIL per case into OUT.json. --device cpu: the same under the interpreter with the in-kernel form forced
(gate_check.KERNEL_ON_CPU; fp32, a shorter sequence), where the assert raises at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = ("clean", "clean-keep", "clean-compile", "broken", "nan", "broken-keep", "broken-compile", "broken-tail",
         "broken-sync", "broken-off", "graph")
FINISHED = "CASE FINISHED"


def expected(case: str) -> str:
    """"ok" (runs to the end), "assert" (the device assert) or "sync" (the host's ValueError)."""
    if case.startswith("clean") or case in ("graph", "broken-off"):
        return "ok"
    return "sync" if case == "broken-sync" else "assert"


def child(case: str, device: str) -> None:
    import torch

    import dplr_gen
    from dplr_gen.runtime import gate_check
    from dplr_gen.testing import rwkv7_inputs

    cpu = device == "cpu"
    gate_check.KERNEL_ON_CPU = cpu
    os.environ[gate_check.CHECK_ENV] = {"broken-sync": "sync", "broken-off": "0"}.get(case, "1")
    B, T, H, D = (1, 40, 2, 64) if cpu else (2, 1024, 4, 64)
    x = rwkv7_inputs(B, T, H, D, dtype=torch.float32 if cpu else torch.bfloat16, device=device)
    x["gk"] = x["gk"].clamp(min=-0.6)
    if case.startswith("broken") or case == "nan":
        x["gk"][B - 1, T - 1 if case == "broken-tail" else T // 2, H - 1, 3] = float("nan") if case == "nan" else -1.0
    xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}

    def step(q, k, v, a, b, gk, h0):  # type: ignore[no-untyped-def]
        o, ht = dplr_gen.chunk_dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True,
                                               lower_bound=-0.61, disable_recompute=case.endswith("keep"))
        return o, ht

    fn = torch.compile(step, fullgraph=True) if case.endswith("compile") else step
    args = [xs[n] for n in ("q", "k", "v", "a", "b", "gk", "initial_state")]
    if case == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (the flag is made here)
            o, ht = fn(*args)
            (o.float().sum() + ht.sum()).backward()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            o, ht = fn(*args)
            (o.float().sum() + ht.sum()).backward()
        g.replay()
    else:
        o, ht = fn(*args)
        (o.float().square().sum() + ht.sum()).backward()
    if not cpu:
        torch.cuda.synchronize()
    print(FINISHED, bool(torch.isfinite(o).all()), flush=True)


def judge(case: str, rc: int, out: str) -> tuple[str, str]:
    want = expected(case)
    if want == "ok":
        got = rc == 0 and FINISHED in out
    elif want == "sync":
        got = rc != 0 and "ValueError" in out and "lower_bound=-0.61 promises" in out
    else:  # CUDA: the device assert; CPU (interpreter): the assert's message at once
        got = rc != 0 and FINISHED not in out and ("device-side assert" in out or "gk < lower_bound=-0.61" in out)
    return ("PASS" if got else "FAIL"), want


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?", help="where the JSON result goes")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        child(args.case, args.device)
        return 0
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if args.device == "cpu" else {}))
    rows = []
    for case in CASES:
        if case == "graph" and args.device == "cpu":
            continue
        p = subprocess.run([sys.executable, __file__, "--case", case, "--device", args.device], capture_output=True,
                           text=True, env=env, timeout=900)
        out = p.stdout + p.stderr
        verdict, want = judge(case, p.returncode, out)
        rows.append({"case": case, "expected": want, "verdict": verdict, "rc": p.returncode, "tail": out[-1500:]})
        print(case, want, verdict, flush=True)
        args.out.write_text(json.dumps({"device": args.device, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
