"""The CPU-pure parts of benchmarks/bench.py, benchmarks/common.py and scripts/gpu_check.py (no GPU, no fla)."""

from __future__ import annotations

import argparse

import importlib.util
import json
import math
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks import bench
from benchmarks import common as C
from dplr_gen.reference import naive_dplr_delta_rule
from dplr_gen.spec.models import Spec

REPO = Path(__file__).resolve().parent.parent


def _load_script(name: str):
    """scripts/<name>.py as a module (registered under its name: dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load_script("gpu_check")


def test_floor_matches_the_measured_peer_numbers() -> None:
    # (4,4096,32,64) bf16 moves about 470 MB forward (0.16 ms), 1.3 GB fwd+bwd (0.45 ms) at the H100's 3.0 TB/s
    b = C.bytes_moved(4, 4096, 32, 64, 64, N=4)
    tensor = 4 * 4096 * 32 * 64 * 2
    state = 4 * 32 * 64 * 64 * 4
    assert b["fwd"] == 7 * tensor + 2 * state
    assert b["fwd_bwd"] == 20 * tensor + 5 * state
    assert C.floor_ms(b["fwd"]) == pytest.approx(0.158, abs=2e-3)
    assert C.floor_ms(b["fwd_bwd"]) == pytest.approx(0.451, abs=2e-3)
    # V enters only through v, o, do, dv; the states scale with N
    b2 = C.bytes_moved(1, 10, 1, 4, 8, N=3, elt=4)
    assert b2["fwd"] == 10 * (5 * 4 + 8) * 4 + 10 * 8 * 4 + 2 * 3 * 4 * 8 * 4


def test_mixed_lengths_and_varlen_preset() -> None:
    lens = C.mixed_lengths(16, 32768, seed=0)
    assert len(lens) == 16 and sum(lens) == 32768 and min(lens) >= 1
    assert lens == C.mixed_lengths(16, 32768, seed=0) != C.mixed_lengths(16, 32768, seed=1)
    assert not all(n % 64 == 0 for n in lens)  # partial chunks are exercised
    assert max(lens) > 2 * min(lens)
    v = bench.PRESETS["varlen"]
    assert (v.B, v.T, v.H, v.D, v.N) == (1, 32768, 32, 64, 16) and sum(v.lengths) == v.T
    assert v.cu_seqlens[0] == 0 and v.cu_seqlens[-1] == 32768 and len(v.cu_seqlens) == 17
    with pytest.raises(ValueError):
        C.mixed_lengths(4, 3, min_len=1)


def test_parse_shape() -> None:
    assert C.parse_shape("4x4096x32x64", bench.PRESETS) == C.Shape(4, 4096, 32, 64)
    assert C.parse_shape("varlen", bench.PRESETS).lengths is not None
    assert bench.parse_shape_any("varlen16x32768x32x64") == bench.VARLEN
    assert bench.parse_shape_any(bench.DRY_SHAPES[1].label) == bench.DRY_SHAPES[1]
    for bad in ("4x4096x32", "4x0x1x1", "big"):
        with pytest.raises(ValueError):
            C.parse_shape(bad, bench.PRESETS)
    labels = [s.label for s in bench.SHAPES.values()]
    assert labels[:4] == ["4x4096x32x64", "8x4096x64x64", "8x2048x16x128", "1x4096x2x128"]
    # the varlen call forms: int64 and int32 cu_seqlens reused, and a new int64 tensor each call; ragged too
    assert {s.label for s in bench.CALL_FORMS} <= set(labels)
    assert {(s.cu_dtype, s.fresh_cu, s.reordered_cu) for s in bench.CALL_FORMS} == {
        ("int64", False, False), ("int32", False, False), ("int64", True, False), ("int64", True, True)}
    # the reordered form: more orders than the runtime keeps boundaries of, each its own, the same lengths
    for s in (f for f in bench.CALL_FORMS if f.reordered_cu):
        orders = s.cu_orders()
        assert len(orders) == C.CU_ORDERS > 32 and len({tuple(o) for o in orders}) == len(orders)
        assert all(sorted(b - a for a, b in zip(o, o[1:])) == sorted(s.lengths) for o in orders)
        assert s.label.endswith("-int64-reordered") and s.cu_orders() == orders
    assert any(any(n % 16 for n in s.lengths) for s in bench.CALL_FORMS)
    assert all(sum(s.lengths) == s.T for s in bench.CALL_FORMS)
    # the varlen case beside its dense twins stays available by name
    assert "1x32768x32x64" in bench.PRESETS and bench.VARLEN.label in bench.PRESETS


def test_rwkv7_case_is_deterministic_and_rwkv7_like() -> None:
    x = C.rwkv7_case(2, 8, 3, 16, dtype=torch.float32, device="cpu", seed=5)
    y = C.rwkv7_case(2, 8, 3, 16, dtype=torch.float32, device="cpu", seed=5)
    z = C.rwkv7_case(2, 8, 3, 16, dtype=torch.float32, device="cpu", seed=6)
    assert set(x) == set(C.INPUTS)
    assert all(torch.equal(x[n], y[n]) for n in x) and not torch.equal(x["r"], z["r"])
    assert C.checksums(x) == C.checksums(y) != C.checksums(z)
    assert (x["w"] < 0).all() and (x["w"] > C.RWKV7_W_MIN).all() and (x["w"] >= C.GATE_BOUND).all()
    assert torch.allclose(x["a"].norm(dim=-1), torch.ones(2, 8, 3))
    iclr = x["b"] / (-x["a"])
    assert (iclr > 0).all() and (iclr < 1).all()
    assert x["h0"].shape == (2, 3, 16, 16) and x["h0"].dtype == torch.float32
    assert x["k"].std() < 0.5  # k scaled by K**-0.5
    bf = C.rwkv7_case(1, 4, 1, 8, 12, dtype=torch.bfloat16, device="cpu", seed=1, n_states=3, h0="zeros")
    assert bf["r"].dtype == bf["w"].dtype == torch.bfloat16 and bf["v"].shape == (1, 4, 1, 12)
    assert bf["h0"].shape == (3, 1, 8, 12) and not bf["h0"].any()
    assert (bf["w"].float() >= C.GATE_BOUND).all()  # still inside the promise after rounding to bf16
    raw = C.rwkv7_case(1, 64, 2, 16, dtype=torch.float32, device="cpu", seed=1, raw=True, h0="none")
    assert raw["h0"] is None and raw["a"].norm(dim=-1).mean() > 2 and raw["k"].std() > 0.5
    with pytest.raises(ValueError):
        C.rwkv7_case(1, 1, 1, 4, dtype=torch.float32, device="cpu", seed=0, h0="ones")


def test_grad_outputs_and_cu_tensors() -> None:
    x = C.rwkv7_case(1, 6, 2, 4, dtype=torch.float16, device="cpu", seed=0, n_states=2)
    do, dht = C.grad_outputs(x, 0)
    assert do.shape == x["v"].shape and do.dtype == torch.float16
    assert dht.shape == (2, 2, 4, 4) and dht.dtype == torch.float32
    assert torch.equal(do, C.grad_outputs(x, 0)[0])
    cu, cpu = C.cu_tensors((2, 4), "int32", "cpu")
    assert cu.tolist() == [0, 2, 6] and cpu.dtype == torch.int32
    assert C.cu_tensors((2, 4), "int64", "cpu")[0].dtype == torch.int64
    assert C.cu_tensors(None, "int32", "cpu") == (None, None)
    # where a shape names no call form, every system gets int64 (fla-core's type hint)
    assert {s.cu_dtype for s in C.SYSTEMS.values()} == {"int64"}


def _naive_op(x, cu=None, cu_cpu=None):
    """A 'system' computed by the reference itself: fwd_bwd through it must equal reference()."""
    return naive_dplr_delta_rule(x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], 1.0, x["h0"], True, cu)


def test_reference_folds_batch_into_heads_exactly() -> None:
    x = C.rwkv7_case(3, 5, 2, 4, 6, dtype=torch.float64, device="cpu", seed=3)
    do, dht = C.grad_outputs(x, 3)
    dht = dht.double()  # the float64 stand-in system returns a float64 state
    ref = C.reference(x, do, dht)
    direct = C.fwd_bwd(_naive_op, C.leaves(x), do, dht)
    assert set(ref) == set(direct) == set(C.QUANTITIES)
    for n in C.QUANTITIES:
        assert ref[n].dtype == torch.float64 and ref[n].shape == direct[n].shape
        tol = 1e-6 if direct[n].dtype == torch.float32 else 1e-12  # h0 (hence dh0) is fp32
        assert torch.allclose(ref[n], direct[n].double(), rtol=tol, atol=tol), n
    assert all(e < 1e-7 for e in C.errors(direct, ref).values())
    fwd_only = C.reference(x, None, None, grads=False)
    assert set(fwd_only) == {"o", "ht"} and torch.allclose(fwd_only["o"], ref["o"])


def test_reference_varlen() -> None:
    x = C.rwkv7_case(1, 7, 2, 4, dtype=torch.float64, device="cpu", seed=4, n_states=2)
    do, dht = C.grad_outputs(x, 4)
    dht = dht.double()
    ref = C.reference(x, do, dht, lengths=(3, 4))
    cu = torch.tensor([0, 3, 7])
    direct = C.fwd_bwd(_naive_op, C.leaves(x), do, dht, cu)
    assert all(torch.allclose(ref[n], direct[n].double(), rtol=1e-6, atol=1e-6) for n in C.QUANTITIES)


def test_one_step_reference_equals_the_recurrence() -> None:
    x = C.rwkv7_case(3, 1, 2, 4, 5, dtype=torch.float64, device="cpu", seed=9)
    o, S = C.one_step_reference(x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], x["h0"], 0.5)
    ro, rS = naive_dplr_delta_rule(x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], 0.5, x["h0"], True)
    assert torch.allclose(o, ro) and torch.allclose(S, rS)


def test_errors_finite_and_cache(tmp_path: Path) -> None:
    ref = {"o": torch.ones(4), "ht": torch.ones(2)}
    got = {"o": torch.ones(4) * 1.01, "ht": torch.tensor([1.0, float("inf")])}
    e = C.errors(got, ref)
    assert e["o"] == pytest.approx(0.01) and e["ht"] == float("inf")
    assert C.all_finite(got) == {"o": True, "ht": False}
    from dplr_gen.testing import rel_err

    a, b = torch.randn(50, dtype=torch.bfloat16), torch.randn(50, dtype=torch.float64)
    assert C.rel_err(a, b) == pytest.approx(rel_err(a, b), rel=1e-12)
    assert C.rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
    calls = []

    def make() -> dict[str, torch.Tensor]:
        calls.append(1)
        return {"o": torch.arange(3.0)}

    a = C.cached(str(tmp_path), "ref:x/y", make, "cpu")
    b = C.cached(str(tmp_path), "ref:x/y", make, "cpu")
    assert len(calls) == 1 and torch.equal(a["o"], b["o"])
    assert C.cached(None, "k", make, "cpu") and len(calls) == 2


def test_json_and_table(tmp_path: Path) -> None:
    obj = {"a": float("inf"), "b": [float("nan"), 1.5, (2, -float("inf"))], "c": Path("/x"), 3: None}
    p = tmp_path / "r.json"
    C.write_json(p, obj)
    assert json.loads(p.read_text()) == {"a": "inf", "b": ["nan", 1.5, [2, "-inf"]], "c": "/x", "3": None}
    rep = C.Report(tmp_path / "rep.json", {"x": 1})
    rep.save()
    assert json.loads(rep.path.read_text()) == {"x": 1}
    t = C.format_table(["name", "ms"], [["dplr", 1.23456], ["fla-best", None], ["x", True]], title="T")
    lines = t.splitlines()
    assert lines[0] == "T" and lines[1].split() == ["name", "ms"] and "1.23" in lines[3] and "-" in lines[4]
    assert len({len(line) for line in lines[1:]}) == 1  # aligned
    assert C.fmt(0.000123) == "0.000123" and C.fmt(None) == "-" and C.fmt(False) == "no"


def test_fla_kwargs_and_unavailable_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    full = ["r", "w", "chunk_size", "lower_bound", "safe_gate", "cu_seqlens_cpu"]
    used, notes = C.fla_kwargs({"chunk_size": 64, "lower_bound": -0.61}, full)
    assert used == {"chunk_size": 64, "lower_bound": -0.61} and notes == []
    used, notes = C.fla_kwargs({"chunk_size": 64, "lower_bound": -0.61}, ["chunk_size", "safe_gate"])
    assert used == {"chunk_size": 64, "safe_gate": True} and len(notes) == 2
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla -> ImportError, whatever is installed
    with pytest.raises(ImportError, match="fla not available"):
        C.load_op(C.SYSTEMS["fla-best"], "unused")
    assert set(C.SYSTEMS) == {"dplr-fast", "dplr-keep", "dplr-generic", "fla-best", "fla-default", "wind-cuda"}
    monkeypatch.delenv(C.WIND_DIR_ENV, raising=False)
    with pytest.raises(ImportError, match="the CUDA peer is not here"):
        C.load_op(C.SYSTEMS["wind-cuda"], "unused", 64)
    assert dict(C.SYSTEMS["dplr-keep"].kwargs) == {"lower_bound": -0.61, "disable_recompute": True}
    assert dict(C.SYSTEMS["fla-best"].kwargs) == {"chunk_size": 64, "lower_bound": -0.61}
    assert dict(C.SYSTEMS["dplr-fast"].kwargs) == {"lower_bound": -0.61} and not C.SYSTEMS["dplr-generic"].kwargs


def test_worker_env() -> None:
    env = C.worker_env("cpu", {"X": "1"})
    assert env["DPLR_GEN_NO_JIT"] == "1" and env["TRITON_INTERPRET"] == "1" and env["X"] == "1"
    assert str(C.REPO) in env["PYTHONPATH"].split(":")
    assert "DPLR_GEN_NO_JIT" not in C.worker_env("cuda", allow_jit=True) or C.worker_env("cuda", allow_jit=True)[
        "DPLR_GEN_NO_JIT"] == __import__("os").environ.get("DPLR_GEN_NO_JIT")


FAKE_WORKER = """
import sys, time, json
jobs = sys.argv[sys.argv.index("--jobs") + 1].split(",")
for j in jobs:
    if j == "crash":
        print("dying", file=sys.stderr, flush=True)
        sys.exit(3)
    if j == "hang":
        time.sleep(60)
    if j == "lost":  # answers, then finds its device unusable
        print("RESULT " + json.dumps({"job": j, "error": "illegal address"}), flush=True)
        sys.exit(75)
    print("progress " + j, flush=True)
    print("RESULT " + json.dumps({"job": j, "value": len(j)}), flush=True)
