"""benchmarks/tune.py's control flow on CPU (--dry-run: interpreter, fp32, tiny shapes, no AOT build)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_tune_dry_run_measures_every_setting(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tune.py"), "--dry-run", "--dims", "16", "--chunks", "16",
         "--warps", "2,4", "--num-stages", "1", "--block-v", "16"],
        env=env, text=True, capture_output=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (res_file,) = tmp_path.glob("tune_*.json")
    res = json.loads(res_file.read_text())
    assert len(res["rows"]) == 2 and set(res["settings"]) == {"tune00", "tune01"}
    for row in res["rows"]:
        assert "error" not in row, row
        assert max(row["err"].values()) < 1e-5  # fp32 interpreter vs the float64 reference
        assert set(row["ms"]) == {"prep", "fwd", "states", "prep_bwd", "bwd_dh", "bwd"} and all(t > 0 for t in row["ms"].values())
    # each stage saw both warp counts: the settings are offset, not repeated
    warps = {st: {res["settings"][r]["fwd"]["num_warps"] for r in res["settings"]} for st in ("fwd",)}
    assert warps["fwd"] == {2, 4}
    assert "D=16 C=16 bwd" in "\n".join(res["table"])
