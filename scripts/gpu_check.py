"""Accuracy and robustness checks of dplr-gen on a GPU (the kernels issue's table), against float64 and fla-core.

    python scripts/gpu_check.py [--only table,prec,report,scale,compile] [--resume gpu_check.json] [--dry-run]

Checks (every one PASS/FAIL; the exit code is 0 whatever they say; FAIL lines are printed at the end):
  table   bf16, B=2, T=4096, H=4, K=V=64 and 128, RWKV-7 inputs (normalised a/b), random h0: relative norm error
          vs float64 of o, final state and every gradient, for dplr-fast (lower_bound=-0.61), dplr-generic and
          fla-best (chunk_size=64, lower_bound=-0.61) on the same tensors (checksums compared).
          PASS: <= 5e-3 (o, ht), <= 8e-3 (gradients), and no worse than fla: err <= 1.1 * fla_err + 1e-4.
          D256: bf16, B=1, T=4096, H=2, K=V=256, dplr-fast and dplr-generic only (the same bounds; no fla). The
          specs stop at 128, so the job build:D256 first builds a package of its own for this GPU (chunk 16,
          both gates) under $TMPDIR/dplr-gen-check-wide (a no-op when already built) and records compile times
          and shared memory; its failure is a FAIL row.
  prec    dplr-gen in fp32 (ieee dots) <= 1e-5 and fp16 <= 3e-3, everything, B=1, T=1024, H=2, D=64.
  gates   dplr-generic (any gate) on RWKV-7 inputs whose gates also hold steep decays (16 tokens of -5 in every
          256: those chunks take the exact form, the others the factored one), resets (gk = -inf in half the
          channels every 256 tokens) and -3 over 40 tokens in a third of the channels: bf16 at D=64 and 128,
          fp16 at D=64, B=2, T=2048, H=4; the bounds of the table (bf16) and of prec (fp16).
  varlen  dplr-fast and dplr-generic on 9 sequences of 1 to 1000 tokens (shorter than a chunk, on and just past
          a chunk boundary; 2049 tokens, H=4, random h0 each), bf16 at D=64 and 128, and at D=64 with w in fp32
          (the variants that read the gate in fp32): the table's bounds.
  report  the original failure report: B=1, T=4096, H=2, K=V=128, bf16, cu_seqlens=[0, T] (int32, cuda), zero
          initial state, keyword arguments, output_final_state=True. raw randn a/b (and r, k, v): must run to
          completion, fwd+bwd (finite or not is recorded, not judged); normalised a/b: the table's bounds.
  scale   big: chunk forward (fast path) and fused recurrent forward on q with > 2**31 elements (varlen, the last
          sequence wholly past element 2**31), its outputs vs float64 on that sequence alone; decode: fused
          recurrent, T=1, B=2048, H=64 (N*H > 65535) vs a vectorised float64 step. Bounds 5e-3.
  compile torch.compile(fullgraph=True) of chunk_rwkv7 fwd+bwd equals eager (relative error <= 1e-5).
  overlap the backward with the states pass beside the reverse pass (a second stream) equals the one-stream
          backward bit for bit (same kernels, same inputs), at a grid where the driver picks it by itself, and
          (overlap-varlen) on 11 packed sequences of 512 to 8192 tokens, H=32, where mixed lengths make it pick it.
  per-sequence  the varlen backward's token pass launched once per sequence (the dense twin's kernel, its rows
          passed as addresses, every other launch on the side stream) equals the one varlen launch bit for bit,
          on the 11 packed sequences of overlap-varlen (dplr-fast); FAIL where the per-sequence launches did not run.
  other-device  with 2 or more GPUs: chunk forward+backward (dplr-fast, D64's shape) and a decode step with every
          tensor on the second GPU while the first is the current device (a model split over GPUs in one
          process) equal the same calls made with the second GPU current, bit for bit; n/a on one GPU.
  graph   forward+backward captured in a CUDA graph (torch.cuda.graph; the driver keeps one stream under
          capture) and replayed equals the eager run bit for bit.
  pool    the decode op with a state pool (fused_mul_recurrent_rwkv7, ssm_state_indices with a padded row, 8
          sequences of 1 to 5 tokens packed with cu_seqlens, bf16, H=4, D=64, 12 slots) against one call per
          sequence from its slot's state: outputs and the slots written <= 1e-5, the other slots untouched.
--fla-max-configs N: fla's autotuners keep N of their configs each (recorded in the results' fla info).
Writes $OUT/gpu_check.json after every worker. --dry-run: CPU interpreter, tiny fp32 stand-ins.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()
DPLR = ("dplr-fast", "dplr-generic")
FLA = "fla-best"
BOUNDS = {"bfloat16": (5e-3, 8e-3), "float16": (3e-3, 3e-3), "float32": (1e-5, 1e-5)}  # (o/ht, gradients)
FLA_FACTOR, FLA_SLACK = 1.1, 1e-4  # "no worse than fla": err <= FLA_FACTOR * fla_err + FLA_SLACK
COMPILE_TOL = 1e-5


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    D: int
    dtype: str
    seed: int
    lengths: tuple[int, ...] | None = None
    h0: str = "random"
    gates: str = "rwkv7"  # or "mixed" (benchmarks.common.mixed_gates)
    w_fp32: bool = False  # w (gk) in fp32 while the rest is in dtype: the variants that read the gate in fp32


# varlen cases: sequences shorter than a chunk, ending on and just past a chunk boundary, long ones; random h0 each
VARLEN_LENGTHS = (1, 15, 16, 17, 63, 200, 1000, 37, 700)
CASES = {
    "D64": Case(2, 4096, 4, 64, "bfloat16", 11),
    "D128": Case(2, 4096, 4, 128, "bfloat16", 12),
    "fp32": Case(1, 1024, 2, 64, "float32", 13),
    "fp16": Case(1, 1024, 2, 64, "float16", 14),
    "report": Case(1, 4096, 2, 128, "bfloat16", 15, (4096,), "zeros"),
    "D256": Case(1, 4096, 2, 256, "bfloat16", 16),
    "mixed-D64": Case(2, 2048, 4, 64, "bfloat16", 17, gates="mixed"),
    "mixed-D128": Case(2, 2048, 4, 128, "bfloat16", 18, gates="mixed"),
    "mixed-fp16": Case(2, 2048, 4, 64, "float16", 19, gates="mixed"),
    "varlen-D64": Case(1, sum(VARLEN_LENGTHS), 4, 64, "bfloat16", 20, VARLEN_LENGTHS),
    "varlen-D128": Case(1, sum(VARLEN_LENGTHS), 4, 128, "bfloat16", 21, VARLEN_LENGTHS),
    "varlen-D64-w32": Case(1, sum(VARLEN_LENGTHS), 4, 64, "bfloat16", 22, VARLEN_LENGTHS, w_fp32=True),
}
DRY_CASES = {
    "D64": Case(1, 64, 1, 64, "float32", 11),
    "D128": Case(1, 32, 1, 128, "float32", 12),
    "fp32": Case(1, 32, 1, 64, "float32", 13),
    "fp16": Case(1, 32, 1, 64, "float16", 14),
    "report": Case(1, 64, 1, 128, "float32", 15, (64,), "zeros"),
    "D256": Case(1, 40, 1, 256, "float32", 16),
    "mixed-D64": Case(1, 300, 1, 64, "float32", 17, gates="mixed"),
    "mixed-D128": Case(1, 300, 1, 128, "float32", 18, gates="mixed"),
    "mixed-fp16": Case(1, 300, 1, 64, "float16", 19, gates="mixed"),
    "varlen-D64": Case(1, 63, 1, 64, "float32", 20, (1, 15, 17, 30)),
    "varlen-D128": Case(1, 63, 1, 128, "float32", 21, (1, 15, 17, 30)),
    "varlen-D64-w32": Case(1, 63, 1, 64, "float16", 22, (1, 15, 17, 30), w_fp32=True),
}
MIXED = tuple(c for c, case in CASES.items() if case.gates == "mixed")
VARLEN = tuple(c for c in CASES if c.startswith("varlen-"))

# Cases beyond the main package's head dims: each gets a package of its own, built for the GPU by "build:<case>"
WIDE = ("D256",)
WIDE_SPEC = """\
name: {name}
description: gpu_check's own package for case {case} (K=V={D}, {dtype})
targets: [{target}]
variants:
  - ops: [chunk]
    dtypes: [{dtype}]
    head_dims: [{D}]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [{bound}, null]
