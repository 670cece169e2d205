"""Import and first-call cost: nothing in dplr-gen's path loads torch._dynamo unless the user compiles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import sys, torch
import dplr_gen
from dplr_gen import ops
from dplr_gen.runtime import package_at
from dplr_gen.testing import rwkv7_inputs
assert "torch._dynamo" not in sys.modules, "import"
pkg = package_at(sys.argv[1])
x = rwkv7_inputs(1, 5, 1, 16, seed=0)
x = {n: t.requires_grad_(True) for n, t in x.items()}
o, ht = ops.chunk_dplr_delta_rule(**x, output_final_state=True, package=pkg)
(o.sum() + ht.sum()).backward()
assert "torch._dynamo" not in sys.modules, "first fwd+bwd"
print("OK")
"""


def test_eager_use_does_not_import_dynamo(tmp_path: Path) -> None:
    from dplr_gen import build as b

    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny\ntargets: [sm_80]\nvariants:\n  - ops: [chunk]\n    dtypes: [fp32]\n"
                    "    head_dims: [16]\n    chunk_sizes: [16]\n    varlen: [false]\n")
    p = b.plan(spec, tmp_path / "gen")
    b.write_package(p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(p.out_dir)], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