"""


def test_run_jobs_restarts_after_a_crash_and_stops_at_the_deadline(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(FAKE_WORKER))
    logged: list[str] = []
    r = C.run_jobs([sys.executable, str(script)], ["a", "crash", "bb"], time.time() + 30, log=logged.append)
    assert r["a"]["value"] == 1 and r["bb"]["value"] == 2
    assert "exited with code 3" in r["crash"]["error"] and "dying" in r["crash"]["stderr_tail"]
    assert any("progress a" in line for line in logged)
    r = C.run_jobs([sys.executable, str(script)], ["a", "lost", "bb"], time.time() + 30, log=logged.append)
    assert r["lost"]["error"] == "illegal address" and r["bb"]["value"] == 2  # a fresh worker ran bb
    t0 = time.time()
    r = C.run_jobs([sys.executable, str(script)], ["a", "hang", "c"], time.time() + 2.0, log=logged.append,
                   min_left=0.5)
    assert time.time() - t0 < 10
    assert r["a"]["value"] == 1 and "timed out" in r["hang"]["error"] and r["c"]["error"].startswith("not run")
    assert C.load_resume(None) == {}
    p = tmp_path / "prev.json"
    C.write_json(p, {"results": r})
    assert set(C.load_resume(str(p))) == {"a"} and C.load_resume(str(p))["a"]["resumed_from"] == str(p)
    # an earlier run on another GPU, release or dplr-gen source resumes nothing; the same machine all it has
    then = {"gpu": "NVIDIA H200", "driver": "580", "torch": "2.11", "triton": "3.6.0", "fla_core": "0.6.0",
            "dplr_gen_source_sha": "abc"}
    C.write_json(p, {"machine": then, "results": r})
    assert set(C.load_resume(str(p), machine=then)) == {"a"}
    for k in C.RESUME_MATCH[:-1]:
        assert C.load_resume(str(p), machine={**then, k: "other"}) == {}, k
    # another dplr-gen source: the peers' jobs stand, dplr-gen's run again
    C.write_json(p, {"machine": then, "results": {"speed:dplr-fast:4x4096x32x64": {"fwd_ms": 1.0},
                                                  "speed:fla-best:4x4096x32x64": {"fwd_ms": 2.0},
                                                  "decode:dplr-fused:1": {}, "decode:fla-mul:1": {}}})
    assert set(C.load_resume(str(p), machine={**then, "dplr_gen_source_sha": "def"})) == {
        "speed:fla-best:4x4096x32x64", "decode:fla-mul:1"}


def test_bench_summary_ratios_floors_and_tables() -> None:
    shapes = [C.Shape(4, 4096, 32, 64), bench.VARLEN, bench.DENSE_EQUIV, bench.DENSE_BATCH]
    systems = ["dplr-fast", "fla-best", "fla-default"]
    res = {
        "speed:dplr-fast:4x4096x32x64": {"fwd_ms": 1.0, "fwd_bwd_ms": 3.0, "peak_bytes": 2e9, "first_fwd_bwd_s": 0.5},
        "speed:fla-best:4x4096x32x64": {"fwd_ms": 2.0, "fwd_bwd_ms": 6.0, "peak_bytes": 4e9},
        "speed:fla-default:4x4096x32x64": {"error": "boom"},
        f"speed:dplr-fast:{bench.VARLEN.label}": {"fwd_ms": 1.0, "fwd_bwd_ms": 2.0},
        "speed:dplr-fast:1x32768x32x64": {"fwd_ms": 0.5, "fwd_bwd_ms": 2.5},
        "speed:dplr-fast:16x2048x32x64": {"fwd_ms": 1.0, "fwd_bwd_ms": 1.6},
        "acc:dplr-fast": {"errors": {"o": 1e-3}},
        "cold:dplr-fast:4x4096x32x64": {"wall_s": 3.0, "first_fwd_bwd_s": 0.4},
    }
    speed, cold, acc = bench.summarise(res, shapes, systems)
    assert len(speed) == 12
    row = {(r["shape"], r["system"]): r for r in speed}
    d = row[("4x4096x32x64", "dplr-fast")]
    assert d["vs_fla_best_fwd"] == 0.5 and d["vs_fla_best_fwd_bwd"] == 0.5
    assert d["x_floor_fwd_bwd"] == pytest.approx(3.0 / d["floor_fwd_bwd_ms"])
    assert d["floor_fwd_ms"] == pytest.approx(0.158, abs=2e-3)
    assert row[("4x4096x32x64", "fla-default")]["error"] == "boom"
    assert row[(bench.VARLEN.label, "dplr-fast")]["vs_fla_best_fwd"] is None  # no baseline: no ratio
    assert row[(bench.VARLEN.label, "fla-best")]["error"] == "not run"
    assert row[(bench.VARLEN.label, "dplr-fast")]["vs_dense_equiv_fwd"] == 2.0
    assert row[(bench.VARLEN.label, "dplr-fast")]["vs_dense_equiv_fwd_bwd"] == 0.8
    assert row[("4x4096x32x64", "dplr-fast")]["vs_dense_equiv_fwd"] is None
    assert row[(bench.VARLEN.label, "dplr-fast")]["vs_dense_batch_fwd"] == 1.0
    assert row[(bench.VARLEN.label, "dplr-fast")]["vs_dense_batch_fwd_bwd"] == 1.25
    assert cold == [{"system": "dplr-fast", "shape": "4x4096x32x64", "wall_s": 3.0, "load_s": None,
                     "inputs_s": None, "first_fwd_s": None, "first_bwd_s": None, "first_fwd_bwd_s": 0.4,
                     "sympy_imported": None, "finite": None, "error": None}]
    assert acc["dplr-fast"]["errors"]["o"] == 1e-3 and acc["fla-best"]["error"] == "not run"
    text = bench.tables(speed, cold, acc)
    assert "boom" in text and "cold start" in text and "0.5" in text and "dense sequence, fwd+bwd: dplr-fast 0.80" in text
    assert "16 dense sequences, fwd+bwd: dplr-fast 1.25" in text
    assert bench.input_group("speed:fla-best:4x4096x32x64") == "speed:4x4096x32x64"
    assert bench.input_group("acc:fla-best") == "acc" and bench.input_group("cold:x:y") is None
    same = C.same_inputs({"speed:a:s": {"checksums": {"r": 1.0}}, "speed:b:s": {"checksums": {"r": 1.0}},
                          "acc:a": {"checksums": {"r": 1.0}}, "acc:b": {"checksums": {"r": 2.0}}}, bench.input_group)
    assert same == {"speed:s": True, "acc": False}


def test_gpu_check_judgement() -> None:
    g = gpu_check
    assert g.judge(4e-3, 5e-3) == ("PASS", "")
    assert g.judge(6e-3, 5e-3)[0] == "FAIL" and "bound" in g.judge(6e-3, 5e-3)[1]
    assert g.judge(3e-3, 5e-3, fla=2.7e-3) == ("PASS", "")  # 3e-3 <= 1.1 * 2.7e-3 + 1e-4 = 3.07e-3
    assert g.judge(3e-3, 5e-3, fla=2.5e-3)[0] == "FAIL"  # 3e-3 > 2.85e-3: worse than fla
    assert g.judge(float("inf"), 5e-3)[0] == "FAIL" and g.judge(None, 5e-3)[0] == "FAIL"
    assert g.bounds_for("bfloat16", "o") == 5e-3 and g.bounds_for("bfloat16", "da") == 8e-3
    assert g.bounds_for("float32", "dh0") == 1e-5 and g.bounds_for("float16", "ht") == 3e-3
    assert g.CASES["report"].lengths == (4096,) and g.CASES["report"].h0 == "zeros"
    assert (g.CASES["D128"].B, g.CASES["D128"].T, g.CASES["D128"].H, g.CASES["D128"].D) == (2, 4096, 4, 128)
    jobs = [j for grp in g.job_groups() for j in grp]
    assert len(jobs) == len(set(jobs)) and "scale-big" in jobs and g.job_groups()[-1][0].endswith(":fla-best")
    assert g.job_groups(["scale"]) == [["scale-decode"], ["scale-big"]]
    assert g.input_group("table:D64:fla-best") == "table:D64" and g.input_group("compile") is None


def test_gpu_check_rows() -> None:
    g = gpu_check
    good = {q: 1e-3 for q in C.QUANTITIES}
    res = {
        "table:D64:dplr-fast": {"errors": good},
        "table:D64:dplr-generic": {"errors": {**good, "da": 9e-3}},  # over the gradient bound
        "table:D64:fla-best": {"errors": {q: 5e-4 for q in C.QUANTITIES}},  # dplr-fast is worse than fla here
        "table:D128:dplr-fast": {"errors": good},
        "table:D128:fla-best": {"error": "ImportError: fla not available"},
        "report-raw:report:dplr-fast": {"ran": True, "finite": {q: False for q in C.QUANTITIES}},
        "scale-big": {"over_2_31": True, "chunk_fast": {"errors": {"o": 1e-3, "ht": 1e-3}},
                      "fused_recurrent": {"error": "RuntimeError: illegal memory access"}},
        "scale-decode": {"errors": {"o": 1e-3, "ht": 1e-3}},
        "compile": {"errors": {q: 0.0 for q in C.QUANTITIES}},
        # compared nothing: the per-sequence launches did not run
        "per-sequence": {"launched": 0, "errors": {q: 0.0 for q in C.QUANTITIES},
                         "error": "the per-sequence token pass did not run"},
    }
    rows = {(r["check"], r["system"]): r for r in g.judge_all(res, g.CASES)}
    assert rows[("per-sequence", "dplr-fast")]["status"] == "FAIL"
    assert rows[("other-device", "dplr-fast")]["status"] == "FAIL"  # not run
    one_gpu = dict(res, **{"other-device": {"n/a": "needs 2 GPUs, this machine has 1"}})
    row = {(r["check"], r["system"]): r for r in g.judge_all(one_gpu, g.CASES)}[("other-device", "dplr-fast")]
    assert row["status"] == "n/a" and "needs 2 GPUs" in row["error"]
    ran = dict(res, **{"per-sequence": {"launched": 1, "errors": {q: 0.0 for q in C.QUANTITIES}}})
    assert {(r["check"], r["system"]): r for r in g.judge_all(ran, g.CASES)}[("per-sequence", "dplr-fast")]["status"] == "PASS"
    one_bit = dict(res, **{"per-sequence": {"launched": 1, "errors": {**{q: 0.0 for q in C.QUANTITIES}, "dk": 1e-7}}})
    assert {(r["check"], r["system"]): r for r in g.judge_all(one_bit, g.CASES)}[("per-sequence", "dplr-fast")]["status"] == "FAIL"
    assert rows[("table:D64", "dplr-fast")]["status"] == "FAIL"  # 1e-3 > 1.1 * 5e-4 + 1e-4
    assert "worse than fla" in rows[("table:D64", "dplr-fast")]["cells"]["o"][2]
    assert rows[("table:D64", "dplr-generic")]["cells"]["da"][1] == "FAIL"
    assert rows[("table:D64", "fla-best")]["status"] == "info"
    assert rows[("table:D128", "dplr-fast")]["status"] == "PASS"
    assert "fla n/a" in rows[("table:D128", "dplr-fast")]["cells"]["o"][2]
    assert rows[("table:D128", "fla-best")]["status"] == "n/a"
    assert rows[("table:D128", "dplr-generic")]["status"] == "FAIL"  # not run
    assert rows[("report-raw:report", "dplr-fast")]["status"] == "PASS"  # ran; non-finite is recorded only
    assert rows[("report-raw:report", "dplr-generic")]["status"] == "FAIL"
    assert rows[("scale-big:chunk_fast", "dplr-fast")]["status"] == "PASS"
    assert rows[("scale-big:fused_recurrent", "fused_recurrent")]["status"] == "FAIL"
    assert rows[("scale-decode", "fused_recurrent")]["status"] == "PASS"
    assert rows[("compile", "dplr-fast")]["status"] == "PASS"
    text = g.render(list(rows.values()))
    assert "FAIL table:D64 dplr-fast" in text and "illegal memory access" in text and "yardstick" in text
    small = dict(res, **{"scale-big": {"over_2_31": False, "chunk_fast": {"errors": {"o": 0.0, "ht": 0.0}}}})
    rows = {(r["check"], r["system"]): r for r in g.judge_all(small, g.CASES)}
    assert rows[("scale-big:chunk_fast", "dplr-fast")]["status"] == "FAIL"
    rows = {(r["check"], r["system"]): r for r in g.judge_all(small, g.CASES, dry=True)}
    assert rows[("scale-big:chunk_fast", "dplr-fast")]["status"] == "PASS"
    assert math.isclose(g.FLA_FACTOR, 1.1) and g.FLA_SLACK == 1e-4


def test_gpu_check_wide_case_builds_its_package_first() -> None:
    g = gpu_check
    c = g.CASES["D256"]
    assert (c.B, c.T, c.H, c.D, c.dtype) == (1, 4096, 2, 256, "bfloat16") and g.DRY_CASES["D256"].D == 256
    assert ["build:D256", "table:D256:dplr-fast", "table:D256:dplr-generic"] in g.job_groups()
    assert g.job_groups()[-1][0].endswith(":fla-best")
    # the accuracy jobs of a wide case take its build job along, whatever --only names
    assert g.job_groups(["table:D256:dplr-fast"]) == [["build:D256", "table:D256:dplr-fast"]]
    assert ["build:D256", "table:D256:dplr-fast", "table:D256:dplr-generic"] in g.job_groups(["table"])
    assert g.job_groups(["build"]) == [["build:D256"]]
    assert g.wide_package_dir("D256").name == "check_d256"
    spec = g.WIDE_SPEC.format(name="check_d256", case="D256", D=256, dtype="bf16", target="sm_90", bound=-0.61)
    parsed = Spec.model_validate(yaml.safe_load(spec))
    assert parsed.targets == ["sm_90"] and parsed.variants[0].head_dims == [256]
    assert parsed.variants[0].gate_bounds == [-0.61, None]
    good = {q: 1e-3 for q in C.QUANTITIES}
    res = {"build:D256": {"error": "chunk_...__sm_90: kernel chunk_dplr_bwd_kernel: uses 1 B"},
           "table:D256:dplr-fast": {"errors": good}}
    rows = {(r["check"], r["system"]): r for r in g.judge_all(res, g.CASES)}
    assert rows[("build:D256", "dplr-gen")]["status"] == "FAIL"
    assert rows[("table:D256", "dplr-fast")]["status"] == "PASS"  # the bounds only: no fla yardstick there
    assert "fla" not in rows[("table:D256", "dplr-fast")]["cells"]["o"][2]
    assert rows[("table:D256", "dplr-generic")]["status"] == "FAIL"  # not run
    assert "FAIL build:D256 dplr-gen" in g.render(list(rows.values()))


def test_dplr_variant_is_the_ops_choice() -> None:
    """The bench records which variant dplr-gen ran: for RWKV-7 inputs with w in bf16, the one reading gk in bf16."""
    x = {n: torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16) for n in ("r", "w", "k", "v", "a", "b")}
    pkg = REPO / "generated" / "hopper"
    name = C.dplr_variant(C.SYSTEMS["dplr-fast"], pkg, x)
    assert name == "chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32"
    x["w"] = x["w"].float()
    assert C.dplr_variant(C.SYSTEMS["dplr-fast"], pkg, x, cu=torch.tensor([0, 16])).endswith("varlen_gbm0p61_gfp32_sfp32")


def test_load_cpu_names_an_unbuilt_package(tmp_path: Path) -> None:
    import subprocess

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "load_cpu.py"), "--package", str(tmp_path),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--package" in proc.stderr and "no manifest.json" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("load_cpu_*.json"))


def test_fla_autotune_seed_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's JSON says whether fla's autotune choices were restored, and which archive (by hash)."""
    monkeypatch.delenv(C.FLA_AUTOTUNE_ENV, raising=False)
    assert C.fla_autotune_seed() is None
    archive = tmp_path / "fla.tgz"
    archive.write_bytes(b"abc")
    monkeypatch.setenv(C.FLA_AUTOTUNE_ENV, str(archive))
    assert C.fla_autotune_seed() == {
        "path": str(archive), "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"}
    # a path that does not resolve from here: the error names the variable, the path and the remedy
    monkeypatch.setenv(C.FLA_AUTOTUNE_ENV, "no/such/fla.tgz")
    with pytest.raises(FileNotFoundError, match=f"{C.FLA_AUTOTUNE_ENV}='no/such/fla.tgz'.*absolute path"):
        C.fla_autotune_seed()