tuning:
  chunk.bwd: {{num_stages: 1}}
"""
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def job_groups(only: list[str] | None = None) -> list[list[str]]:
    """Jobs, grouped by worker process: dplr-gen, the two scale cases alone (a fault there must not poison
    the others' CUDA context), fla last (its first calls autotune for minutes)."""
    dplr = ([f"table:{c}:{s}" for c in ("D64", "D128") for s in DPLR] + [f"prec:{c}:{s}" for c in ("fp32", "fp16") for s in DPLR]
            + [f"gates:{c}:dplr-generic" for c in MIXED] + [f"varlen:{c}:{s}" for c in VARLEN for s in DPLR]
            + [f"report-raw:report:{s}" for s in DPLR] + [f"report-norm:report:{s}" for s in DPLR]
            + ["compile", "overlap", "overlap-varlen", "per-sequence", "other-device", "graph", "pool"])
    wide = [f"build:{c}" for c in WIDE] + [f"table:{c}:{s}" for c in WIDE for s in DPLR]
    groups = [dplr, wide, ["scale-decode"], ["scale-big"],
              [f"table:D64:{FLA}", f"table:D128:{FLA}", f"report-norm:report:{FLA}"]]
    if only:
        groups = [[j for j in g if any(j.startswith(p) for p in only)] for g in groups]
        # a wide case's accuracy jobs need its package: its build job goes first in their group
        groups = [[f"build:{c}" for c in WIDE if f"build:{c}" not in g and any(j.startswith(f"table:{c}:") for j in g)]
                  + g for g in groups]
    return [g for g in groups if g]


def wide_package_dir(case_name: str) -> Path:
    """Where build:<case> puts the case's package: a fixed place, so that a rebuild on this machine is free."""
    return Path(tempfile.gettempdir()) / "dplr-gen-check-wide" / f"check_{case_name.lower()}"


# ----------------------------------------------------------------------------------------------------------
# worker side


class Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg, self.device, self.dry = cfg, cfg["device"], cfg["dry_run"]
        self.cases = DRY_CASES if self.dry else CASES

    def package(self) -> Any:
        from dplr_gen.runtime.loader import package_at

        return package_at(self.cfg["package"])

    def package_dir(self, case_name: str) -> str:
        return str(wide_package_dir(case_name)) if case_name in WIDE else self.cfg["package"]

    def inputs(self, case: Case, raw: bool = False) -> dict[str, Any]:
        import torch

        x = C.rwkv7_case(case.B, case.T, case.H, case.D, dtype=getattr(torch, case.dtype), device=self.device,
                         seed=case.seed + (1000 if raw else 0), raw=raw, h0=case.h0,
                         n_states=None if case.lengths is None else len(case.lengths))
        if case.gates == "mixed":
            C.mixed_gates(x["w"])
        if case.w_fp32:
            x["w"] = x["w"].float()
        return x

    def run(self, job: str) -> dict[str, Any]:
        kind, *rest = job.split(":")
        if kind in ("table", "prec", "gates", "varlen", "report-norm", "report-raw"):
            return self.accuracy(self.cases[rest[0]], rest[0], rest[1], raw=kind == "report-raw")
        if kind == "build":
            return self.build_wide(rest[0])
        return {"scale-big": self.scale_big, "scale-decode": self.scale_decode, "compile": self.compile,
                "overlap": self.overlap, "overlap-varlen": self.overlap_varlen, "per-sequence": self.per_sequence,
                "other-device": self.other_device,
                "graph": self.graph,
                "pool": self.pool}[kind]()

    def accuracy(self, case: Case, case_name: str, system: str, raw: bool) -> dict[str, Any]:
        """o, ht and gradients vs float64 (raw: only whether fwd+bwd runs, and whether it is finite)."""
        op, info = C.load_op(C.SYSTEMS[system], self.package_dir(case_name))
        x = self.inputs(case, raw)
        do, dht = C.grad_outputs(x, case.seed)
        cu, _ = C.cu_tensors(case.lengths, C.SYSTEMS[system].cu_dtype, self.device)
        got = C.fwd_bwd(op, C.leaves(x), do, dht, cu)  # keywords, no cu_seqlens_cpu: the report's call
        C.sync(self.device)
        out: dict[str, Any] = {"case": case_name, "system": system, "info": info, "checksums": C.checksums(x)}
        if raw:
            return out | {"ran": True, "finite": C.all_finite(got)}
        ref = C.cached(self.cfg.get("cache_dir"), f"ref_{case_name}",
                       lambda: C.reference(x, do, dht, case.lengths), self.device)
        return out | {"errors": C.errors(got, ref)}

    def build_wide(self, case_name: str) -> dict[str, Any]:
        """The package of a case the main one does not cover, for this GPU's arch (dry run: rendered only, the
        interpreter runs the sources). Records compile time and shared memory per kernel."""
        import torch

        from dplr_gen.toolchain import build
        from dplr_gen.runtime.loader import device_target

        case, out = self.cases[case_name], wide_package_dir(case_name)
        target = "sm_90" if self.dry else device_target(torch.device("cuda"))
        spec = out.parent / f"{out.name}.yaml"
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(WIDE_SPEC.format(name=out.name, case=case_name, D=case.D, dtype=SHORT_DTYPE[case.dtype],
                                         target=target, bound=C.GATE_BOUND))
        res: dict[str, Any] = {"case": case_name, "target": target, "package": str(out), "spec": spec.read_text()}
        if self.dry:
            build.write_package(build.plan(spec, out.parent))
            return res | {"rendered_only": True}
        report = build.build(spec, jobs=os.cpu_count() or 4, out_root=out.parent)
        units = (build.read_manifest(report.out_dir) or {}).get("units", {})  # this build's, or the one it found
        res.update(seconds=round(report.seconds, 1), up_to_date=report.up_to_date,
                   refused=[f"{f.what}: {f.reason}" for f in report.refused],
                   kernels={u: [{n: k[n] for n in ("kernel", "shared", "compile_s")} for k in e["kernels"]]
                            for u, e in units.items()})
        if report.failures or report.refused:
            res["error"] = "; ".join([f"{o.unit}: {o.error[:600]}" for o in report.failures] + res["refused"])
        return res

    def scale_big(self) -> dict[str, Any]:
        """> 2**31 elements per tensor: forward only; the last (short) sequence checked against float64."""
        import torch

        from dplr_gen.runtime import ops

        H, K, tail, bulk = (1, 64, 16, 64) if self.dry else (32, 64, 256, 8192)
        n_bulk = 2 if self.dry else math.ceil(2**31 / (H * K) / bulk)
        lengths = (bulk,) * n_bulk + (tail,)
        T = sum(lengths)
        x = C.rwkv7_case(1, T, H, K, dtype=torch.float32 if self.dry else torch.bfloat16, device=self.device,
                         seed=21, n_states=len(lengths))
        cu, cu_cpu = C.cu_tensors(lengths, "int32", self.device)
        last = {n: x[n][:, -tail:] for n in ("r", "w", "k", "v", "a", "b")} | {"h0": x["h0"][-1:]}
        ref = C.reference(last, None, None, grads=False)
        out: dict[str, Any] = {"H": H, "K": K, "T": T, "lengths": f"{n_bulk} x {bulk} + {tail}", "numel": T * H * K,
                               "over_2_31": T * H * K > 2**31, "last_seq_first_element": (T - tail) * H * K}
        pkg = self.package()
        calls = {
            "chunk_fast": lambda: ops.chunk_rwkv7(r=x["r"], w=x["w"], k=x["k"], v=x["v"], a=x["a"], b=x["b"], scale=1.0,
                                                  initial_state=x["h0"], output_final_state=True, cu_seqlens=cu,
                                                  cu_seqlens_cpu=cu_cpu, lower_bound=C.GATE_BOUND, package=pkg),
            "fused_recurrent": lambda: ops.fused_recurrent_dplr_delta_rule(
                q=x["r"], k=x["k"], v=x["v"], a=x["a"], b=x["b"], gk=x["w"], scale=1.0, initial_state=x["h0"],
                output_final_state=True, cu_seqlens=cu, package=pkg),
        }
        for name, call in calls.items():
            try:
                if self.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                with torch.no_grad():
                    o, ht = call()
                C.sync(self.device)
                out[name] = {"s": time.perf_counter() - t0, "finite": bool(torch.isfinite(o).all().item()),
                             "errors": C.errors({"o": o[:, -tail:], "ht": ht[-1:]}, ref),
                             "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if self.device == "cuda" else None}
                del o, ht
            except Exception as e:  # noqa: BLE001 - the other op still runs
                out[name] = C.error_record(e)
            C.free(self.device)
        return out

    def scale_decode(self) -> dict[str, Any]:
        """One decode step with N*H > 65535 programs vs a vectorised float64 step."""
        import torch

        from dplr_gen.runtime import ops

        B, H, K = (4, 2, 64) if self.dry else (2048, 64, 64)
        x = C.rwkv7_case(B, 1, H, K, dtype=torch.float32 if self.dry else torch.bfloat16, device=self.device, seed=22)
        o, ht = ops.fused_recurrent_dplr_delta_rule(q=x["r"], k=x["k"], v=x["v"], a=x["a"], b=x["b"], gk=x["w"],
                                                    initial_state=x["h0"], output_final_state=True,
                                                    package=self.package())
        ro, rht = C.one_step_reference(x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], x["h0"], K**-0.5)
        return {"B": B, "H": H, "K": K, "programs_NH": B * H, "errors": C.errors({"o": o, "ht": ht}, {"o": ro, "ht": rht})}

    def compile(self) -> dict[str, Any]:
        """torch.compile(fullgraph=True) around chunk_rwkv7, fwd+bwd, against eager on the same inputs."""
        import torch

        from dplr_gen.runtime.dispatch import PackageOps

        pkg = self.package()
        case = Case(1, 32, 1, 64, "float32", 31) if self.dry else Case(1, 256, 2, 64, "bfloat16", 31)

        def f(r: Any, w: Any, k: Any, v: Any, a: Any, b: Any, h0: Any) -> Any:
            return PackageOps(pkg).chunk_rwkv7(r=r, w=w, k=k, v=v, a=a, b=b, scale=1.0, initial_state=h0,
                                   output_final_state=True, lower_bound=C.GATE_BOUND)

        def as_op(fn: Any) -> Any:
            return lambda xl, cu=None, cu_cpu=None: fn(*(xl[n] for n in C.INPUTS))

        x = self.inputs(case)
        do, dht = C.grad_outputs(x, case.seed)
        eager = C.fwd_bwd(as_op(f), C.leaves(x), do, dht)
        t0 = time.perf_counter()
        comp = C.fwd_bwd(as_op(torch.compile(f, fullgraph=True)), C.leaves(x), do, dht)
        C.sync(self.device)
        return {"compile_and_first_call_s": time.perf_counter() - t0, "errors": C.errors(comp, eager)}

    def overlap(self) -> dict[str, Any]:
        """The backward with the states pass on a side stream (chunk_driver.forced(overlap=True)) against the same
        backward on one stream (False): the same kernels on the same inputs, so every output must be equal."""
        return self._overlap_case(Case(1, 64, 1, 64, "float32", 32) if self.dry else CASES["D64"])

    def overlap_varlen(self) -> dict[str, Any]:
        """As ``overlap``, on a varlen batch of mixed lengths (the driver counts its grids at mean over longest
        sequence length, so it picks the side stream where a dense batch of as many programs would not)."""
        lens = (1, 15, 17, 30) if self.dry else C.LENGTHS11
        H = 1 if self.dry else 32
        return self._overlap_case(Case(1, sum(lens), H, 64, "float32" if self.dry else "bfloat16", 36, lens))

    def _overlap_case(self, case: Case) -> dict[str, Any]:
        x = self.inputs(case)
        # would the driver pick the side stream here by itself (the variant's knob, the grid)?
        picked = C.overlap_picked(self.cfg["package"], x, case.lengths) if x["r"].is_cuda else None
        return {"picked_by_driver": picked, "errors": self._forced_on_against_off(case, x, "overlap")}

    def _forced_on_against_off(self, case: Case, x: dict[str, Any], option: str) -> dict[str, float]:
        """dplr-fast's forward+backward on ``x`` (int64 cu_seqlens for a varlen case) with the driver option
        ``option`` forced on, against the same with it forced off: the errors of each quantity."""
        from dplr_gen.runtime import chunk_driver

        op, _ = C.load_op(C.SYSTEMS["dplr-fast"], self.cfg["package"])
        do, dht = C.grad_outputs(x, case.seed)
        cu, _ = C.cu_tensors(case.lengths, "int64", self.device)
        out = {}
        for mode in (False, True):
            with chunk_driver.forced(**{option: mode}):
                out[mode] = C.fwd_bwd(op, C.leaves(x), do, dht, cu)
        return C.errors(out[True], out[False])

    def per_sequence(self) -> dict[str, Any]:
        """The varlen token pass launched per sequence against the one varlen launch, both forced, on the
        sequences of ``overlap_varlen``; ``launched``: how many per-sequence token passes ran (0: nothing
        was compared)."""
        from dplr_gen.runtime import chunk_driver

        lens = (1, 15, 17, 30) if self.dry else C.LENGTHS11
        case = Case(1, sum(lens), 1 if self.dry else 32, 64, "float32" if self.dry else "bfloat16", 37, lens)
        real, launched = chunk_driver._token_pass_per_sequence, []

        def counted(*a: Any, **k: Any) -> None:
            launched.append(1)
            real(*a, **k)

        chunk_driver._token_pass_per_sequence = counted
        try:
            errors = self._forced_on_against_off(case, self.inputs(case), "per_sequence")
        finally:
            chunk_driver._token_pass_per_sequence = real
        return {"launched": len(launched), "errors": errors,
                **({} if launched else {"error": "the per-sequence token pass did not run"})}

    def other_device(self) -> dict[str, Any]:
        """The ops on tensors of a device that is not the current one against the same calls with it current
        (``n/a``: fewer than two GPUs, or the dry run's CPU)."""
        import torch

        if self.dry or torch.cuda.device_count() < 2:
            return {"n/a": f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"}
        from dplr_gen.runtime import ops

        case = CASES["D64"]
        op, _ = C.load_op(C.SYSTEMS["dplr-fast"], self.cfg["package"])
        pkg = self.package()
        other = torch.device("cuda", 1)
        x = {n: (t.to(other) if isinstance(t, torch.Tensor) else t) for n, t in self.inputs(case).items()}
        do, dht = C.grad_outputs(x, case.seed)

        def decode() -> dict[str, Any]:
            with torch.inference_mode():
                o, ht = ops.fused_recurrent_rwkv7(*(x[n][:, :1] for n in ("r", "w", "k", "v", "a", "b")),
                                                  scale=1.0, initial_state=x["h0"], output_final_state=True,
                                                  package=pkg)
            return {"o": o, "ht": ht}

        torch.cuda.set_device(0)
        away = {**C.fwd_bwd(op, C.leaves(x), do, dht), **{"step_" + k: v for k, v in decode().items()}}
        current = torch.cuda.current_device()
        with torch.cuda.device(other):
            home = {**C.fwd_bwd(op, C.leaves(x), do, dht), **{"step_" + k: v for k, v in decode().items()}}
        torch.cuda.synchronize(other)
        from dplr_gen.testing import rel_err

        errors = {**C.errors(away, home), **{k: rel_err(away[k], home[k]) for k in ("step_o", "step_ht")}}
        return {"current_device_during_call": current, "errors": errors}

    def graph(self) -> dict[str, Any]:
        """One training step (forward, then torch.autograd.grad) captured in a CUDA graph after two warm-up
        steps on a side stream (PyTorch's recipe), replayed, against the eager step on the same inputs."""
        import torch

        case = Case(1, 64, 1, 64, "float32", 33) if self.dry else CASES["D64"]
        op, _ = C.load_op(C.SYSTEMS["dplr-fast"], self.cfg["package"])
        x = self.inputs(case)
        do, dht = C.grad_outputs(x, case.seed)
        eager = C.fwd_bwd(op, C.leaves(x), do, dht)
        if self.dry:  # no CUDA graphs on the CPU: the eager step against itself
            return {"captured": False, "errors": C.errors(C.fwd_bwd(op, C.leaves(x), do, dht), eager)}
        xl = C.leaves(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                C.fwd_bwd(op, xl, do, dht)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = C.fwd_bwd(op, xl, do, dht)
        g.replay()
        torch.cuda.synchronize()
        return {"captured": True, "errors": C.errors(out, eager)}

    def pool(self) -> dict[str, Any]:
        """A decode step over a state pool (sequence i reads and writes slot ``slots[i]`` in place; -1: a padded
        row, zero state, nothing written) against one call per sequence, each from its slot's state as
        ``initial_state`` (the padded row from zeros): outputs, the written slots, and every other slot unchanged."""
        import torch

        from dplr_gen.runtime import ops
        from dplr_gen.testing import rel_err

        lens, slots, n_slots = (1, 3, 2, 1, 5, 1, 2, 4), [5, 0, -1, 2, 11, 7, 3, 9], 12
        H, D = (1, 64) if self.dry else (4, 64)
        dtype = torch.float32 if self.dry else torch.bfloat16
        x = C.rwkv7_case(1, sum(lens), H, D, dtype=dtype, device=self.device, seed=34, h0="none")
        kk, rate = -x["a"], torch.rand_like(x["b"])  # RWKV-7's decoding form: kk and the in-context rate
        gen = torch.Generator(device=self.device).manual_seed(35)
        before = torch.randn(n_slots, H, D, D, generator=gen, device=self.device).mul_(0.5)
        pool = before.clone()
        offs = C.cu_seqlens_of(lens)
        cu = torch.tensor(offs, dtype=torch.int32, device=self.device)
        pkg = self.package()
        with torch.inference_mode():
            o, _ = ops.fused_mul_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], kk, rate, scale=1.0,
                                                 initial_state=pool, cu_seqlens=cu, package=pkg,
                                                 ssm_state_indices=torch.tensor(slots, dtype=torch.int32))
            ref_o, ref_states = [], []
            for i, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
                h0 = before[slots[i]:slots[i] + 1] if slots[i] >= 0 else torch.zeros_like(before[:1])
                part = [t[:, bos:eos] for t in (x["r"], x["w"], x["k"], x["v"], kk, rate)]
                oi, hi = ops.fused_mul_recurrent_rwkv7(*part, scale=1.0, initial_state=h0.clone(),
                                                       output_final_state=True, package=pkg)
                ref_o.append(oi)
                ref_states.append(hi)
        written = [i for i, s in enumerate(slots) if s >= 0]
        others = [s for s in range(n_slots) if s not in slots]
        return {"errors": {
            "o": rel_err(o, torch.cat(ref_o, 1)),
            "ht": rel_err(pool[[slots[i] for i in written]], torch.cat([ref_states[i] for i in written])),
            "untouched": rel_err(pool[others], before[others]),
        }}


def worker_main(cfg: dict[str, Any], jobs: list[str]) -> int:
    C.worker_setup(cfg["device"])
    return C.worker_loop(jobs, Worker(cfg).run, cfg["device"])


# ----------------------------------------------------------------------------------------------------------
# parent side: judge


def judge(err: Any, bound: float, fla: Any = None) -> tuple[str, str]:
    """PASS/FAIL of one error, and why: above the bound, or worse than fla (err > 1.1 * fla + 1e-4)."""
    if not isinstance(err, (int, float)) or not math.isfinite(err):
        return "FAIL", f"error is {err}"
    if err > bound:
        return "FAIL", f"{err:.2e} > bound {bound:.0e}"
    if isinstance(fla, (int, float)) and math.isfinite(fla) and err > FLA_FACTOR * fla + FLA_SLACK:
        return "FAIL", f"{err:.2e} worse than fla {fla:.2e} (x{FLA_FACTOR} + {FLA_SLACK:.0e})"
    return "PASS", ""


def bounds_for(dtype: str, quantity: str) -> float:
    state, grad = BOUNDS[dtype]
    return state if quantity in ("o", "ht") else grad


def judge_all(results: dict[str, dict[str, Any]], cases: dict[str, Case], dry: bool = False) -> list[dict[str, Any]]:
    """One row per check: {"check", "system", "cells": {quantity: (err, status, note)}, "status", "error"}."""
    rows: list[dict[str, Any]] = []

    def acc_row(kind: str, case_name: str, system: str, compare_fla: bool) -> None:
        job = f"{kind}:{case_name}:{system}"
        r = results.get(job, {"error": "not run"})
        fla = results.get(f"{kind}:{case_name}:{FLA}", {}).get("errors", {}) if compare_fla and system != FLA else {}
        cells = {}
        for q in C.QUANTITIES:
            e = r.get("errors", {}).get(q)
            st, note = judge(e, bounds_for(cases[case_name].dtype, q), fla.get(q))
            cells[q] = (e, st, note)
        if compare_fla and system != FLA and not fla:
            cells = {q: (e, st, note or "fla n/a: bound only") for q, (e, st, note) in cells.items()}
        status = "FAIL" if r.get("error") or any(c[1] == "FAIL" for c in cells.values()) else "PASS"
        if system == FLA:  # the yardstick, not under test: its cells are judged against the bounds for information
            status = "n/a" if r.get("error") else "info"
        rows.append({"check": f"{kind}:{case_name}", "system": system, "cells": cells, "error": r.get("error"),
                     "status": status})

    for c in ("D64", "D128"):
        for s in (*DPLR, FLA):
            acc_row("table", c, s, True)
    for c in WIDE:
        r = results.get(f"build:{c}", {"error": "not run"})
        rows.append({"check": f"build:{c}", "system": "dplr-gen", "cells": {}, "error": r.get("error"),
                     "status": "FAIL" if r.get("error") else "PASS"})
        for s in DPLR:
            acc_row("table", c, s, False)
    for c in ("fp32", "fp16"):
        for s in DPLR:
            acc_row("prec", c, s, False)
    for c in MIXED:
        acc_row("gates", c, "dplr-generic", False)
    for c in VARLEN:
        for s in DPLR:
            acc_row("varlen", c, s, False)
    for s in (*DPLR, FLA):
        acc_row("report-norm", "report", s, True)
    for s in DPLR:
        r = results.get(f"report-raw:report:{s}", {"error": "not run"})
        fin = r.get("finite", {})
        rows.append({"check": "report-raw:report", "system": s, "error": r.get("error"),
                     "cells": {q: (None, "finite" if fin.get(q) else "non-finite", "") for q in C.QUANTITIES if q in fin},
                     "status": "PASS" if r.get("ran") else "FAIL"})
    big = results.get("scale-big", {"error": "not run"})
    for op in ("chunk_fast", "fused_recurrent"):
        r = big.get(op, big if "error" in big else {"error": "not run"})
        cells = {q: (r.get("errors", {}).get(q), *judge(r.get("errors", {}).get(q), 5e-3)) for q in ("o", "ht")}
        err = r.get("error") or (None if dry or big.get("over_2_31", True) else "q.numel() not over 2**31")
        rows.append({"check": f"scale-big:{op}", "system": "dplr-fast" if op == "chunk_fast" else "fused_recurrent",
                     "cells": cells, "error": err,
                     "status": "FAIL" if err or any(c[1] == "FAIL" for c in cells.values()) else "PASS"})
    for job, bound, system in (("scale-decode", 5e-3, "fused_recurrent"), ("compile", COMPILE_TOL, "dplr-fast"),
                               ("overlap", 0.0, "dplr-fast"), ("overlap-varlen", 0.0, "dplr-fast"),
                               ("per-sequence", 0.0, "dplr-fast"), ("other-device", 0.0, "dplr-fast"),
                               ("graph", 0.0, "dplr-fast"),
                               ("pool", COMPILE_TOL, "fused_recurrent")):
        r = results.get(job, {"error": "not run"})
        if "n/a" in r:  # a check this machine cannot make (other-device on one GPU): said so, neither way
            rows.append({"check": job, "system": system, "cells": {}, "error": r["n/a"], "status": "n/a"})
            continue
        cells = {q: (e, *judge(e, bound)) for q, e in r.get("errors", {}).items()}
        rows.append({"check": job, "system": system, "cells": cells, "error": r.get("error"),
                     "status": "FAIL" if r.get("error") or not cells or any(c[1] == "FAIL" for c in cells.values()) else "PASS"})
    return rows


def input_group(job: str) -> str | None:
    """Jobs "kind:case:system" of one kind and case must have seen the same tensors."""
    parts = job.split(":")
    return ":".join(parts[:2]) if len(parts) == 3 else None


def render(rows: list[dict[str, Any]]) -> str:
    def cell(r: dict[str, Any], q: str) -> str:
        if q not in r["cells"]:
            return ""
        if r.get("error"):
            return "-"
        e, st, _ = r["cells"][q]
        mark = "" if st == "PASS" else (" " + st if st == "FAIL" else st)
        return (f"{e:.1e}" if isinstance(e, (int, float)) else "") + mark

    table = C.format_table(
        ["check", "system", *C.QUANTITIES, "status"],
        [[r["check"], r["system"], *[cell(r, q) for q in C.QUANTITIES], r["status"]] for r in rows],
        title=f"gpu_check: relative norm error vs float64; PASS: o/ht <= 5e-3, gradients <= 8e-3 (bf16), fp32 1e-5, "
              f"fp16 3e-3, and err <= {FLA_FACTOR} * fla + {FLA_SLACK:.0e}")
    fails = []
    for r in rows:
        if r["status"] != "FAIL":
            continue
        why = [] if r.get("error") else [f"{q} {note}" for q, (_, st, note) in r["cells"].items() if st == "FAIL"]
        fails.append(f"FAIL {r['check']} {r['system']}: " + "; ".join(why + ([r["error"][:300]] if r.get("error") else [])))
    notes = [f"note: {r['check']} {r['system']} (the yardstick) did not run: {(r['error'] or '')[:200]}; "
             "'no worse than fla' was not checked there" if r["system"] == FLA
             else f"note: {r['check']} not checked on this machine: {(r['error'] or '')[:200]}"
             for r in rows if r["status"] == "n/a"]
    return table + "\n\n" + "\n".join(notes + fails + ([] if fails else ["all checks PASS"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fla-max-configs", type=int, default=0,
                    help="fla-core's autotuners keep this many of their configs (0: all); its D=128 autotuning "
                         "alone outlasts a 10-minute GPU call")
    ap.add_argument("--only", help="comma list of job prefixes: table, prec, varlen, report, scale, compile, build, table:D64, ...")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for everything (default 560)")
    ap.add_argument("--deadline", type=float, help="absolute time.time() to finish by (overrides --budget)")
    ap.add_argument("--package", default=str(C.REPO / "generated" / "hopper"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny fp32 stand-ins, rendered package")
    ap.add_argument("--resume", help="earlier gpu_check.json, or 'last' (this machine's previous run): "
                                     "its jobs without errors are reused")
    ap.add_argument("--allow-jit", action="store_true", help="let dplr-gen compile at run time (else DPLR_GEN_NO_JIT=1)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker), args.jobs.split(","))

    deadline = C.deadline_from(args)
    dry = args.dry_run or args.device == "cpu"
    device = "cpu" if dry else "cuda"
    cfg = {"device": device, "dry_run": dry, "package": C.dry_run_package() if dry else args.package,
           "cache_dir": tempfile.mkdtemp(prefix="dplr-check-")}
    only = [p.strip() for p in args.only.split(",")] if args.only else None
    groups = job_groups(only)
    machine = C.machine_info(device)
    results = C.load_resume(args.resume, "gpu_check", machine)
    for c in WIDE:  # a resumed build is no package on this machine: build (or find) it again where it is needed
        if any(j.startswith(f"table:{c}:") and j not in results for g in groups for j in g):
            results.pop(f"build:{c}", None)
    report = C.Report(C.out_dir() / "gpu_check.json", script="gpu_check")
    report.data = {"machine": machine, "config": {**cfg, "argv": sys.argv[1:]},
                   "criteria": {"bounds_o_ht_grad": BOUNDS, "no_worse_than_fla": f"err <= {FLA_FACTOR} * fla_err + {FLA_SLACK}",
                                "compile_vs_eager": COMPILE_TOL, "scale": 5e-3,
                                "report_raw": "fwd+bwd runs to completion; finiteness recorded, not judged"},
                   "cases": {k: vars(v) for k, v in (DRY_CASES if dry else CASES).items()}, "results": results}
    report.save()
    extra = {C.FLA_MAX_CONFIGS_ENV: str(args.fla_max_configs)} if args.fla_max_configs else None
    env = C.worker_env(device, extra, allow_jit=args.allow_jit)
    for group in groups:
        jobs = [j for j in group if j not in results]
        if jobs:
            print(f"== {len(jobs)} job(s): {', '.join(jobs)}; {deadline - time.time():.0f} s left", flush=True)
            results.update(C.run_jobs(C.worker_cmd(SCRIPT, cfg), jobs, deadline, env, lambda s: print(s, flush=True)))
            report.save()
    rows = judge_all(results, DRY_CASES if dry else CASES, dry)
    if only:
        ran = {j for g in groups for j in g}
        rows = [r for r in rows if r["check"] in ran
                or any(r["check"].startswith(p) or f"{r['check']}:{r['system']}".startswith(p) for p in only)]
    count = {st: sum(r["status"] == st for r in rows) for st in ("PASS", "FAIL")}
    report.data.update(rows=rows, same_inputs=C.same_inputs(results, input_group),
                       summary={"pass": count["PASS"], "fail": count["FAIL"]})
    report.save()
    print("\n" + render(rows))
    print(f"\nsame inputs across systems: {report.data['same_inputs']}")
    print(f"{report.data['summary']['pass']} passed, {report.data['summary']['fail']} failed; wrote {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
