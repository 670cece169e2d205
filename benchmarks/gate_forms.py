"""What the any-gate variants cost by gate data (session 15: each chunk takes the factored form where its
exponents allow it, the exact row-by-row form elsewhere). On the GPU, with the hopper package built:

    python benchmarks/gate_forms.py [--shapes 4x4096x32x64,8x2048x16x128]

dplr-generic's forward and forward+backward medians (do_bench) on RWKV-7 inputs whose gates are: ``rwkv7``
(w in (-0.61, 0): every chunk factored), ``mixed`` (benchmarks.common.mixed_gates: one chunk in 16 exact, plus
resets), ``steep`` (w = -5 everywhere: every chunk exact, the cost of every chunk before session 15); dplr-fast
(lower_bound=-0.61) on the rwkv7 gates beside them. Writes $OUT/gate_forms_<stamp>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common as C  # noqa: E402

GATES = ("rwkv7", "mixed", "steep")


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x4096x32x64,8x2048x16x128")
    ap.add_argument("--package", default="generated/hopper")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        B, T, H, D = (int(n) for n in shape.split("x"))
        for gates in GATES:
            x = C.rwkv7_case(B, T, H, D, dtype=torch.bfloat16, device="cuda", seed=7)
            if gates == "mixed":
                C.mixed_gates(x["w"])
            elif gates == "steep":
                x["w"].fill_(-5.0)
            do, dht = C.grad_outputs(x, 7)
            for system in ("dplr-generic", "dplr-fast") if gates == "rwkv7" else ("dplr-generic",):
                op, _ = C.load_op(C.SYSTEMS[system], args.package)
                fwd, fwd_bwd = C.step_closures(op, C.leaves(x), do, dht)
                fwd_bwd()
                row = {"shape": shape, "gates": gates, "system": system,
                       "variant": C.dplr_variant(C.SYSTEMS[system], args.package, x),
                       "fwd_ms": C.bench_ms(fwd, "cuda"), "fwd_bwd_ms": C.bench_ms(fwd_bwd, "cuda")}
                rows.append(row)
                print(f"{shape:>16} {gates:>6} {system:>13}: fwd {row['fwd_ms']:.3f} ms, fwd+bwd "
                      f"{row['fwd_bwd_ms']:.3f} ms", flush=True)
            del x
            C.free("cuda")
    path = C.out_dir() / f"gate_forms_{C.stamp()}.json"
    C.write_json(path, {"machine": C.machine_info("cuda"), "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