def test_shipped_fla_autotune_archive_holds_only_autotune_results() -> None:
    """scripts/run_gpu.sh unpacks it into Triton's cache: autotune JSON files in hash folders, nothing else."""
    import tarfile

    with tarfile.open(REPO / "benchmarks" / "fla_autotune" / "h100_sm90_triton3.6.0_fla0.6.0.tgz") as tar:
        members = tar.getmembers()
        assert members
        for m in members:
            parts = m.name.split("/")
            assert m.isfile() and len(parts) == 3 and parts[0] == "." and parts[2].endswith(".autotune.json"), m.name
            assert "configs_timings" in json.loads(tar.extractfile(m).read())


def test_step_closures_time_the_op_and_every_input_gradient() -> None:
    """benchmarks.common.step_closures (bench.py's speed rows): the forward is the
    op on the leaves; the forward+backward returns the gradients of <o, do> + <ht, dht> w.r.t. every input leaf
    present, in INPUTS order, and accumulates nothing into .grad."""
    import torch

    x = {n: torch.randn(2, 3) for n in C.INPUTS}
    x["h0"] = None
    xl = C.leaves(x)

    def op(t, cu=None, cu_cpu=None):
        assert cu is None and cu_cpu is None
        o = t["r"] * t["w"] + t["k"] * t["v"] + t["a"]
        return o, o.sum(0) * t["b"].sum(0)

    do, dht = torch.randn(2, 3), torch.randn(3)
    fwd, fwd_bwd = C.step_closures(op, xl, do, dht)
    assert torch.equal(fwd()[0], op(xl)[0])
    grads = fwd_bwd()
    names = [n for n in C.INPUTS if xl[n] is not None]
    assert len(grads) == len(names) == 6
    want = torch.autograd.grad(op(xl), [xl[n] for n in names], (do, dht))
    assert all(torch.allclose(g, w) for g, w in zip(grads, want))
    assert all(xl[n].grad is None for n in names)


