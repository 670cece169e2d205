"""scripts/fla_model_check.py's harness on CPU (Triton's interpreter): with the stand-in fla (tests/fla_standin.py)
every phase runs, the dplr-gen mode's layer calls reach dplr-gen (counted per op) and agree with the stand-in's
reference; without fla every phase records why it did not run, and the JSON and the table are still written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .fla_standin import write_standin

REPO = Path(__file__).resolve().parent.parent
TINY = ["--device", "cpu", "--dtype", "float32", "--steps", "3", "--batch", "1", "--seq-len", "68", "--hidden", "64",
        "--layers", "1", "--head-dim", "64", "--vocab", "32", "--prompt-len", "64", "--new-tokens", "3",
        "--warmup", "1", "--budget", "240"]


def _run(tmp_path: Path, pythonpath: list[str], *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path / "out"),
               PYTHONPATH=os.pathsep.join([*pythonpath, str(REPO)]))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "fla_model_check.py"), *TINY, *extra], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    path = tmp_path / "out" / "fla_model_check.json"
    assert path.exists(), proc.stderr[-3000:]
    return proc, json.loads(path.read_text())


def test_with_a_standin_fla_every_phase_runs_and_dplr_gen_is_reached(tmp_path: Path) -> None:
    proc, rec = _run(tmp_path, [str(write_standin(tmp_path / "fla_pkg"))], "--fla-max-configs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ph = rec["phases"]
    assert {n: p["status"] for n, p in ph.items()} == {
        "setup": "ok", "train fla": "ok", "train dplr-gen": "ok", "decode fla": "ok", "decode dplr-gen": "ok"}, ph
    # training: one chunk call per layer and step; decoding: a prefill (chunk, 64 tokens) and fused_mul steps, twice
    # (the warm-up decode, then the timed one)
    assert "calls_routed" not in ph["train fla"] and ph["train dplr-gen"]["calls_routed"] == {"chunk_rwkv7": 3}
    assert ph["decode dplr-gen"]["calls_routed"] == {"chunk_rwkv7": 2, "fused_mul_recurrent_rwkv7": 4}
    assert len(ph["train dplr-gen"]["losses"]) == 3 and ph["train dplr-gen"]["tokens_per_s"] > 0
    c = rec["comparison"]
    assert c["loss_steps_compared"] == 3 and c["loss_max_abs_diff"] < 1e-4
    assert c["tokens_match"] is True and len(ph["decode fla"]["tokens"]) == 3
    assert max(rec["decode_logits_max_abs_diff"]) < 1e-4
    assert ph["decode fla"]["weights"] == "after fla's training"
    assert "has no attribute 'generate'" in ph["decode fla"]["generate_error"]  # recorded, not fatal
    assert rec["machine"]["device"] == "cpu" and "triton" in rec["machine"]
    assert "tokens match: True" in proc.stdout.splitlines()[-1]
    assert rec["args"]["fla_max_configs"] == 2 and "(fla autotune limited to 2 configs)" in proc.stdout


def test_without_fla_each_phase_records_why(tmp_path: Path) -> None:
    proc, rec = _run(tmp_path, [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rec["phases"]["setup"]["status"] == "error"
    assert "No module named 'fla'" in rec["phases"]["setup"]["error"]
    assert all(rec["phases"][n]["status"] == "skipped" for n in ("train fla", "train dplr-gen", "decode fla",
                                                                  "decode dplr-gen"))
    assert "tokens match: -" in proc.stdout.splitlines()[-1]


def test_bad_arguments_are_refused_naming_them() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "fla_model_check.py"), "--hidden", "100"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--hidden (100) must be a multiple of --head-dim (64)" in proc.stderr
