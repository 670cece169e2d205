"""torch.compile(fullgraph=True) through both entry points on a GPU: ``dplr_gen.chunk_rwkv7`` (the dispatcher)
and ``generated.<spec>.chunk_rwkv7`` (the spec covering this GPU), forward and backward, against eager.

    python scripts/gpu_compile_check.py OUT.json [--backend inductor]

Needs the spec for this GPU built (`dplr-gen build specs/<arch>.yaml`). Exit 1 when any case fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run_case(op: Any, backend: str, lower_bound: float | None) -> dict[str, Any]:
    import torch

    from dplr_gen.testing import rel_err, rwkv7_inputs

    def step(r, w, k, v, a, b, h0):  # type: ignore[no-untyped-def]
        o, ht = op(r, w, k, v, a, b, initial_state=h0, output_final_state=True, lower_bound=lower_bound)
        return o * 2, ht

    x = rwkv7_inputs(2, 512, 4, 64, dtype=torch.bfloat16, device="cuda", seed=3)
    inputs = [x[n] for n in ("q", "gk", "k", "v", "a", "b", "initial_state")]
    do, dht = torch.randn_like(x["v"]), torch.randn_like(x["initial_state"])
    torch._dynamo.reset()
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend=backend)):
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        o, ht = fn(*xs)
        results.append([o, ht, *torch.autograd.grad((o, ht), xs, (do, dht))])
    names = ["o", "ht", "dr", "dw", "dk", "dv", "da", "db", "dh0"]
    errs = {n: rel_err(c, e) for n, c, e in zip(names, results[1], results[0])}
    return {"rel_err_vs_eager": errs, "ok": all(e < 1e-2 for e in errs.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="where the JSON result goes")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    args = ap.parse_args()
    import torch

    import dplr_gen
    from dplr_gen.runtime import dispatch

    spec = dispatch.default_package().package_for(torch.device("cuda")).name
    entries = {"dplr_gen.chunk_rwkv7": lambda: dplr_gen.chunk_rwkv7,
               f"generated.{spec}.chunk_rwkv7": lambda: importlib.import_module(f"generated.{spec}").chunk_rwkv7}
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "backend": args.backend, "spec": spec, "cases": {}}
    for name, get in entries.items():
        for lb in (None, -0.61):
            key = f"{name} lower_bound={lb}"
            try:
                report["cases"][key] = run_case(get(), args.backend, lb)
            except Exception as e:  # reported per case, the others still run
                report["cases"][key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:3000],
                                        "traceback": traceback.format_exc()[-3000:]}
            print(key, "ok" if report["cases"][key]["ok"] else "FAILED", flush=True)
    report["ok"] = all(c["ok"] for c in report["cases"].values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