def test_source_digest_names_the_tree_not_git(tmp_path, monkeypatch) -> None:
    for rel in ("dplr_gen/a.py", "dplr_gen/render/templates/t.jinja", "specs/s.yaml", "generated/s/index.json", "README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    monkeypatch.setattr(C, "REPO", tmp_path)
    first = C.source_digest()
    assert len(first) == 16 and first == C.source_digest()
    (tmp_path / "README.md").write_text("docs only")
    assert C.source_digest() == first  # docs do not change what ran
    (tmp_path / "dplr_gen/render/templates/t.jinja").write_text("changed")
    assert C.source_digest() != first


def test_accuracy_matrix_dry_run(tmp_path: Path) -> None:
    """scripts/accuracy_matrix.py end to end on CPU (interpreter, fp16 stand-ins of its rows, no fla): every
    row is judged and passes, the JSON records each row's errors."""
    import subprocess

    out = tmp_path / "acc.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "accuracy_matrix.py"), "--dry-run", "--out",
                           str(out), "--only", "main"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["summary"]["rows"] >= 4 and d["summary"]["pass"] == d["summary"]["rows"], d["summary"]
    assert all(set(r["dplr"]) >= {"o", "ht", "da", "db", "dgk"} for r in d["rows"])
    # one family only, and an unknown one refused naming the valid ones
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "accuracy_matrix.py"), "--dry-run", "--out",
                           str(out), "--only", "main", "--families", "any"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["rows"] and {r["row"]["family"] for r in d["rows"]} == {"any"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "accuracy_matrix.py"), "--dry-run", "--out",
                           str(out), "--families", "bounded,capped"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 2 and "bounded, any" in proc.stderr, proc.stderr[-2000:]


def test_kernel_profile_dry_run(tmp_path: Path) -> None:
    """scripts/kernel_profile.py end to end on CPU (interpreter, no profiler): both gate modes of the case asked
    for by default, the one --bounds names otherwise, host times recorded (and the functions with the most host
    time where asked), the JSON named by the package (and the gate data where not RWKV-7's); an unknown case, a bad --bounds, or steep gates with a lower_bound refused
    with what is valid."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path)}
    script = str(REPO / "scripts" / "kernel_profile.py")
    proc = subprocess.run([sys.executable, script, "--dry-run", "--cases", "dense4x4096"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads((tmp_path / "kernel_profile_hopper.json").read_text())
    assert list(d["cases"]) == ["dense4x4096, lower_bound=-0.61", "dense4x4096, lower_bound=None"]
    assert all(r["wall_ms"] >= r["enqueue_ms"] > 0 for r in d["cases"].values())
    assert all("host_functions" not in r for r in d["cases"].values())
    one = subprocess.run([sys.executable, script, "--dry-run", "--cases", "dense4x4096", "--bounds", "none",
                          "--host-functions", "3"], capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    d = json.loads((tmp_path / "kernel_profile_hopper.json").read_text())
    assert list(d["cases"]) == ["dense4x4096, lower_bound=None"]
    top = d["cases"]["dense4x4096, lower_bound=None"]["host_functions"]
    assert len(top) == 3 and [f["own_us"] for f in top] == sorted((f["own_us"] for f in top), reverse=True)
    assert all(f["total_us"] >= f["own_us"] > 0 and f["calls"] > 0 for f in top)
    steep = subprocess.run([sys.executable, script, "--dry-run", "--cases", "dense4x4096", "--bounds", "none",
                            "--gates", "steep"], capture_output=True, text=True, env=env, timeout=600)
    assert steep.returncode == 0, steep.stderr[-2000:]
    d = json.loads((tmp_path / "kernel_profile_hopper_steep_gates.json").read_text())
    assert d["gates"] == "steep" and list(d["cases"]) == ["dense4x4096, lower_bound=None"]
    promise = subprocess.run([sys.executable, script, "--dry-run", "--gates", "mixed"], capture_output=True,
                             text=True, env=env, timeout=120)
    assert promise.returncode == 2 and "--gates mixed" in promise.stderr and "--bounds none" in promise.stderr
    wrong = subprocess.run([sys.executable, script, "--dry-run", "--bounds", "low"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert wrong.returncode == 2 and "--bounds: 'low'" in wrong.stderr
    bad = subprocess.run([sys.executable, script, "--dry-run", "--cases", "nope"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode == 2 and "unknown ['nope']" in bad.stderr and "dense4x4096" in bad.stderr


def test_native_inputs_of_the_cuda_peer() -> None:
    """The CUDA kernel's own input form: its w is log(-w) (decay exp(-exp(w))), its states [V, K] in bf16; the
    other systems take the inputs as they are."""
    x = C.rwkv7_case(1, 4, 2, 8, dtype=torch.bfloat16, device="cpu", seed=1)
    do, dht = C.grad_outputs(x, 1)
    same = C.native_inputs(C.SYSTEMS["dplr-fast"], x, do, dht)
    assert same[0] is x and same[2] is dht
    y, do2, dht2 = C.native_inputs(C.SYSTEMS["wind-cuda"], x, do, dht)
    assert torch.allclose(-torch.exp(y["w"].float()), x["w"].float(), rtol=2e-2)
    assert torch.equal(y["h0"], x["h0"].transpose(-1, -2).to(torch.bfloat16))
    assert dht2.dtype == torch.bfloat16 and torch.equal(dht2, dht.transpose(-1, -2).to(torch.bfloat16))
    assert do2 is do and y["r"] is x["r"]


def test_step_closures_give_a_new_cu_seqlens_each_call_when_fresh() -> None:
    seen: list = []

    def op(xl, cu=None, cu_cpu=None):  # type: ignore[no-untyped-def]
        seen.append((cu, cu_cpu))
        return xl["v"] * 1.0, xl["h0"] * 1.0

    x = C.leaves(C.rwkv7_case(1, 6, 1, 4, dtype=torch.float32, device="cpu", seed=0, n_states=2))
    cu, cpu = C.cu_tensors((2, 4), "int64", "cpu")
    for fresh in (False, True):
        seen.clear()
        fwd, _ = C.step_closures(op, x, None, None, cu, cpu, fresh_cu=fresh)
        fwd(), fwd()
        (a, a_cpu), (b, _) = seen
        assert a_cpu is None  # users' call: cu_seqlens alone
        assert (a is cu and b is cu) != fresh and torch.equal(a, cu) and torch.equal(b, cu)
        if fresh:
            assert a is not b
    # new values each call: the next host tensor of the cycle, round and round, copied (never the host's own)
    cycle = [torch.tensor(c) for c in ([0, 1, 6], [0, 5, 6])]
    seen.clear()
    fwd, _ = C.step_closures(op, x, None, None, cu, cpu, fresh_cu=True, cu_cycle=cycle)
    fwd(), fwd(), fwd()
    assert [c.tolist() for c, _ in seen] == [[0, 1, 6], [0, 5, 6], [0, 1, 6]]
    assert all(c is not k for (c, _), k in zip(seen, cycle))


def test_job_groups_decode_first_and_the_cuda_peer_per_head_size() -> None:
    args = argparse.Namespace(no_accuracy=False, no_speed=False, no_decode=False)
    shapes = [C.Shape(4, 4096, 32, 64), C.Shape(8, 2048, 16, 128)]
    groups = bench.job_groups(["dplr-fast", "fla-best", "wind-cuda"], shapes, args, dry=False)
    names = list(groups)
    assert names[:2] == ["dplr decode", "fla decode"]
    assert groups["dplr decode"] == [f"decode:dplr-{f}:{B}" for B in bench.DECODE_BATCHES for f in ("fused", "mul", "pool")]
    assert groups["wind-cuda D=64"] == ["speed:wind-cuda:4x4096x32x64"]
    assert groups["wind-cuda D=128"] == ["speed:wind-cuda:8x2048x16x128"]
    assert "acc:wind-cuda" not in sum(groups.values(), []) and "acc:dplr-fast" in groups["dplr-fast"]


def test_decode_rows_compare_each_form_with_fla_at_its_batch() -> None:
    results = {
        "decode:dplr-fused:1": {"bench_ms": 0.05, "wall_ms": 0.10},
        "decode:dplr-pool:1": {"bench_ms": 0.04, "wall_ms": 0.08},
        "decode:fla-fused:1": {"bench_ms": 0.10, "wall_ms": 0.20},
        "decode:fla-mul:1": {"bench_ms": 0.08, "wall_ms": 0.16},
        "decode:dplr-mul:64": {"bench_ms": 0.2, "error": None},
    }
    rows = {(r["system"], r["B"]): r for r in bench.decode_rows(results)}
    assert rows[("dplr-fused", 1)]["wall_ms_vs_fla"] == pytest.approx(0.5)
    assert rows[("dplr-pool", 1)]["wall_ms_vs_fla"] == pytest.approx(0.5)  # the pool is the mul form's
    assert rows[("dplr-mul", 64)]["bench_ms_vs_fla"] is None  # no fla row at that batch


def test_hardware_profile_reads_ncu_raw_csv() -> None:
    """scripts/hardware_profile.py reads ncu's `--csv --page raw --print-units base` output: ncu's own lines
    skipped, the units row skipped, one record per kernel with each metric asked for by its short name, the DRAM
    rate from the bytes and the time, and nothing invented for a metric the output lacks."""
    spec = importlib.util.spec_from_file_location("hardware_profile", REPO / "scripts" / "hardware_profile.py")
    hp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hp)
    text = textwrap.dedent('''\
        ==PROF== Connected to process 123
        "ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum","launch__registers_per_thread"
        "","","nsecond","byte","byte","register/thread"
        "0","chunk_dplr_prep_kernel","290,100","500000000","140000000","255"
        "1","chunk_dplr_bwd_kernel","541,000","1000000000","466000000","168"
        ==PROF== Disconnected from process 123
        ''')
    got = hp.parse_raw_csv(text, hp.METRICS)
    assert [k["kernel"] for k in got] == ["chunk_dplr_prep_kernel", "chunk_dplr_bwd_kernel"]
    assert got[0]["time_ns"] == 290100.0 and got[0]["registers"] == 255.0
    assert got[0]["dram_gb_per_s"] == round(640e6 / 290100, 1)
    assert got[1]["dram_gb_per_s"] == round(1466e6 / 541000, 1)
    assert "tensor_mma_pct_active" not in got[0]
    assert hp.parse_raw_csv("==PROF== no kernels profiled\n", hp.METRICS) == []


def test_torch_floor_op_has_the_op_form() -> None:
    """benchmarks.common.floor_op (the host-bound row's torch floor) takes the op's inputs and gives o, the
    final state and a gradient of each input's shape, with do passed through to dv; max_diff compares outputs."""
    x = C.rwkv7_case(1, 16, 2, 8, dtype=torch.float32, device="cpu", seed=0)
    xl = C.leaves(x)
    do, dht = C.grad_outputs(x, 0)
    fwd, fwd_bwd = C.step_closures(C.floor_op(), xl, do, dht)
    o, ht = fwd()
    assert o.shape == x["v"].shape and ht.shape == x["h0"].shape
    grads = fwd_bwd()
    assert [g.shape for g in grads] == [xl[n].shape for n in C.INPUTS]
    assert torch.equal(grads[C.INPUTS.index("v")], do)
    assert C.max_diff([o], [o.clone()]) == 0.0 and C.max_diff([o], [o + 1]) == pytest.approx(1.0, rel=1e-5)
    assert C.max_diff([o], [ht]) == math.inf


def test_memory_peak_counts_without_running_what_a_run_allocates(tmp_path: Path) -> None:
    """scripts/memory_peak.py: with every launch skipped the driver allocates and frees exactly as in a run (fp16,
    where the interpreter runs the same variant, dense and varlen, both gate modes), the peak is the sum of the
    buffers it lists, each named by the driver function that allocated it, and the side-by-side order holds
    more; the dry run writes its JSON, both orders per case."""
    mp = _load_script("memory_peak")
    package = C.dry_run_package()
    for shape in bench.DRY_SHAPES:
        for bound in (-0.61, None):
            skipped = mp.count(package, shape, bound, dtype="float16")
            ran = mp.count(package, shape, bound, dtype="float16", launch=True)
            side = mp.count(package, shape, bound, "side_by_side", dtype="float16")
            assert side["peak_bytes"] > skipped["peak_bytes"]  # the reverse pass's operands beside h and U
            assert skipped["variant"] == ran["variant"] and "fp16" in skipped["variant"]
            assert (skipped["peak_bytes"], skipped["allocations"]) == (ran["peak_bytes"], ran["allocations"])
            assert skipped["at_peak"] == ran["at_peak"]
            assert skipped["peak_bytes"] == sum(b["bytes"] for b in skipped["at_peak"]) > 0
            assert all(b["allocated_by"].startswith("chunk_") for b in skipped["at_peak"]), skipped["at_peak"]
            # the backward's states: h and dh (fp32 every 16 tokens for fp16 variants) are both alive at the peak
            states = shape.N * shape.H * -(-max(shape.lengths or (shape.T,)) // 16) * shape.D * shape.D * 4
            assert skipped["peak_bytes"] >= 2 * states if shape.lengths is None else skipped["peak_bytes"] > states

    import subprocess

    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "memory_peak.py"), "--dry-run", "--bounds", "none"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads((tmp_path / "memory_peak_dry_run.json").read_text())
    assert list(d["cases"]) == [f"{s.label}, lower_bound=None, {o}" for s in bench.DRY_SHAPES
                                for o in ("one_stream", "side_by_side")]
    assert all("bf16" in r["variant"] and r["peak_x"] > 0 for r in d["cases"].values())
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "memory_peak.py"), "--bounds", "x"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode == 2 and "--bounds" in bad.stderr
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "memory_peak.py"), "--orders", "reverse"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode == 2 and "one_stream, side_by_side" in bad.stderr


def test_varlen_streams_summary_counts_slow_rounds() -> None:
    """benchmarks/varlen_streams.py's summary: per (case, form, system, choice) the median, spread and ratio to
    fla-core's median, and the rounds more than SLOW above the fastest choice of that (case, form, system)."""
    from benchmarks import varlen_streams as vs

    def row(system: str, choice: str, ms: float, form: str = "int64") -> dict:
        return {"case": "ragged8", "form": form, "system": system, "choice": choice, "fwd_bwd_ms": ms}

    rows = [row("dplr-fast", "rule", t) for t in (2.70, 3.09, 2.72)]
    rows += [row("dplr-fast", "overlap_only", t) for t in (2.81, 2.80, 2.82)]
    rows += [row("fla-best", "rule", t) for t in (6.5, 6.6, 6.55)]
    rows += [row("dplr-fast", "rule", 9.0, form="int64-fresh")]  # another form: its own fastest, no fla
    got = {(s["form"], s["system"], s["choice"]): s for s in vs.summarise(rows)}
    rule = got[("int64", "dplr-fast", "rule")]
    assert (rule["median_ms"], rule["min_ms"], rule["max_ms"], rule["rounds"]) == (2.72, 2.70, 3.09, 3)
    assert rule["slow"] == 1 and got[("int64", "dplr-fast", "overlap_only")]["slow"] == 0
    assert math.isclose(rule["vs_fla_best"], 2.72 / 6.55)
    assert got[("int64-fresh", "dplr-fast", "rule")]["vs_fla_best"] is None
    assert got[("int64-fresh", "dplr-fast", "rule")]["slow"] == 0


def test_varlen_streams_dry_run(tmp_path: Path) -> None:
    """benchmarks/varlen_streams.py end to end on CPU (interpreter, tiny shapes, no fla): every choice of the
    two stream options timed for the form and system asked for, the JSON written with its summary; an unknown
    case or system refused with what is valid."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path)}
    script = str(REPO / "benchmarks" / "varlen_streams.py")
    proc = subprocess.run([sys.executable, script, "--dry-run", "--cases", "ragged8", "--systems", "dplr-generic",
                           "--forms", "int64-fresh"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads((tmp_path / "varlen_streams.json").read_text())
    from benchmarks import varlen_streams as vs

    assert [r["choice"] for r in d["rows"]] == list(vs.CHOICES)
    assert all(r["system"] == "dplr-generic" and r["form"] == "int64-fresh" and r["fwd_bwd_ms"] > 0
               for r in d["rows"])
    assert len(d["summary"]) == len(vs.CHOICES) and d["fla_left_out"] == "CPU dry run"
    for bad, named in ((["--cases", "nope"], "ragged8, varlen11"), (["--systems", "fla"], "dplr-fast, dplr-generic")):
        wrong = subprocess.run([sys.executable, script, "--dry-run", *bad], capture_output=True, text=True, env=env,
                               timeout=120)
        assert wrong.returncode == 2 and named in wrong.stderr
